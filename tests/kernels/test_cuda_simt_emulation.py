"""The CUDA TPP kernel's own source (csrc/cuda/tpp_kernels.cuh) and the CUDA op's host logic
(csrc/cuda/tpp_host.h: checks, TppParams, the split-KV choice) run on the CPU through the SIMT
emulation in csrc/cuda_emu, against tpp_decode_reference. Runs without a GPU.

The emulation computes ldmatrix / mma.sync fragments from the PTX ISA's layouts, lands cp.async
data only at the wait that covers it (or, `at_issue`, at once), lets warps drift apart, starts
shared memory as NaN and checks every ldmatrix / cp.async address: a wrong fragment layout, a
missing wait or __syncthreads, or an out-of-bounds access fails here. Not a timing or hardware
test: tests/kernels/test_ops_cuda.py runs the same cases on a GPU."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.ops import CUDA_BLOCK_SIZES
from vllm_chunkattn.plan import TppPlan, build_plan, empty_plan
from vllm_chunkattn.plan.capacity import PlanCapacity, pad_plan
from vllm_chunkattn.bench.cuda_work import split_spare_slots, tpp_work
from vllm_chunkattn.bench.tree_batches import (COMPACT_STAGE_CASES, TREE_SPECS,
                                               assert_matches_reference, caterpillar_batch,
                                               named_tree, pad_batch, poison_unread_kv,
                                               random_tree_batch, value_cache_elsewhere)

H100_RESIDENT_CTAS = 132 * 2   # an H100's SMs x partial-kernel CTAs per SM at head 128
HEADS = [(32, 32), (32, 8), (8, 1), (9, 3)]
WIDE_GROUPS = [(48, 1), (80, 1)]


def nan_workspace(slots, num_heads, head_size):
    """partial_o / m / l of `slots` rows, NaN until the op writes them."""
    return (torch.full((slots, num_heads, head_size), float("nan")),
            torch.full((slots, num_heads), float("nan")), torch.full((slots, num_heads), float("nan")))


def run(emu, b, plan, spare_slots=0, seed=0, at_issue=False, resident_ctas=H100_RESIDENT_CTAS,
        workspace=None, **variant):
    """workspace: nan_workspace's tensors to run in (default: plan.num_partials + spare_slots).
    variant: the op's sliding_window, soft_cap, sinks."""
    num_seqs, num_heads, head_size = b.query.shape
    ws = workspace or nan_workspace(max(plan.num_partials + spare_slots, 1), num_heads, head_size)
    out = torch.full_like(b.query, float("nan"))
    lse = torch.full((num_seqs, num_heads), float("nan"))
    emu.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                   *plan.tensors(), *ws, b.scale, out, lse, **variant,
                   resident_ctas=resident_ctas, seed=seed, cp_async_lands_at_issue=at_issue)
    return out, lse


def batch(spec, seed=0, **kw):
    return random_tree_batch(seed, **{**named_tree(spec), **kw})


