"""The GPU kernel grid's parts that need no GPU: the tree generators (sharing exactly as
specified), the conversion to FlashInfer cascade levels (consistent arrays, exact by a pure-torch
emulation of what a cascade computes), the roofline arithmetic, the goal checks and the runner on
the CPU smoke grid. The one GPU test runs the smoke grid on CUDA without FlashInfer: graph replay
and the chunk-first profile."""
from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest
import torch

from vllm_chunkattn.bench import kernel_gpu
from vllm_chunkattn.bench.cascade_levels import cascade_levels, emulate_cascade
from vllm_chunkattn.bench.kernel import main as kernel_main
from vllm_chunkattn.bench.kernel_gpu_report import goal_lines, overlap_lines, split_sweep_lines
from vllm_chunkattn.bench.kernel_trees import (GRIDS, LLAMA3_8B, PAPER, SMOKE, AttnShape, TreePoint,
                                               few_shot, paper_grid, rollouts, single_prefix,
                                               smoke_grid, tree_block_table)
from vllm_chunkattn.bench.roofline import (chunk_first_flops, chunk_first_rows,
                                           kv_bytes_per_token, roofline_us, unique_kv_tokens)
from vllm_chunkattn.ops import dense_decode_oracle
from vllm_chunkattn.ops.reference import tpp_decode_reference
from vllm_chunkattn.plan import build_plan, empty_plan
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch


def table_of(point, pool_blocks=None, seed=0):
    return tree_block_table(point, pool_blocks or point.blocks_needed() + 1,
                            torch.Generator().manual_seed(seed))


def node_sets(plan):
    """{frozenset of sharer rows: number of blocks} of a plan."""
    nb, ns = plan.node_block_indptr.tolist(), plan.node_seq_indptr.tolist()
    ids = plan.node_seq_ids.tolist()
    return {frozenset(ids[ns[n]:ns[n + 1]]): nb[n + 1] - nb[n] for n in range(plan.num_nodes)}


# ---- tree generators

