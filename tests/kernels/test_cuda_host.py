"""The CUDA op's work decomposition (csrc/cuda/tpp_host.h, make_tpp_work): the C++ code itself,
called through the SIMT emulation's library (chunkattn_simt.tpp_work), no GPU. KV splits always
fit the workspace, follow the overrides, stay off short work, and size the partial launch to the
device's waves. Whether the kernel computes the right result under every decomposition is
tests/kernels/test_cuda_simt_emulation.py's job (the kernel's own source, against the reference)."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from vllm_chunkattn.bench.kernel_trees import PAPER, single_prefix, tree_block_table
from vllm_chunkattn.plan import build_plan
from vllm_chunkattn.bench.cuda_work import chunk_ctas_with_rows, tpp_work

H100 = 132 * 2          # resident partial-kernel CTAs of an H100 at head 128 (2 per SM)
MAX_ROWS, SEQ_HEADS = 64, 16


def work(emu, *, num_seqs, num_heads, num_kv_heads, block_size=16, num_nodes=0, num_partials=0,
         node_blocks=0, table_width=1, slots=None, resident=H100) -> dict:
    slots = max(num_partials, 1) if slots is None else slots
    return tpp_work(emu, num_seqs, num_heads, num_kv_heads, block_size, num_nodes, num_partials,
                    node_blocks, table_width, slots, resident)


def wave_fill(ctas: int, resident: int) -> float:
    return ctas / (math.ceil(ctas / resident) * resident)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8, 16, 48, 64, 80, 128])
def test_tiles_cover_the_group(emu, group):
    w = work(emu, num_seqs=5, num_heads=2 * group, num_kv_heads=2, num_nodes=3, num_partials=10)
    assert w["chunk_heads"] * w["chunk_seqs"] <= MAX_ROWS and w["chunk_seqs"] >= 1
    assert w["chunk_heads"] * w["chunk_head_tiles"] >= group > w["chunk_heads"] * (w["chunk_head_tiles"] - 1)
    assert w["seq_heads"] <= SEQ_HEADS
    assert w["seq_heads"] * w["seq_head_tiles"] >= group > w["seq_heads"] * (w["seq_head_tiles"] - 1)
    # Window CTA slots: every node's first window, plus one per chunk_seqs partial positions.
    assert w["num_windows"] == 3 + math.ceil(10 / w["chunk_seqs"])


def test_splits_always_fit_the_workspace(emu):
    rng = random.Random(0)
    for _ in range(2000):
        num_kv_heads = rng.choice([1, 2, 8, 32])
        num_seqs = rng.randint(1, 300)
        num_nodes = rng.randint(0, 40)
        num_partials = 0 if num_nodes == 0 else rng.randint(num_nodes, num_nodes + 4 * num_seqs)
        slots = max(num_partials, 1) + rng.choice([0, 1, 7, num_seqs, 5 * num_partials + 8 * num_seqs])
        w = work(emu, num_seqs=num_seqs, num_heads=num_kv_heads * rng.choice([1, 4, 8]),
                 num_kv_heads=num_kv_heads, block_size=rng.choice([16, 64]), num_nodes=num_nodes,
                 num_partials=num_partials, node_blocks=num_nodes * rng.randint(1, 300),
                 table_width=rng.randint(1, 600), slots=slots, resident=rng.choice([1, 264, 396, 5000]))
        cs, ss = w["chunk_splits"], w["seq_splits"]
        assert 1 <= cs <= 16 and 1 <= ss <= 16
        assert cs * num_partials + num_seqs * (ss - 1) <= slots, (w, num_partials, num_seqs, slots)


def test_a_workspace_without_spare_rows_means_no_split(emu):
    # Long nodes and tails that would split, on a small GPU; exactly num_partials rows.
    w = work(emu, num_seqs=4, num_heads=8, num_kv_heads=8, num_nodes=2, num_partials=6,
             node_blocks=512, table_width=512, slots=6)
    assert (w["chunk_splits"], w["seq_splits"]) == (1, 1)


def test_overrides_are_taken_where_they_fit(emu, splits):
    big = dict(num_seqs=4, num_heads=8, num_kv_heads=8, num_nodes=2, num_partials=6,
               node_blocks=512, table_width=512)
    splits(3, 4)
    w = work(emu, **big, slots=3 * 6 + 4 * 3)
    assert (w["chunk_splits"], w["seq_splits"]) == (3, 4)
    w = work(emu, **big, slots=3 * 6 + 4 * 3 - 1)      # one row short: the tails give way first
    assert (w["chunk_splits"], w["seq_splits"]) == (3, 3)


def test_short_work_is_not_split(emu):
    # Nodes of < 512 tokens on average and tails bounded by < 1024 tokens stay whole, however
    # empty the GPU would be.
    w = work(emu, num_seqs=2, num_heads=8, num_kv_heads=8, num_nodes=1, num_partials=2,
             node_blocks=31, table_width=63, slots=10_000)
    assert (w["chunk_splits"], w["seq_splits"]) == (1, 1)


def test_a_launch_of_a_wave_already_is_not_split(emu):
    # 128 rows x 8 kv heads = 1024 tail CTAs, ~4 waves of an H100: no tail split.
    w = work(emu, num_seqs=128, num_heads=32, num_kv_heads=8, num_nodes=0, table_width=512,
             slots=10_000)
    assert w["seq_splits"] == 1
    # 32 rows x 8 = 256 CTAs is 0.97 of a wave: no split either (a second launch of the same
    # 256 CTAs would only add the merge).
    w = work(emu, num_seqs=32, num_heads=32, num_kv_heads=8, num_nodes=0, table_width=512,
             slots=10_000)
    assert w["seq_splits"] == 1
    # 4 rows: 32 CTAs leave 7/8 of the GPU idle; split the tails.
    w = work(emu, num_seqs=4, num_heads=32, num_kv_heads=8, num_nodes=0, table_width=512,
             slots=10_000)
    assert w["seq_splits"] > 1 and wave_fill(32 * w["seq_splits"], H100) >= 0.8


@pytest.mark.parametrize("resident", [H100, 132 * 3, 108 * 2])
def test_the_paper_anchor_fills_its_waves(emu, resident):
    # ChunkAttention's Table 3 point n_p = n_s = 4096 (the roofline goal's point): one node of
    # 4096 tokens under 32 rows, 32/32 heads, so 32 chunk CTAs a split. Splitting it into
    # ceil(264 / 32) = 9 (resident CTAs over CTAs a split) would launch 288 CTAs on an H100:
    # 1.09 waves, the last 24 CTAs alone on the GPU for about a wave's time. The choice must
    # stay within one wave here and fill it to >= 80 %.
    point = single_prefix("paper", "anchor", PAPER, rows=32, shared=4096, private=1)
    table, lens = tree_block_table(point, point.blocks_needed() + 1, torch.Generator().manual_seed(0))
    plan = build_plan(table, lens, PAPER.block_size)
    w = work(emu, num_seqs=32, num_heads=32, num_kv_heads=32, block_size=PAPER.block_size,
             num_nodes=plan.num_nodes, num_partials=plan.num_partials,
             node_blocks=plan.node_block_ids.numel(), table_width=table.shape[1],
             slots=plan.num_partials * 5 + 8 * 32, resident=resident)
    per_split = chunk_ctas_with_rows(plan, w["chunk_seqs"], w["chunk_head_tiles"], 32)
    assert per_split == 32
    ctas = w["chunk_splits"] * per_split + 32 * 32 * (w["seq_splits"] - 1)
    assert ctas <= resident and wave_fill(ctas, resident) >= 0.8, (w, ctas)


def test_the_launch_table_covers_the_gpu_grid(emu, capsys, monkeypatch):
    # benchmarks/gpu/launch_waves.py: one row per point of bench kernel's GPU grid, and the
    # paper anchor's partial launch within one wave (the property above, end to end).
    import runpy
    import sys

    from vllm_chunkattn.bench.kernel_trees import grid_points
    from conftest import SIMT_CSRC            # the library emu loaded: a second one would abort
    monkeypatch.setattr(sys, "argv", ["launch_waves.py", "--csrc", str(SIMT_CSRC)])
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/gpu/launch_waves.py"),
                   run_name="__main__")
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith(("| grid", "|---"))]
    assert [r[1] for r in rows] == [p.label for p in grid_points("gpu")]
    anchor = next(r for r in rows if r[1] == "n_p=4096 n_s=4096")
    assert 0.8 <= float(anchor[5]) <= 1.0


@pytest.mark.parametrize("rows,looped", [(32, False), (128, False), (256, True), (512, True)])
def test_a_padded_plans_grid_loops_only_for_large_capacities(emu, rows, looped):
    # A plan padded to a CUDA graph's capacities (rows - 1 nodes): a CTA per (window, split)
    # slot of its capacities (16 splits of one node's windows, or every window at one split),
    # unless that grid is over 6 waves of resident CTAs; then one wave of CTAs that loop over
    # the real items. On an H200 the b = 256 grid (2552 CTAs at 32/8 heads) took up to 1.39x the
    # eager time, the loop up to 1.12x; at b <= 128 the grid 1.21x, the loop up to 1.77x.
    cap_partials = 4 * rows
    w = work(emu, num_seqs=rows, num_heads=32, num_kv_heads=8, num_nodes=rows - 1,
             num_partials=cap_partials, node_blocks=rows // 2 * 300, table_width=300,
             slots=cap_partials)
    windows = max(rows - 1 + math.ceil(cap_partials / 16), 16 * (1 + math.ceil(rows / 16)))
    assert w["device_splits"] == 1 and w["chunk_seqs"] == 16
    assert (windows * 8 > 6 * H100) == looped
    assert w["chunk_ctas"] == (math.ceil(H100 / 8) if looped else windows)