def plan_of(b):
    return build_plan(b.block_table, b.seq_lens, b.block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
def test_tree_specs(emu, spec, dtype):
    b = batch(spec, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=dtype)
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


@pytest.mark.parametrize("at_issue", [False, True])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_runs_turn_the_pipeline_over(emu, dtype, head_size, at_issue):
    b = batch("long", seed=1, num_heads=16, num_kv_heads=4, head_size=head_size, block_size=16,
              dtype=dtype)
    plan = plan_of(b)
    assert max(b.seq_lens.tolist()) > 4 * 64          # several smem stages of 64 (32) tokens
    assert_matches_reference(b, plan, *run(emu, b, plan, at_issue=at_issue))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", HEADS)
def test_shapes(emu, heads, head_size, dtype):
    # GQA groups 1, 3, 4, 8: chunk CTAs of 64, 63, 64 and 64 rows, sequence CTAs of 1-16 heads.
    b = batch("system_prompts", seed=2, num_heads=heads[0], num_kv_heads=heads[1],
              head_size=head_size, block_size=64, dtype=dtype)
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


@pytest.mark.parametrize("heads", WIDE_GROUPS)
def test_wide_groups(emu, heads):
    # MQA-like groups past one CTA's rows: sequence CTAs tile the group (48 and 80 heads: 3 and
    # 5 tiles of 16), chunk CTAs hold one sharer (48) or tile the group too (80: 2 tiles of 64).
    b = batch("system_prompts", seed=8, num_heads=heads[0], num_kv_heads=heads[1], head_size=128,
              block_size=16, dtype=torch.bfloat16)
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
def test_every_advertised_block_size(emu, block_size):
    b = batch("system_prompts", seed=3, num_heads=16, num_kv_heads=4, head_size=128,
              block_size=block_size, dtype=torch.bfloat16)
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


@pytest.mark.parametrize("forced", [(2, 1), (1, 3), (3, 4), (16, 16)])
@pytest.mark.parametrize("spec", ["single_prefix", "deep_tree", "long"])
def test_forced_splits(emu, splits, spec, forced):
    b = batch(spec, seed=4, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
              dtype=torch.float16)
    plan = plan_of(b)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    assert_matches_reference(b, plan, *run(emu, b, plan, spare_slots=spare))


@pytest.mark.parametrize("spare_slots", [4096, 0])
def test_default_split_heuristic(emu, spare_slots):
    # One long prefix, few rows: sized for an H100 the host code splits the prefix and the
    # tails across CTAs when the workspace has spare slots, and not at all without them.
    b = random_tree_batch(5, fanouts=[1, 4], max_node_blocks=40, max_private_blocks=40,
                          num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                          dtype=torch.bfloat16)
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan, spare_slots=spare_slots))


