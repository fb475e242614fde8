"""bench plan's decode run: rows that already hold a private full block keep their plan as they
fill blocks; rows whose full blocks are all shared rebuild it when they fill their first."""
from vllm_chunkattn.bench.plan import batch, decode_run


def test_rows_past_a_private_full_block_keep_the_plan_for_the_whole_run():
    table, lens = batch(32, 4, shared=256, private=40, block_size=16)   # 2 private full blocks
    builds, count_key_builds, us = decode_run(table, lens, 16, steps=40)
    assert builds == 1 and count_key_builds > 20 and us > 0


def test_rows_with_only_shared_full_blocks_rebuild_when_they_fill_one():
    table, lens = batch(32, 4, shared=256, private=1, block_size=16)    # no private full block
    builds, _, _ = decode_run(table, lens, 16, steps=40)
    # Every row fills its first private block within 16 steps, on staggered steps: several
    # rebuilds then; after that, growth keeps the plan.
    assert 2 <= builds <= 17