@pytest.mark.parametrize("groups,samples", [(4, 8), (16, 16), (3, 2)])
def test_rollouts_share_each_prompt_among_its_samples_only(groups, samples):
    point = rollouts("t", "t", LLAMA3_8B, groups, samples, (1000, 4096), (0, 2048), seed=5)
    table, lens = table_of(point, pool_blocks=point.blocks_needed() + 50)
    bs = LLAMA3_8B.block_size
    plan = build_plan(table, lens, bs)
    assert plan.num_nodes == groups
    prompts = [point.node_tokens[f"p{g}"] for g in range(groups)]
    assert all(1000 // bs * bs <= p <= 4096 and p % bs == 0 for p in prompts)
    expected = {frozenset(range(g * samples, (g + 1) * samples)): prompts[g] // bs
                for g in range(groups)}
    assert node_sets(plan) == expected
    for g in range(groups):
        rows = table[g * samples:(g + 1) * samples, :prompts[g] // bs]
        assert (rows == rows[0]).all()                     # the same physical blocks
    private = lens - torch.tensor([prompts[i // samples] for i in range(groups * samples)])
    assert private.min() >= 1 and private.max() <= 2049


def test_blocks_are_distinct_except_where_the_tree_shares_them():
    point = few_shot("t", "t", SMOKE, system=32, shots=2, shot_tokens=48, questions=3,
                     question_tokens=16, samples=2, generated=(0, 40), zero_shot_questions=2,
                     seed=1)
    table, lens = table_of(point, pool_blocks=200)
    bs = SMOKE.block_size
    owner = {}                                   # block id -> the node (or row tail) holding it
    for r, (path, n) in enumerate(zip(point.paths, lens.tolist())):
        col = 0
        for node in path:
            for _ in range(point.node_tokens[node] // bs):
                assert owner.setdefault(int(table[r, col]), node) == node
                col += 1
        for c in range(col, -(-n // bs)):
            assert owner.setdefault(int(table[r, c]), ("row", r)) == ("row", r)
    assert 0 not in owner
    assert len(owner) == point.blocks_needed()


def test_paper_grid_is_table_3():
    points = paper_grid()
    assert [(p.label) for p in points][:4] == ["n_p=1024 n_s=0", "n_p=1024 n_s=512",
                                               "n_p=1024 n_s=768", "n_p=1024 n_s=1024"]
    assert len(points) == 12
    for p in points:
        assert p.shape == AttnShape(32, 32, 128, 64, "float16") and p.num_rows == 32
        n_p, n_s = (int(x.split("=")[1]) for x in p.label.split())
        table, lens = table_of(p)
        assert lens.tolist() == [n_p + 1] * 32
        plan = build_plan(table, lens, PAPER.block_size)
        assert node_sets(plan) == ({frozenset(range(32)): n_s // 64} if n_s else {})


def test_few_shot_is_three_levels_deep_with_the_specified_sharers():
    point = few_shot("t", "t", SMOKE, system=64, shots=3, shot_tokens=32, questions=2,
                     question_tokens=16, samples=4, generated=(0, 30), seed=2)
    table, lens = table_of(point)
    plan = build_plan(table, lens, SMOKE.block_size)
    sets = node_sets(plan)
    rows = point.num_rows
    assert rows == 3 * 2 * 4
    expected = {frozenset(range(rows)): 4}                              # system: 64 tokens
    for j in range(3):
        expected[frozenset(range(j * 8, (j + 1) * 8))] = 2               # few-shot block
        for k in range(2):
            expected[frozenset(range(j * 8 + k * 4, j * 8 + k * 4 + 4))] = 1   # question
    assert sets == expected
    assert cascade_levels(plan, table, lens, SMOKE.block_size).num_levels == 4
    assert (lens.numpy() - (64 + 32 + 16)).min() >= 1


def test_tree_point_refuses_what_is_not_a_tree_of_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks"):
        TreePoint("t", "t", SMOKE, {"a": 20}, [("a",)], [1])
    with pytest.raises(ValueError, match="two different parents"):
        TreePoint("t", "t", SMOKE, {"a": 16, "b": 16, "c": 16}, [("a", "c"), ("b", "c")], [1, 1])
    with pytest.raises(ValueError, match="new token"):
        TreePoint("t", "t", SMOKE, {}, [()], [0])
    with pytest.raises(ValueError, match="pool has"):
        table_of(single_prefix("t", "t", SMOKE, 2, 32, 5), pool_blocks=4)


# ---- cascade levels

def test_levels_of_a_hand_made_batch():
    # rows 0 and 2 share blocks [7, 8]; row 1 shares nothing; row 0 and 2 differ after that.
    table = torch.tensor([[7, 8, 3, 0], [5, 6, 9, 0], [7, 8, 4, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 33, 50], dtype=torch.int32)          # block 16
    levels = cascade_levels(build_plan(table, lens, 16), table, lens, 16)
    assert levels.row_order.tolist() == [1, 0, 2]                 # no path first, then the node
    assert levels.num_levels == 2 and levels.num_empty_groups == 1
    assert levels.qo_indptr[0].tolist() == [0, 1, 3]               # row 1 alone (empty), rows 0,2
    assert levels.kv_indptr[0].tolist() == [0, 0, 2]
    assert levels.kv_indices[0].tolist() == [7, 8]
    assert levels.last_page_len[0].tolist() == [0, 16]
    assert levels.qo_indptr[1].tolist() == [0, 1, 2, 3]
    assert levels.kv_indices[1].tolist() == [5, 6, 9, 3, 4, 2]     # rows 1, 0, 2: private pages
    assert levels.kv_indptr[1].tolist() == [0, 3, 4, 6]
    assert levels.last_page_len[1].tolist() == [1, 8, 2]           # 33 = 2*16+1, 40-32, 50-48


def check_level_arrays(levels, table, lens, block_size):
    rows = table.shape[0]
    covered = np.zeros(rows, dtype=np.int64)       # tokens each row is given over all levels
    pages_of_row = [[] for _ in range(rows)]
    for level in range(levels.num_levels):
        qo, kv = levels.qo_indptr[level], levels.kv_indptr[level]
        last, idx = levels.last_page_len[level], levels.kv_indices[level]
        assert qo[0] == 0 and qo[-1] == rows and (np.diff(qo) > 0).all()   # a partition
        assert len(kv) == len(qo) and kv[0] == 0 and kv[-1] == len(idx) and (np.diff(kv) >= 0).all()
        for g in range(len(qo) - 1):
            n_pages = kv[g + 1] - kv[g]
            assert (last[g] == 0) == (n_pages == 0) and 0 <= last[g] <= block_size
            tokens = (n_pages - 1) * block_size + last[g] if n_pages else 0
            for r in levels.row_order[qo[g]:qo[g + 1]]:
                covered[r] += tokens
                pages_of_row[r] += idx[kv[g]:kv[g + 1]].tolist()
    assert covered.tolist() == lens.tolist()
    for r in range(rows):                           # exactly the row's own blocks, in order
        assert pages_of_row[r] == table[r, :-(-int(lens[r]) // block_size)].tolist()


@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
def test_level_arrays_partition_rows_and_pages(spec):
    b = random_tree_batch(3, **TREE_SPECS[spec])
    levels = cascade_levels(build_plan(b.block_table, b.seq_lens, b.block_size), b.block_table,
                            b.seq_lens, b.block_size)
    check_level_arrays(levels, b.block_table, b.seq_lens, b.block_size)


def test_rollout_levels_are_one_group_per_prompt():
    point = rollouts("t", "t", SMOKE, 3, 4, (32, 64), (0, 40), seed=4)
    table, lens = table_of(point)
    levels = cascade_levels(build_plan(table, lens, 16), table, lens, 16)
    assert levels.is_identity_order() and levels.num_levels == 2
    assert levels.qo_indptr[0].tolist() == [0, 4, 8, 12]
    for g in range(3):
        pages = levels.kv_indices[0][levels.kv_indptr[0][g]:levels.kv_indptr[0][g + 1]]
        assert pages.tolist() == table[4 * g, :point.node_tokens[f"p{g}"] // 16].tolist()
    assert (levels.last_page_len[0] == 16).all()
    check_level_arrays(levels, table, lens, 16)


def emulation_error(levels, b, block_size):
    out, lse = emulate_cascade(levels, b.query, b.key_cache, b.value_cache, block_size, b.scale)
    ref_out, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                           b.seq_lens, b.scale)
    return (max((out.double() - ref_out).abs().max().item(),
                (lse.double() - ref_lse).abs().max().item()))


@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
def test_cascade_of_the_levels_is_exact(spec):
    # Shuffled rows: the levels reorder them; node_ends_at_last_token: empty private groups.
    b = random_tree_batch(11, num_heads=8, num_kv_heads=2, **TREE_SPECS[spec])
    levels = cascade_levels(build_plan(b.block_table, b.seq_lens, b.block_size), b.block_table,
                            b.seq_lens, b.block_size)
    assert emulation_error(levels, b, b.block_size) < 1e-4


@pytest.mark.parametrize("point", smoke_grid(), ids=lambda p: p.label)
def test_cascade_of_the_smoke_trees_is_exact(point):
    from vllm_chunkattn.bench.kv_pool import KvPool
    pool = KvPool(point.blocks_needed() + 3, 16, SMOKE.num_kv_heads, SMOKE.head_size,
                  torch.float32, "cpu", "paged_nhd")
    gen = torch.Generator().manual_seed(0)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    bt = pool.from_table(table, lens, SMOKE.num_heads, gen)
    levels = cascade_levels(build_plan(table, lens, 16), table, lens, 16)
    assert emulation_error(levels, bt, 16) < 1e-4


def test_a_level_missing_a_page_is_caught():
    b = random_tree_batch(2, num_heads=8, num_kv_heads=2, **TREE_SPECS["system_prompts"])
    levels = cascade_levels(build_plan(b.block_table, b.seq_lens, b.block_size), b.block_table,
                            b.seq_lens, b.block_size)
    levels.kv_indices[0] = levels.kv_indices[0][1:]          # the first group loses a page
    levels.kv_indptr[0] = np.maximum(levels.kv_indptr[0] - 1, 0)
    assert emulation_error(levels, b, b.block_size) > 1e-2


# ---- roofline arithmetic

def test_unique_bytes_and_chunk_first_work_by_hand():
    table = torch.tensor([[1, 2, 3], [1, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([40, 35], dtype=torch.int32)
    assert unique_kv_tokens(table, lens, 16) == 16 + 16 + 8 + 3
    assert kv_bytes_per_token(8, 128, torch.bfloat16) == 2 * 8 * 128 * 2
    assert roofline_us(4096 * 43, 1000.0) == pytest.approx(0.176128)
    plan = build_plan(table, lens, 16)
    # one node: 2 blocks (32 tokens), 2 sharers; QK^T + PV = 4 FLOPs per (row, token, head, dim)
    assert chunk_first_flops(plan, 32, 128, 16) == 4 * 2 * 32 * 32 * 128
    assert chunk_first_rows(plan, 32, 8) == 2 * 4


def test_unique_tokens_of_one_prefix_is_p_plus_b_s():
    point = single_prefix("t", "t", LLAMA3_8B, 128, 4096, 128)
    table, lens = table_of(point)
    assert unique_kv_tokens(table, lens, 16) == 4096 + 128 * 128


def test_goal_lines_judge_the_worst_point():
    base = dict(nodes=1, cf_rows=0, pct_roofline=math.nan, x_empty_plan=math.nan,
                x_fi_cascade=math.nan, x_fi_decode=math.nan, cf_pct_peak=math.nan)
    rows = [dict(base, grid="paper", point="n_p=4096 n_s=4096", pct_roofline=71.0,
                 x_empty_plan=19.5),
            dict(base, grid="rl", point="a", x_fi_cascade=1.4),
            dict(base, grid="rl", point="b", x_fi_cascade=1.2)]
    lines = goal_lines(rows)
    assert "met, worst 71" in lines[0] and "NOT met, worst 19.5" in lines[1]
    assert "NOT met, worst 1.2 over 2" in lines[2]
    assert "not measured" in lines[4] and "not measured" in lines[5]


def test_overlap_lines_set_the_serial_final_launch_beside_the_overlapped_one():
    rows = [dict(grid="llama8b", point="a", ours_us=100.0, ours_serial_us=130.0),
            dict(grid="llama8b", point="b", ours_us=100.0, ours_serial_us=95.0),
            dict(grid="rl", point="c", ours_us=50.0, ours_serial_us=60.0),
            dict(grid="rl", point="d", ours_us=50.0, ours_serial_us=math.nan)]
    text = " ".join(overlap_lines(rows))
    assert "over 3 points: median 1.20, lowest 0.95 (llama8b b), highest 1.30 (llama8b a)" in text
    assert overlap_lines([dict(grid="smoke", point="x", ours_us=9.0, ours_serial_us=math.nan)]) == []
    assert "measure nothing" not in text
    assert "CHUNKATTN_OVERLAP_FINAL=0 in its environment" in " ".join(overlap_lines(rows, "0"))


def test_two_way_sweeps_close_with_the_other_settings_speed_up():
    rows = [dict(grid="llama8b", point="a", ours_us=40.0,
                 partial_sweep_us="64: 40.0; 32: 32.0; chunk-first 64: 20.0; chunk-first 32: 25.0"),
            dict(grid="llama8b", point="b", ours_us=50.0,
                 partial_sweep_us="64: 50.0; 32: 55.0; chunk-first 64: 30.0; chunk-first 32: 24.0"),
            dict(grid="paper", point="c", ours_us=60.0,
                 partial_sweep_us="64: 60.0; 32: 50.0; chunk-first 64: 10.0; chunk-first 32: 10.0"),
            dict(grid="smoke", point="d", ours_us=9.0, final_sweep_us="64: 9.0; 32: 12.0",
                 split_sweep_us="1: 9.0; 2: 8.0")]
    text = "\n".join(split_sweep_lines(rows))
    # the 64-token stage's µs over the 32-token one's: 1.25, 0.909, 1.2
    assert ("- the whole op, µs at 64 / µs at 32: median **1.200x** at 3 points (0.909-1.250x; "
            "above 1: 32 is faster)") in text
    # its chunk-first launch alone: 0.8, 1.25, 1.0
    assert ("- its chunk-first launch alone, µs at chunk-first 64 / µs at chunk-first 32: median "
            "**1.000x** at 3 points (0.800-1.250x") in text
    # the final launch's default is 32: 12 / 9
    assert "- the whole op, µs at 32 / µs at 64: median **1.333x** at 1 points" in text
    assert "- smoke d: the op's choice 9 µs; forced splits: µs 1: 9.0; 2: 8.0" in text
    assert "- smoke d: the op's choice 9 µs; stage tokens: µs 64: 9.0; 32: 12.0" in text
    assert text.count("median **") == 3       # the split sweep has no default to set beside


# ---- the runner

def test_smoke_grid_runs_on_cpu(tmp_path):
    assert kernel_main(["--device", "cpu", "--grid", "smoke", "--reps", "1",
                        "--out", str(tmp_path)]) == 0
    with open(tmp_path / "kernel_cpu_smoke.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["point"] for r in rows] == [p.label for p in smoke_grid()]
    for r in rows:
        assert float(r["ours_us"]) > 0 and float(r["empty_plan_us"]) > 0
        assert math.isnan(float(r["fi_cascade_us"])) and math.isnan(float(r["ours_serial_us"]))
    # The split sweep: ours at each forced chunk-first split count, at its points only.
    swept = {r["point"]: r["split_sweep_us"] for r in rows if r["split_sweep_us"]}
    assert list(swept) == ["b=4 P=64 S=20"]
    timed = dict(part.split(": ") for part in swept["b=4 P=64 S=20"].split("; "))
    assert [int(k) for k in timed] == list(kernel_gpu.SWEEP_SPLITS)
    assert all(float(v) > 0 for v in timed.values())
    # ... and at each forced private-tail split count where nothing is shared
    tails = {r["point"]: r["tail_sweep_us"] for r in rows if r["tail_sweep_us"]}
    assert list(tails) == ["b=4 nothing shared"]
    timed = dict(part.split(": ") for part in tails["b=4 nothing shared"].split("; "))
    assert [int(k) for k in timed] == list(kernel_gpu.TAIL_SPLITS)
    assert all(float(v) > 0 for v in timed.values())
    # ... and at each final-launch stage size
    finals = {r["point"]: r["final_sweep_us"] for r in rows if r["final_sweep_us"]}
    assert list(finals) == ["b=4 P=64 S=20"]
    timed = dict(part.split(": ") for part in finals["b=4 P=64 S=20"].split("; "))
    assert [int(k) for k in timed] == list(kernel_gpu.FINAL_STAGES) == [64, 32]
    # ... and at each partial-launch stage size (the chunk-first launch alone: CUDA only)
    partials = {r["point"]: r["partial_sweep_us"] for r in rows if r["partial_sweep_us"]}
    assert list(partials) == ["b=4 P=64 S=20"]
    timed = dict(part.split(": ") for part in partials["b=4 P=64 S=20"].split("; "))
    assert [int(k) for k in timed] == list(kernel_gpu.PARTIAL_STAGES) == [64, 32]
    # ... and with each KV address path, at the same points
    kv = {r["point"]: r["kv_sweep_us"] for r in rows if r["kv_sweep_us"]}
    assert list(kv) == ["b=4 P=64 S=20"]
    timed = dict(part.split(": ") for part in kv["b=4 P=64 S=20"].split("; "))
    assert list(timed) == ["i64", "i32"] and all(float(v) > 0 for v in timed.values())
    md = (tmp_path / "kernel_cpu_smoke.md").read_text()
    assert md.count("\n| b=4 P=64 S=20 |") == 1 and (tmp_path / "kernel_cpu_smoke.png").exists()
    assert "- smoke b=4 P=64 S=20: the op's choice " in md
    assert "## Private-tail KV splits" in md and "- smoke b=4 nothing shared: the op's choice " in md
    assert "## Final launch's KV stage: 32 tokens (default) against 64" in md
    assert "## Partial launch's KV stage: 64 tokens (default) against 32" in md
    assert "- the whole op, µs at 64 / µs at 32: median " in md
    assert "- its chunk-first launch alone: not timed" in md          # CUDA only
    assert "## KV loads' addresses: one 32-bit offset (default) against 64-bit ones" in md


def test_a_wrong_contender_is_not_timed_and_wrong_ours_fails_the_run(tmp_path, monkeypatch):
    def wrong(make):
        def contender(*a, **kw):
            fn = make(*a, **kw)
            return lambda: fn() + 1.0
        return contender
    monkeypatch.setattr(kernel_gpu, "sdpa_per_sequence", wrong(kernel_gpu.sdpa_per_sequence))
    assert kernel_main(["--device", "cpu", "--grid", "smoke", "--reps", "1"]) == 0
    monkeypatch.setattr(kernel_gpu, "ours", wrong(kernel_gpu.ours))
    args = ["--device", "cpu", "--grid", "smoke", "--reps", "1", "--out", str(tmp_path)]
    assert kernel_main(args) == 1
    with open(tmp_path / "kernel_cpu_smoke.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(math.isnan(float(r["sdpa_us"])) and "sdpa: mismatch" in r["notes"] for r in rows)
    assert all(math.isnan(float(r["ours_us"])) for r in rows)


def test_a_wrong_split_variant_fails_the_run(tmp_path, monkeypatch):
    """The swept variants are our op too: checked against the reference before the rounds."""
    def wrong_at_seven_splits(make):
        def contender(*a, **kw):
            fn = make(*a, **kw)
            return lambda: fn() + float(os.environ.get("CHUNKATTN_CHUNK_SPLITS") == "7")
        return contender
    monkeypatch.delenv("CHUNKATTN_CHUNK_SPLITS", raising=False)
    monkeypatch.setattr(kernel_gpu, "ours", wrong_at_seven_splits(kernel_gpu.ours))
    args = ["--device", "cpu", "--grid", "smoke", "--reps", "1", "--out", str(tmp_path)]
    assert kernel_main(args) == 1
    with open(tmp_path / "kernel_cpu_smoke.csv") as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert "splits_7: mismatch" in rows["b=4 P=64 S=20"]["notes"]
    assert rows["b=4 P=64 S=20"]["ours_ok"] == "False"
    assert all(r["ours_ok"] == "True" for p, r in rows.items() if p != "b=4 P=64 S=20")


def test_every_named_point_is_a_point_of_its_grid():
    """The sweeps and Nsight Compute name points by (grid, label): a label that drifts from the
    grid's would drop a sweep silently, or fail ncu_points.py on the device (StopIteration)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "ncu_points", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "ncu_points.py"))
    ncu_points = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu_points)
    named = (kernel_gpu.SPLIT_SWEEP_POINTS | kernel_gpu.TAIL_SWEEP_POINTS | kernel_gpu.FINAL_SWEEP_POINTS
             | {(grid, label) for grid, label, _ in ncu_points.POINTS.values()})
    labels = {(g, p.label) for g in GRIDS for p in GRIDS[g]()}
    assert named - labels == set()
    # the served shape, in every sweep and under ncu
    served = ("llama8b", "b=256 P=2048 S=128")
    assert all(served in s for s in (kernel_gpu.SPLIT_SWEEP_POINTS, kernel_gpu.TAIL_SWEEP_POINTS,
                                     kernel_gpu.FINAL_SWEEP_POINTS))
    assert ncu_points.POINTS["llama_serve"] == (*served, False)


def test_gpu_grids_refuse_the_cpu():
    with pytest.raises(SystemExit):
        kernel_main(["--device", "cpu", "--grid", "paper"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_smoke_grid_on_cuda_graph_and_chunk_first_profile(tmp_path, monkeypatch):
    # FlashInfer left out: its JIT build takes minutes on a fresh device (the bench stage does it).
    monkeypatch.setattr(kernel_gpu, "flashinfer_version", lambda: (None, "left out in this test"))
    assert kernel_main(["--device", "cuda", "--grid", "smoke", "--reps", "3",
                        "--out", str(tmp_path)]) == 0
    with open(tmp_path / "kernel_cuda_smoke.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:      # every contender matched the fp32 reference before it was timed
        assert float(r["ours_graph_us"]) > 0 and float(r["sdpa_us"]) > 0
        assert float(r["ours_vllm_graph_us"]) > 0           # the capacity-padded plan, replayed
        if int(r["nodes"]):
            assert float(r["cf_us"]) > 0, r["notes"]          # the profiler found the launch
        assert float(r["ours_serial_us"]) > 0                 # the final launch not overlapped


# ---- the FlashInfer glue, against a stand-in that computes what FlashInfer's wrappers compute

class _FakeWrapper:
    """FlashInfer 0.6's plan/run call shapes (positional order as in flashinfer/cascade.py and
    decode.py); run computes the levels with emulate_cascade, cache unbound as FlashInfer does."""

    def __init__(self, *args, **kw):
        self.levels = None

    def _plan(self, qo, kv, idx, last, page_size, kw):
        from vllm_chunkattn.bench.cascade_levels import CascadeLevels
        assert kw.get("causal", False) is False          # one query per row: no mask
        arrays = [[t.cpu().numpy() for t in a] for a in (qo, kv, idx, last)]
        for a in arrays:
            assert all(x.dtype == np.int32 for x in a)
        self.levels = CascadeLevels(np.arange(int(arrays[0][0][-1])), *arrays, 0)
        self.page_size, self.scale = page_size, kw["sm_scale"]

    def run(self, q, paged_kv_cache, out=None, return_lse=False):
        key, value = paged_kv_cache.unbind(dim=1)          # [pages, 2, page, kv heads, head]
        result, lse = emulate_cascade(self.levels, q, key, value, self.page_size, self.scale)
        result = result.to(q.dtype) if out is None else out.copy_(result)
        return (result, lse * math.log2(math.e)) if return_lse else result   # FlashInfer: log2


def _fake_merge_state(v_a, s_a, v_b, s_b):
    """flashinfer.merge_state: two (output, base-2 LSE) states of one row and head merged."""
    s = torch.logaddexp2(s_a, s_b)
    w_a, w_b = torch.exp2(s_a - s).nan_to_num(0.0), torch.exp2(s_b - s).nan_to_num(0.0)
    return (v_a * w_a[..., None] + v_b * w_b[..., None]).to(v_a.dtype), s


class _FakeCascade(_FakeWrapper):
    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
             paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        self._plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                   paged_kv_last_page_len, page_size, kw)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kw):
        rows = torch.arange(len(indptr), dtype=torch.int32)
        self._plan([rows], [indptr], [indices], [last_page_len], page_size, kw)


def test_flashinfer_glue_reorders_rows_and_passes_the_levels(monkeypatch):
    import sys
    import types

    from vllm_chunkattn.bench import flashinfer_baselines as fib
    from vllm_chunkattn.bench.kv_pool import KvPool
    fake = types.SimpleNamespace(MultiLevelCascadeAttentionWrapper=_FakeCascade,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
                                 merge_state=_fake_merge_state)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    point = smoke_grid()[-1]                                  # uneven: empty groups too
    pool = KvPool(point.blocks_needed() + 1, 16, SMOKE.num_kv_heads, SMOKE.head_size,
                  torch.float32, "cpu", "paged_nhd")
    gen = torch.Generator().manual_seed(0)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    perm = torch.randperm(point.num_rows, generator=gen)     # rows out of DFS order
    bt = pool.from_table(table[perm], lens[perm], SMOKE.num_heads, gen)
    levels = cascade_levels(build_plan(bt.block_table, bt.seq_lens, 16), bt.block_table,
                            bt.seq_lens, 16)
    assert not levels.is_identity_order()
    ref, _ = dense_decode_oracle(bt.query, bt.key_cache, bt.value_cache, bt.block_table,
                                 bt.seq_lens, bt.scale)
    plan = build_plan(bt.block_table, bt.seq_lens, 16)
    for fn in (fib.multi_level_cascade(bt, levels, 16), fib.batch_decode(bt, 16),
               fib.ours_with_fi_tails(bt, plan, 16)):
        torch.testing.assert_close(fn().double(), ref, atol=1e-4, rtol=1e-4)
    fib.warm(torch.float32, torch.device("cpu"))          # the JIT warm-up's calls, end to end


@pytest.mark.parametrize("spec", ["system_prompts", "deep_tree", "no_sharing"])
def test_tails_split_at_the_plans_shared_blocks(spec):
    # ours_with_fi_tails' two halves: our op with every row cut to its shared nodes (the CPU op,
    # LSE natural), the reference over page_lists' private tails; merged they are the decode.
    from vllm_chunkattn.bench.flashinfer_baselines import page_lists
    from vllm_chunkattn.decode import tpp_decode
    b = random_tree_batch(3, **TREE_SPECS[spec])
    bs, n = b.block_size, b.query.shape[0]
    plan = build_plan(b.block_table, b.seq_lens, bs)
    shared = plan.seq_num_shared_blocks.long()
    out_s, lse_s = torch.empty_like(b.query), torch.empty(n, b.query.shape[1])
    tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table,
               (shared * bs).to(torch.int32), plan, b.scale, out_s, lse_s)
    indptr, indices, last = page_lists(b.block_table, b.seq_lens, bs, first_blocks=shared)
    assert indptr[-1] == len(indices)
    tails = torch.zeros_like(b.block_table)
    tail_lens = torch.zeros(n, dtype=torch.int32)
    for i in range(n):
        pages = indices[indptr[i]:indptr[i + 1]]
        tails[i, :len(pages)] = pages
        tail_lens[i] = (len(pages) - 1) * bs + int(last[i])
        assert int(tail_lens[i]) == int(b.seq_lens[i]) - int(shared[i]) * bs
    out_t, lse_t = tpp_decode_reference(b.query, b.key_cache, b.value_cache, tails, tail_lens,
                                        empty_plan(n), b.scale, return_lse=True)
    log2e = math.log2(math.e)
    merged, _ = _fake_merge_state(out_s.float(), lse_s * log2e, out_t.float(), lse_t * log2e)
    ref, _ = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                                 b.scale)
    torch.testing.assert_close(merged.double(), ref, atol=1e-4, rtol=1e-4)
    if spec != "no_sharing":
        assert (shared > 0).any() and (lse_s == float("-inf")).sum() < lse_s.numel()
    with pytest.raises(ValueError, match="without a token past"):
        page_lists(b.block_table, b.seq_lens, bs, first_blocks=-(-b.seq_lens.long() // bs))


def test_flashinfer_graph_contenders_and_a_capture_that_fails(monkeypatch):
    """On CUDA the FlashInfer contenders are also replayed from a graph; a capture that fails is
    reported, and not retried on later points (fi_broken). The capture is stood in for here."""
    import sys
    import types

    from vllm_chunkattn.bench.kv_pool import KvPool
    fake = types.SimpleNamespace(MultiLevelCascadeAttentionWrapper=_FakeCascade,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeDecode)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    point = smoke_grid()[-1]
    pool = KvPool(point.blocks_needed() + 1, 16, SMOKE.num_kv_heads, SMOKE.head_size,
                  torch.float32, "cpu", "paged_nhd")
    gen = torch.Generator().manual_seed(0)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    bt = pool.from_table(table, lens, SMOKE.num_heads, gen)
    plan = build_plan(table, lens, 16)
    levels = cascade_levels(plan, table, lens, 16)
    captures = []

    def capture(fn):
        captures.append(fn)
        if fail and len(captures) > 2:                     # ours captures; FlashInfer does not
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return fn
    monkeypatch.setattr(kernel_gpu, "cuda_graph", capture)
    cuda = torch.device("cuda")
    fail, broken = False, {}
    fns, missing = kernel_gpu.make_contenders(bt, plan, levels, 16, cuda, "", broken)
    assert {"ours_graph", "ours_vllm_graph", "fi_decode_graph", "fi_tails_graph",
            "fi_cascade_graph"} <= set(fns)
    assert fns["fi_decode_graph"] is fns["fi_decode"] and len(captures) == 5 and not broken
    ref, _ = dense_decode_oracle(bt.query, bt.key_cache, bt.value_cache, bt.block_table,
                                 bt.seq_lens, bt.scale)
    torch.testing.assert_close(fns["fi_cascade_graph"]().double(), ref, atol=1e-4, rtol=1e-4)

    fail, captures[:] = True, []
    fns, missing = kernel_gpu.make_contenders(bt, plan, levels, 16, cuda, "", broken)
    assert not {"fi_decode_graph", "fi_tails_graph", "fi_cascade_graph"} & set(fns)
    assert missing["fi_decode_graph"] == ("RuntimeError: operation not permitted when stream is "
                                          "capturing")
    assert set(broken) == {("fi_decode_graph", torch.float32), ("fi_tails_graph", torch.float32),
                           ("fi_cascade_graph", torch.float32)}
    captures[:] = []
    fns, missing = kernel_gpu.make_contenders(bt, plan, levels, 16, cuda, "", broken)
    assert len(captures) == 2                              # only ours: no retry of FlashInfer's
    assert missing["fi_cascade_graph"].startswith("capture failed on an earlier point")
    assert {"fi_decode", "fi_tails", "fi_cascade"} <= set(fns)   # the eager calls still run


def test_a_captured_graph_keeps_what_its_replays_read(monkeypatch):
    """A CUDA graph reads its inputs by address at every replay: cuda_graph's replay must hold
    the captured callable (its TppLaunch's plan and workspace), or those blocks go to later
    tensors (freed plans replayed: wrong outputs, then an illegal address).
    torch.cuda's graph API is stood in for, so this runs without a GPU."""
    import contextlib
    import gc
    import types
    import weakref

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass
    fake = types.SimpleNamespace(Stream=Stream, current_stream=Stream, CUDAGraph=Graph,
                                 stream=lambda s: contextlib.nullcontext(),
                                 graph=lambda g: contextlib.nullcontext())
    monkeypatch.setattr(kernel_gpu.torch, "cuda", fake)

    class Launch:                      # what ours() closes over: plan and workspace tensors
        def __call__(self):
            return "out"
    launch = Launch()
    alive = weakref.ref(launch)
    replay = kernel_gpu.cuda_graph(launch)
    del launch
    gc.collect()
    assert alive() is not None and replay() == "out"
    del replay
    gc.collect()
    assert alive() is None             # held by the replay, not leaked