def test_empty_plan(emu):
    b = batch("system_prompts", num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    plan = empty_plan(b.query.shape[0])
    assert_matches_reference(b, plan, *run(emu, b, plan))


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_kv_no_row_holds_is_never_let_in(emu, head_size):
    """Every cache row no sequence reads holds NaN (poison_unread_kv): a stage's tokens past its
    run must land as zeros (cp.async's zero fill)."""
    b = batch("long", seed=3, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
              dtype=torch.float16)
    assert poison_unread_kv(b) > 16 and b.key_cache[0].isnan().all()
    assert any(n % 64 for n in b.seq_lens.tolist())                  # runs end inside a stage
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


def test_batch_order_invariance(emu):
    b = batch("deep_tree", seed=6, num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.float16)
    out, lse = run(emu, b, plan_of(b))
    perm = torch.randperm(b.query.shape[0], generator=torch.Generator().manual_seed(0))
    b.query, b.block_table, b.seq_lens = b.query[perm], b.block_table[perm], b.seq_lens[perm]
    out_p, lse_p = run(emu, b, plan_of(b))
    torch.testing.assert_close(out_p, out[perm], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse_p, lse[perm], atol=1e-4, rtol=1e-4)


def test_same_bits_whatever_the_schedule(emu, splits):
    # CTA order, thread order, warp drift and when cp.async data lands change nothing: every
    # value has one writer and one order of arithmetic (no race, no order dependence).
    b = batch("long", seed=7, num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    plan = plan_of(b)
    splits(3, 2)
    spare = split_spare_slots(plan, b.query.shape[0], 3, 2)
    first = run(emu, b, plan, spare_slots=spare)
    for seed, at_issue in [(1, False), (2, True), (3, True)]:
        out, lse = run(emu, b, plan, spare_slots=spare, seed=seed, at_issue=at_issue)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


def test_capacity_mode_padding(emu):
    # What a captured FULL decode graph replays: rows padded with seq_len 0, the plan padded to
    # the batch's capacities (empty nodes, unused partial ids), a too-deep tree pruned to fit.
    kw = dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.float16)
    rows, width = 12, 12
    cap = PlanCapacity.for_batch(rows, width)
    for b in [random_tree_batch(8, max_seqs=10, fanouts=[3, 4], max_node_blocks=3,
                                max_private_blocks=2, **kw), caterpillar_batch(11, **kw)]:
        n = b.query.shape[0]
        exact = plan_of(b)
        pad_batch(b, rows, width)
        plan = pad_plan(build_plan(b.block_table, b.seq_lens, b.block_size,
                                   max_partials=cap.num_partials,
                                   max_node_blocks=cap.num_node_blocks), cap)
        out, lse = run(emu, b, plan)
        real = TppPlan(n, exact.num_nodes, exact.num_partials, *exact.tensors())
        b.query, b.block_table, b.seq_lens = b.query[:n], b.block_table[:n], b.seq_lens[:n]
        assert_matches_reference(b, real, out[:n], lse[:n])
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        assert torch.isneginf(lse[n:]).all()


@pytest.mark.parametrize("spec", ["system_prompts", "deep_tree", "long", "no_sharing"])
def test_shared_nodes_alone(emu, spec):
    # bench's ours_with_fi_tails: every row's seq_len cut to the tokens its shared nodes cover,
    # so rows with nodes have no private tail at all and rows without any have seq_len 0.
    b = batch(spec, seed=4, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
              dtype=torch.bfloat16)
    plan = plan_of(b)
    b.seq_lens = (plan.seq_num_shared_blocks * b.block_size).to(torch.int32)
    assert (b.seq_lens > 0).any() == (spec != "no_sharing")      # no_sharing: every row empty
    out, lse = run(emu, b, plan)
    assert_matches_reference(b, plan, out, lse)
    empty = b.seq_lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("shared_blocks,resident", [(40, 32), (80, 6)])
def test_a_padded_plan_splits_like_its_tree(emu, shared_blocks, resident):
    # A CUDA graph replays plans padded to its batch size's capacities: rows - 1 nodes, most of
    # them empty. Read as work, that padding would make the host choose one chunk-first split
    # (a captured step up to 4x slower than eager on an H200). So the CTAs choose from the real
    # tree: the same splits, so the same slots written, as the exact plan's host choice.
    # resident_ctas is set so the padded shapes look like a full wave and the real tree does not
    # (at 6, the real tree's choice, 3 splits, is fewer than its node's tokens allow, 5).
    from vllm_chunkattn.bench.kv_pool import KvPool
    rows, block_size = 12, 16
    pool = KvPool(shared_blocks + 3 * rows + 1, block_size, 2, 64, torch.float16, "cpu",
                  "paged_nhd")
    b = pool.batch(n_p=shared_blocks * block_size + 2 * block_size, n_s=shared_blocks * block_size,
                   b=rows, num_heads=8, seed=shared_blocks)
    cap = PlanCapacity.for_batch(rows, b.block_table.shape[1])
    exact = build_plan(b.block_table, b.seq_lens, block_size)
    padded = pad_plan(build_plan(b.block_table, b.seq_lens, block_size,
                                 max_partials=cap.num_partials,
                                 max_node_blocks=cap.num_node_blocks), cap)

    def written_slots(plan):
        # Only the CUDA workspace's split spares vary: the exact and padded runs get the same.
        ws = nan_workspace(cap.num_partials + 8 * rows, 8, 64)
        out, lse = run(emu, b, plan, resident_ctas=resident, workspace=ws)
        assert_matches_reference(b, exact, out, lse)
        return int((~ws[1][:, 0].isnan()).sum())

    exact_slots = written_slots(exact)
    assert exact_slots >= 2 * exact.num_partials           # the tree's own choice splits its node
    assert written_slots(padded) == exact_slots
    work = tpp_work(emu, rows, 8, 2, block_size, cap.num_nodes, cap.num_partials,
                    cap.num_node_blocks, b.block_table.shape[1], cap.num_partials + 8 * rows,
                    resident)
    assert work["device_splits"] == 1 and work["chunk_splits"] == 1


@pytest.mark.parametrize("stage", ["64", "32"])
@pytest.mark.parametrize("resident", [2, 5])
def test_a_padded_plans_ctas_loop_over_every_item(emu, monkeypatch, resident, stage):
    # A padded plan's grid holds one wave of chunk CTAs (resident_ctas / kv heads), whatever its
    # capacities; each loops over the real tree's (split, window) items. A deep tree has more
    # items than CTAs: every item must still be attended once (and smem reused safely), in either
    # of the partial launch's stages (CHUNKATTN_PARTIAL_STAGE_TOKENS).
    monkeypatch.setenv("CHUNKATTN_PARTIAL_STAGE_TOKENS", stage)
    b = batch("deep_tree", num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    rows, width = b.query.shape[0], b.block_table.shape[1]
    cap = PlanCapacity.for_batch(rows, width)
    exact = plan_of(b)
    padded = pad_plan(build_plan(b.block_table, b.seq_lens, b.block_size,
                                 max_partials=cap.num_partials,
                                 max_node_blocks=cap.num_node_blocks), cap)
    slots = cap.num_partials + 8 * rows
    exact_work = tpp_work(emu, rows, 8, 2, b.block_size, exact.num_nodes, exact.num_partials,
                          exact.num_shared_blocks, width, slots, resident)
    work = tpp_work(emu, rows, 8, 2, b.block_size, cap.num_nodes, cap.num_partials,
                    cap.num_node_blocks, width, slots, resident)
    assert work["device_splits"] == 1 and work["chunk_ctas"] == (resident + 1) // 2
    assert exact_work["chunk_ctas"] >= 3 * work["chunk_ctas"]    # three items or more a CTA
    for seed in range(2):                                        # warps drift apart differently
        out, lse = run(emu, b, padded, seed=seed, resident_ctas=resident,
                       workspace=nan_workspace(slots, 8, 64))
        assert_matches_reference(b, exact, out, lse)


def test_refuses_what_the_kernel_cannot_take(emu):
    b = batch("batch_1", dtype=torch.float32, head_size=64)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        run(emu, b, plan_of(b))
    b = batch("batch_1", dtype=torch.float16, head_size=80)
    with pytest.raises(RuntimeError, match="head_size must be 64, 96, 128 or 256"):
        run(emu, b, plan_of(b))


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_refuses_a_scale_that_is_not_positive(emu, scale):
    # The kernel scales each row's max of the raw scores alone (mask_and_max): a negative scale
    # would make it the min. The CPU op refuses the same (tests/kernels/test_ops_cpu.py).
    b = batch("batch_1", dtype=torch.float16, head_size=64)
    b.scale = scale
    with pytest.raises(RuntimeError, match="scale must be positive and finite"):
        run(emu, b, plan_of(b))


@pytest.mark.parametrize("scale", [1e-3, 0.3, 4.0])
def test_any_positive_scale(emu, scale):
    # The scale reaches the kernel's softmax twice: once on each row's max, once in the exponent's
    # FFMA. Near-uniform weights (1e-3) to a few dominant tokens (4.0, scores of a few units):
    # masked last stages and chunk partials included (system_prompts: shared nodes, private tails).
    b = batch("system_prompts", seed=5, num_heads=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    b.scale = scale
    plan = plan_of(b)
    assert_matches_reference(b, plan, *run(emu, b, plan))


def test_an_out_of_range_block_id_is_an_error_not_a_read(emu):
    # The CUDA op reads no plan data (PlanCache checks it on the host, per step); past that check
    # a bad id would read another tensor's memory on a GPU. The emulation checks every address.
    b = batch("no_sharing", num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    plan = plan_of(b)
    b.block_table[0, 0] = b.key_cache.shape[0] + 1000
    with pytest.raises(RuntimeError, match="outside every tensor of the call"):
        run(emu, b, plan)


def test_the_backends_shared_memory_figure_is_the_kernels(emu):
    # The backend refuses head 256 on 99 KB GPUs from cuda_fit's table (needed before any
    # build): it must be the shared memory the kernel's launch asks for, at every head size.
    from vllm_chunkattn.ops import cuda_fit
    assert sorted(cuda_fit.PARTIAL_SMEM_BYTES) == [64, 96, 128, 256]
    for head_size, need in cuda_fit.PARTIAL_SMEM_BYTES.items():
        assert need == emu.partial_smem_bytes(head_size)


@pytest.mark.parametrize("cap", [1, 3, 5])
@pytest.mark.parametrize("spec", ["deep_tree", "long"])
def test_a_final_cta_merges_its_slots_in_batches(emu, splits, monkeypatch, spec, cap):
    # A final CTA lists the slots it merges in smem, thousands at a time; a short list (forced)
    # makes the rows of these trees (up to 16 splits of each chunk partial, then the tail's)
    # go through several batches, fewer slots than KV parts in some.
    b = batch(spec, seed=6, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
              dtype=torch.bfloat16)
    plan = plan_of(b)
    splits(16, 4)
    monkeypatch.setenv("CHUNKATTN_SLOT_LIST_CAP", str(cap))
    spare = split_spare_slots(plan, b.query.shape[0], 16, 4)
    assert_matches_reference(b, plan, *run(emu, b, plan, spare_slots=spare))


# Final-launch smem by hand (tpp_params.cuh TileShape::smem_bytes(16)): 1024 bytes of row meta
# (64 rows x (8 + 4 + 4)), 16 Q rows of (D + 8) halves, 2 stages x (K + V) x tokens x (D + 8) halves.
FINAL_SMEM = {(64, 64): 1024 + 16 * 72 * 2 + 2 * 2 * 64 * 72 * 2,      # 40,192
              (64, 32): 1024 + 16 * 72 * 2 + 2 * 2 * 32 * 72 * 2,      # 21,760
              (128, 64): 1024 + 16 * 136 * 2 + 2 * 2 * 64 * 136 * 2,   # 75,008
              (128, 32): 1024 + 16 * 136 * 2 + 2 * 2 * 32 * 136 * 2}   # 40,192


# Partial-launch smem by hand (TileShape::smem_bytes(64)): 1024 bytes of row meta, 64 Q rows of
# (D + 8) halves, 2 stages x (K + V) x tokens x (D + 8) halves.
PARTIAL_SMEM = {(64, 64): 1024 + 64 * 72 * 2 + 2 * 2 * 64 * 72 * 2,      # 47,104
                (64, 32): 1024 + 64 * 72 * 2 + 2 * 2 * 32 * 72 * 2,      # 28,672
                (128, 64): 1024 + 64 * 136 * 2 + 2 * 2 * 64 * 136 * 2,   # 88,064
                (128, 32): 1024 + 64 * 136 * 2 + 2 * 2 * 32 * 136 * 2}   # 54,016

@pytest.mark.parametrize("at_issue", [False, True])
@pytest.mark.parametrize("launch,case", COMPACT_STAGE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_launch_in_compact_stages(emu, splits, monkeypatch, launch, case, dtype, at_issue):
    # CHUNKATTN_{FINAL,PARTIAL}_STAGE_TOKENS=32: the launch streams its KV in stages of 32 tokens
    # (a <= 16-row CTA: 2 of its 4 warps a stage) inside split bounds laid out in 64-token stages
    # (the final launch's default; the partial launch's an option: 3 CTAs an SM at head 128);
    # =64: the 64-token stage. The same results in the smem worked out by hand, the other launch
    # in its default stage.
    spec, head_size, forced = case
    b = batch(spec, seed=9, num_heads=16, num_kv_heads=4, head_size=head_size, block_size=16,
              dtype=dtype)
    plan = plan_of(b)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    if spec == "wide_long":                       # 64-row chunk CTAs over several 64-token stages
        assert int(plan.node_seq_indptr[1]) == 16 and int(plan.node_block_indptr[1]) * 16 > 2 * 64
    other = "FINAL" if launch == "partial" else "PARTIAL"
    monkeypatch.delenv(f"CHUNKATTN_{other}_STAGE_TOKENS", raising=False)
    for tokens in (32, 64):
        monkeypatch.setenv(f"CHUNKATTN_{launch.upper()}_STAGE_TOKENS", str(tokens))
        assert_matches_reference(b, plan, *run(emu, b, plan, spare_slots=spare, at_issue=at_issue))
        shape = emu.last_launch()
        partial, final = (tokens, 32) if launch == "partial" else (64, tokens)
        assert shape[2] == PARTIAL_SMEM[(head_size, partial)] and shape[3] == FINAL_SMEM[(head_size, final)]
    assert PARTIAL_SMEM[(head_size, 64)] == emu.partial_smem_bytes(head_size)     # the default's


def test_the_64_token_final_stage_merges_slots_in_batches(emu, splits, monkeypatch):
    # The 64-token final stage (CHUNKATTN_FINAL_STAGE_TOKENS=64) with a forced short slot list,
    # as test_a_final_cta_merges_its_slots_in_batches does for the default, compact stage.
    b = batch("deep_tree", seed=6, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
              dtype=torch.bfloat16)
    plan = plan_of(b)
    splits(16, 4)
    monkeypatch.setenv("CHUNKATTN_FINAL_STAGE_TOKENS", "64")
    monkeypatch.setenv("CHUNKATTN_SLOT_LIST_CAP", "3")
    spare = split_spare_slots(plan, b.query.shape[0], 16, 4)
    assert_matches_reference(b, plan, *run(emu, b, plan, spare_slots=spare))


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_kv_addresses_in_32_or_64_bits_read_the_same_tokens(emu, monkeypatch, head_size):
    # load_kv_stage's two address paths (TppParams::kv_offsets_i32, the last launch's 5th
    # number): one int32 offset a token for K and V where their strides are equal and every
    # offset fits (vLLM's flash layout: V right after K in one tensor; or V in a tensor of its
    # own with K's strides, anywhere in memory), 64-bit offsets for each where V's strides differ
    # or CHUNKATTN_KV_OFFSETS_I64=1 asks. Every path gives the reference's results.
    b = batch("system_prompts", seed=4, num_heads=8, num_kv_heads=2, head_size=head_size,
              block_size=16, dtype=torch.bfloat16)
    plan = plan_of(b)
    monkeypatch.delenv("CHUNKATTN_KV_OFFSETS_I64", raising=False)
    assert_matches_reference(b, plan, *run(emu, b, plan))
    assert emu.last_launch()[4] == 1
    for name, vb in value_cache_elsewhere(b).items():
        assert_matches_reference(vb, plan, *run(emu, vb, plan))
        assert emu.last_launch()[4] == (name == "same_strides"), name
    monkeypatch.setenv("CHUNKATTN_KV_OFFSETS_I64", "1")
    assert_matches_reference(b, plan, *run(emu, b, plan))
    assert emu.last_launch()[4] == 0


def test_head_256_has_one_stage_whatever_the_knobs(emu, monkeypatch):
    # Head 256 already stages 32 tokens: the knobs change nothing (2 stages x (K + V) x 32 x 264).
    b = batch("system_prompts", seed=2, num_heads=8, num_kv_heads=2, head_size=256,
              block_size=16, dtype=torch.float16)
    plan = plan_of(b)
    want_final = 1024 + 16 * 264 * 2 + 2 * 2 * 32 * 264 * 2
    want_partial = 1024 + 64 * 264 * 2 + 2 * 2 * 32 * 264 * 2
    for knob in ("64", "32", "0"):
        monkeypatch.setenv("CHUNKATTN_FINAL_STAGE_TOKENS", knob)
        monkeypatch.setenv("CHUNKATTN_PARTIAL_STAGE_TOKENS", knob)
        assert_matches_reference(b, plan, *run(emu, b, plan))
        assert emu.last_launch()[3] == want_final and emu.last_launch()[2] == want_partial
