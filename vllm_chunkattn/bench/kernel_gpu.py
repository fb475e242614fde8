"""python -m vllm_chunkattn.bench kernel --device cuda --grid {gpu,paper,llama8b,rl,fewshot}: our
TPP op on tree-shaped decode batches (kernel_trees.py) against, in the same run and on the same
KV bytes:
  empty_plan   our op with no plan: paged decode without prefix awareness;
  fi_decode    FlashInfer BatchDecodeWithPagedKVCacheWrapper (no sharing);
  fi_tails     ours over the shared nodes only, FlashInfer batch decode over the private tails,
               FlashInfer's merge_state: whether the tails are better left to the engine's
               decode kernel (flashinfer_baselines.ours_with_fi_tails);
  fi_cascade   FlashInfer MultiLevelCascadeAttentionWrapper, levels from the tree
               (cascade_levels.py);
  sdpa         torch SDPA per sequence (gather, one call per row), for up to SDPA_MAX_ROWS rows.
Ours and the FlashInfer contenders are timed twice: as called, and as a CUDA-graph replay of the
same call after its plan ("_graph"), which is how vLLM runs a decode step. "ours_vllm_graph"
is ours as vLLM's FULL decode graphs replay it: the plan padded to the batch size's capacity
(plan/capacity.py, pruned where the tree exceeds it) in buffers that never move, and a workspace
with no split spares (the builder's graph mode). Eager timings carry
each launch's host work (the cascade: a launch and an output allocation per level, plus a
merge), which the graph replay leaves out; graph against graph compares the GPU work alone. Our
graph is captured with the plan in static device buffers, as
tests/kernels/test_ops_cuda.py::test_cuda_graph_replay does.

Every output is checked against the fp32 per-sequence reference (tpp_decode_reference with the
empty plan: it knows nothing of the tree) before anything is timed. A contender that disagrees is
reported as a mismatch and not timed. If ours disagrees, the run exits 1.
Timing: timing.Timer.side_by_side (L2 flushed before every repeat, CUDA events, median; every
contender of a point timed in rounds whose order reverses every round, ABBA). The HBM bandwidth
and the fp16 / bf16 GEMM peaks are measured once at the start (roofline.py). The chunk-first
phase alone is timed with the torch profiler: the kernel time of tpp_partial_kernel with
CHUNKATTN_SEQ_SPLITS=1, which leaves that launch only the chunk-first CTAs. On sm_90+ the op's
final launch overlaps its partial launch (programmatic dependent launch); "ours_serial" times
ours with CHUNKATTN_OVERLAP_FINAL=0, the final launch after the partial one, as on sm_80; at the
SPLIT_SWEEP_POINTS ours is also timed at each forced chunk-first split count, at the
TAIL_SWEEP_POINTS at each forced private-tail split count. These variants are
checked against the reference and timed in the same ABBA rounds as the contenders. --grid smoke
also runs on CPU (no FlashInfer, no graphs, no profiler), so the pipeline can be tested anywhere.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from .. import envs
from ..plan import TppWorkspace
from ..ops.reference import tpp_decode_reference
from ..plan import build_plan, empty_plan
from ..plan.cache import PlanCache
from ..plan.capacity import PlanCapacity
from . import provenance
from .cascade_levels import cascade_levels
from .flashinfer_baselines import (batch_decode, flashinfer_version, multi_level_cascade,
                                   ours_with_fi_tails)
from .contenders import error_reason, ours, sdpa_per_sequence
from .kv_pool import KvPool
from .kernel_gpu_report import write_report
from .kernel_trees import ALL_GPU, GRIDS, describe, pool_blocks, tree_block_table
from .roofline import (chunk_first_flops, chunk_first_rows, copy_bytes, gemm_size,
                       kv_bytes_per_token, measure_gemm_tflops, measure_hbm_bandwidth, roofline_us,
                       unique_kv_tokens)
from .timing import Timer, Variant, cuda_graph, op_env

SDPA_MAX_ROWS = 32        # one SDPA call per row: past this it only adds minutes
CONTENDERS = ("ours", "ours_graph", "ours_vllm_graph", "empty_plan", "fi_decode",
              "fi_decode_graph", "fi_tails", "fi_tails_graph", "fi_cascade", "fi_cascade_graph",
              "sdpa")
BASELINES = ("empty_plan", "fi_decode", "fi_decode_graph", "fi_tails", "fi_tails_graph",
             "fi_cascade", "fi_cascade_graph", "sdpa")
OURS = ("ours", "ours_graph", "ours_vllm_graph", "empty_plan")   # a mismatch fails the run
# The served shape (`prefix1x2k_c256`'s decode batch) is in every sweep below: on the H100 the op
# chose 7 chunk-first splits there (896 chunk CTAs, 3.4 waves; each split a partial state per row
# that the final launch merges) and its 2048 final CTAs ran 5.2 waves.
SERVED = ("llama8b", "b=256 P=2048 S=128")
# Points where ours is also timed with its chunk-first KV splits forced (the host code's wave
# rule, csrc/cuda/tpp_host.h, against its neighbours), in a workspace with room for 16.
SPLIT_SWEEP_POINTS = {("paper", "n_p=4096 n_s=4096"), ("llama8b", "b=32 P=4096 S=1024"),
                      ("rl", "G=4 n=8 prompt 4K, gen 0"), ("smoke", "b=4 P=64 S=20"), SERVED}
SWEEP_SPLITS = (1, 4, 6, 7, 8, 9, 12, 16)
# Points where ours is also timed with its private tails' KV splits forced: with nothing shared the
# final launch does the whole decode (1024 CTAs of one head each, 2.6 waves at the paper point on an
# H100: ours 0.91x FlashInfer decode there); up to 9 splits, the workspace's 8 spare rows a row.
TAIL_SWEEP_POINTS = {("paper", "n_p=4096 n_s=0"), ("llama8b", "b=32 nothing shared, S=1024"),
                     ("llama8b", "b=128 nothing shared, S=1024"), ("smoke", "b=4 nothing shared"),
                     SERVED}
TAIL_SPLITS = (1, 2, 3, 4, 6, 9)
# Points where ours is also timed with the final launch's compact stage
# (CHUNKATTN_FINAL_STAGE_TOKENS=32: 4 CTAs an SM instead of 3, csrc/cuda/tpp_params.cuh) against
# the default (64): the paper point's two latency-bound final launches and the served shapes
# (Llama-3-8B, b = 128, 256).
FINAL_SWEEP_POINTS = {("paper", "n_p=4096 n_s=4096"), ("paper", "n_p=4096 n_s=0"),
                      ("llama8b", "b=128 P=2048 S=128"), ("smoke", "b=4 P=64 S=20"), SERVED}
FINAL_STAGES = (64, 32)
# At the same points, the partial launch's stage (CHUNKATTN_PARTIAL_STAGE_TOKENS=32: 3 CTAs an SM
# at head 128 instead of 2, csrc/cuda/tpp_params.cuh, partial_min_ctas) against the default, the
# whole op and, on CUDA, its chunk-first launch alone ("chunk-first <k>").
PARTIAL_STAGES = (64, 32)
# At the same points, the KV loads' two address paths (csrc/cuda/tpp_attend_tile.cuh,
# load_kv_stage): 64-bit offsets for K and V each (CHUNKATTN_KV_OFFSETS_I64=1) against one
# 32-bit offset a token for both, the default for vLLM's flash layout. Name -> the knob's value.
KV_OFFSETS = {"i64": 1, "i32": 0}


def chunk_first_kernel_us(fn, timer: Timer, reps: int) -> tuple[float, str]:
    """Median kernel time of the chunk-first launch in µs, or (nan, why not)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    try:
        with op_env({"CHUNKATTN_SEQ_SPLITS": 1}):
            fn()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    timer.flush.zero_()
                    fn()
                torch.cuda.synchronize()
        times = [e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type == DeviceType.CUDA and "tpp_partial_kernel" in e.name]
    except Exception as e:                       # a profiler without CUPTI: report, carry on
        return math.nan, f"chunk-first profile failed: {type(e).__name__}: {e}"
    if not times:
        return math.nan, "no tpp_partial_kernel in the profile (kernel renamed or fused?)"
    return statistics.median(times), ""


def variants_of_ours(bt, plan, fns: dict, sweep: bool, tail_sweep: bool = False,
                     final_sweep: bool = False) -> dict:
    """Our op under knobs, timed side by side with the contenders: "ours_serial" (CUDA: the
    final launch after the partial one), at a sweep point "splits_<k>" for each of SWEEP_SPLITS
    chunk-first KV splits, in a workspace with room for the most, at a tail sweep point
    "tails_<k>" for each of TAIL_SPLITS private-tail KV splits, and at a final sweep point
    "final_<k>" for each of FINAL_STAGES final-launch stage sizes, "partial_<k>" for each of
    PARTIAL_STAGES partial-launch ones and "kv_<k>" for each of KV_OFFSETS' address paths."""
    variants = {}
    if "ours" in fns and bt.query.device.type == "cuda":
        variants["ours_serial"] = Variant(fns["ours"], {"CHUNKATTN_OVERLAP_FINAL": 0})
    if sweep and plan.num_nodes and "ours" in fns:
        fn = ours(bt, plan, TppWorkspace(spare_rows_per_partial=max(SWEEP_SPLITS)))
        variants.update({f"splits_{k}": Variant(fn, {"CHUNKATTN_CHUNK_SPLITS": k})
                         for k in SWEEP_SPLITS})
    if tail_sweep and "ours" in fns:
        variants.update({f"tails_{k}": Variant(fns["ours"], {"CHUNKATTN_SEQ_SPLITS": k})
                         for k in TAIL_SPLITS})
    if final_sweep and "ours" in fns:
        variants.update({f"final_{k}": Variant(fns["ours"], {"CHUNKATTN_FINAL_STAGE_TOKENS": k})
                         for k in FINAL_STAGES})
        variants.update({f"partial_{k}": Variant(fns["ours"], {"CHUNKATTN_PARTIAL_STAGE_TOKENS": k})
                         for k in PARTIAL_STAGES})
        variants.update({f"kv_{k}": Variant(fns["ours"], {"CHUNKATTN_KV_OFFSETS_I64": v})
                         for k, v in KV_OFFSETS.items()})
    return variants


def _is_build_failure(e: Exception) -> bool:
    """A FlashInfer JIT build that failed fails the same way on every point, and each retry
    costs minutes of nvcc: such a failure drops that baseline for the rest of the run."""
    text = str(e).lower()
    return any(word in text for word in ("ninja", "nvcc", "build", "compil"))


def ours_capacity_mode(bt, block_size: int):
    """Our op as the builder runs a captured batch size (ChunkAttnMetadataBuilder.
    _graph_plans_for): a capacity PlanCache for the batch's rows and table width, and a workspace
    without split spares."""
    num_seqs, width = bt.block_table.shape
    plans = PlanCache(block_size, bt.query.device,
                      capacity=PlanCapacity.for_batch(num_seqs, width))
    plan = plans.get(bt.block_table.cpu().numpy(), bt.seq_lens.cpu().numpy())
    return ours(bt, plan, TppWorkspace(spare_rows_per_partial=0))


def _why(e: Exception) -> str:
    return error_reason(e, 120)


def make_contenders(bt, plan, levels, block_size: int, device, fi_why: str,
                    fi_broken: dict):
    """name -> callable, and name -> why it is not there. fi_broken: (name, dtype) -> the build
    failure that dropped that FlashInfer baseline, filled here."""
    fns, missing = {"ours": ours(bt, plan)}, {}
    if device.type == "cuda":
        fns["ours_graph"] = cuda_graph(ours(bt, plan))
        fns["ours_vllm_graph"] = cuda_graph(ours_capacity_mode(bt, block_size))
    else:
        missing["ours_graph"] = missing["ours_vllm_graph"] = "CUDA only"
    fns["empty_plan"] = ours(bt, empty_plan(bt.query.shape[0]))
    for name, make in (("fi_decode", lambda: batch_decode(bt, block_size)),
                       ("fi_tails", lambda: ours_with_fi_tails(bt, plan, block_size)),
                       ("fi_cascade", lambda: multi_level_cascade(bt, levels, block_size))):
        key = (name, bt.query.dtype)
        if fi_why or key in fi_broken:
            missing[name] = fi_why or fi_broken[key]
            continue
        try:
            fns[name] = make()
        except Exception as e:                   # a plan FlashInfer refuses: say why, carry on
            missing[name] = _why(e)
            if _is_build_failure(e):
                fi_broken[key] = f"JIT build failed on an earlier point: {missing[name]}"
            continue
        graph_key = (f"{name}_graph", bt.query.dtype)
        if device.type != "cuda":
            missing[graph_key[0]] = "CUDA only"
        elif graph_key in fi_broken:
            missing[graph_key[0]] = fi_broken[graph_key]
        else:
            try:
                fns[graph_key[0]] = cuda_graph(fns[name])
            except Exception as e:               # a capture that fails once fails everywhere
                why = missing[graph_key[0]] = _why(e)
                fi_broken[graph_key] = f"capture failed on an earlier point: {why}"
    if bt.query.shape[0] <= SDPA_MAX_ROWS:
        fns["sdpa"] = sdpa_per_sequence(bt)
    else:
        missing["sdpa"] = f"not timed past {SDPA_MAX_ROWS} rows"
    return fns, missing


def run_point(point, pool: KvPool, seed: int, timer: Timer, ceilings: dict, args,
              fi_why: str, fi_broken: dict) -> dict:
    shape, bs = point.shape, point.shape.block_size
    device = pool.kv_cache.device
    gen = torch.Generator().manual_seed(seed)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    bt = pool.from_table(table, lens, shape.num_heads, gen)
    plan = build_plan(table, lens, bs)
    levels = cascade_levels(plan, table, lens, bs)
    fns, missing = make_contenders(bt, plan, levels, bs, device, fi_why, fi_broken)
    variants = variants_of_ours(bt, plan, fns,
                                sweep=(point.grid, point.label) in SPLIT_SWEEP_POINTS,
                                tail_sweep=(point.grid, point.label) in TAIL_SWEEP_POINTS,
                                final_sweep=(point.grid, point.label) in FINAL_SWEEP_POINTS)
    fns.update(variants)
    ours_names = set(OURS) | set(variants)
    expect = tpp_decode_reference(bt.query, bt.key_cache, bt.value_cache, bt.block_table,
                                  bt.seq_lens, empty_plan(point.num_rows), bt.scale).float()
    ours_ok = True
    for name in list(fns):                       # every contender computes the same, or it drops
        try:
            got = fns[name]().float()
        except Exception as e:
            if name in ours_names:
                raise
            missing[name] = f"failed: {type(e).__name__}: {str(e).strip()[:120]}"
            del fns[name]
            continue
        try:
            torch.testing.assert_close(got, expect, atol=args.tol, rtol=args.tol)
        except AssertionError:
            err = (got - expect).abs().max().item()
            missing[name] = f"mismatch vs the reference: max abs err {err:.3g}"
            if name == "fi_cascade" and levels.num_empty_groups:
                missing[name] += f" ({levels.num_empty_groups} empty groups padding the levels)"
            ours_ok &= name not in ours_names
            del fns[name]
    row = dict(grid=point.grid, point=point.label, shape=str(shape), rows=point.num_rows,
               nodes=plan.num_nodes, levels=levels.num_levels,
               empty_groups=levels.num_empty_groups, tree=describe(point))
    timed = timer.side_by_side(fns, args.reps)  # every contender and variant, ABBA
    for name in CONTENDERS + ("ours_serial",):
        row[f"{name}_us"] = round(timed[name] * 1e3, 1) if name in timed else math.nan
    dtype = getattr(torch, shape.dtype)
    unique_bytes = unique_kv_tokens(table, lens, bs) * kv_bytes_per_token(
        shape.num_kv_heads, shape.head_size, dtype)
    row["unique_kv_MB"] = round(unique_bytes / 1e6, 2)
    row["roofline_us"] = round(roofline_us(unique_bytes, ceilings["hbm_GBs"]), 2)
    for name in BASELINES:                       # graph replays against our graph replay
        ours_us = row["ours_graph_us" if name.endswith("_graph") else "ours_us"]
        row[f"x_{name}"] = round(row[f"{name}_us"] / ours_us, 2)
    row["x_vllm_graph_vs_eager"] = round(row["ours_us"] / row["ours_vllm_graph_us"], 2)
    row["pct_roofline"] = round(100 * row["roofline_us"] / row["ours_us"], 1)
    flops = chunk_first_flops(plan, shape.num_heads, shape.head_size, bs)
    row["cf_rows"] = chunk_first_rows(plan, shape.num_heads, shape.num_kv_heads)
    row["cf_GFLOP"] = round(flops / 1e9, 3)
    cf_us, why = math.nan, "no shared node"
    if flops and device.type == "cuda" and "ours" in fns:
        cf_us, why = chunk_first_kernel_us(fns["ours"], timer, args.reps)
    elif flops:
        why = "chunk-first kernel time: CUDA only"
    row["cf_us"] = round(cf_us, 1)
    row["cf_TFLOPs"] = round(flops / (cf_us * 1e-6) / 1e12, 1)
    row["cf_pct_peak"] = round(100 * row["cf_TFLOPs"] / ceilings[f"gemm_TFLOPs_{shape.dtype}"], 1)
    notes = [f"{k}: {v}" for k, v in missing.items()
             if not v.startswith(("CUDA only", "not timed"))]
    for column, name, counts in (("split_sweep_us", "splits", SWEEP_SPLITS),
                                 ("tail_sweep_us", "tails", TAIL_SPLITS),
                                 ("final_sweep_us", "final", FINAL_STAGES),
                                 ("partial_sweep_us", "partial", PARTIAL_STAGES),
                                 ("kv_sweep_us", "kv", tuple(KV_OFFSETS))):
        row[column] = "; ".join(f"{k}: {timed[f'{name}_{k}'] * 1e3:.1f}"
                                for k in counts if f"{name}_{k}" in timed)
    if row["partial_sweep_us"] and math.isfinite(cf_us):   # the chunk-first launch in each stage
        cf = {k: chunk_first_kernel_us(fns[f"partial_{k}"], timer, args.reps)[0] for k in PARTIAL_STAGES}
        row["partial_sweep_us"] += "".join(f"; chunk-first {k}: {v:.1f}" for k, v in cf.items())
    row["notes"] = "; ".join(notes + ([why] if why and flops else []))
    row["ours_ok"] = ours_ok
    return row


def measure_ceilings(device: torch.device) -> dict:
    # Three significant digits, not one decimal: a CPU's fp16 GEMM rate (< 0.05 TFLOP/s under
    # torch 2.11) must not round to a zero ceiling.
    return {"copy_MiB": copy_bytes(device) >> 20, "gemm_n": gemm_size(device),
            "hbm_GBs": _sig3(measure_hbm_bandwidth(device)),
            "gemm_TFLOPs_float16": _sig3(measure_gemm_tflops(device, torch.float16)),
            "gemm_TFLOPs_bfloat16": _sig3(measure_gemm_tflops(device, torch.bfloat16))}


def _sig3(x: float) -> float:
    return float(f"{x:.3g}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return provenance.machine()


def run_tree_grids(args, command: str) -> int:
    device = torch.device(args.device)
    grids = ALL_GPU if args.grid == "gpu" else (args.grid,)
    fi_version, fi_why = flashinfer_version() if device.type == "cuda" else (None, "CUDA only")
    timer = Timer(device)
    t0 = time.time()
    ceilings = measure_ceilings(device)
    meta = dict(command=command, device=device_name(device), torch=torch.__version__,
                flashinfer=fi_version or fi_why, commit=provenance.git_commit(),
                reps=args.reps, tol=args.tol,
                overlap_final=envs.raw("OVERLAP_FINAL", "default"), **ceilings)
    print(" ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    rows: list[dict] = []
    fi_broken: dict = {}
    stem = f"kernel_{device.type}_{args.grid}"
    for grid in grids:
        points = GRIDS[grid]()
        shapes = {p.shape for p in points}
        for shape in sorted(shapes, key=str):    # one pool per shape, sized for its largest point
            of_shape = [p for p in points if p.shape == shape]
            pool = KvPool(pool_blocks(of_shape), shape.block_size, shape.num_kv_heads,
                          shape.head_size, getattr(torch, shape.dtype), device, "paged_nhd")
            for i, point in enumerate(of_shape):
                row = run_point(point, pool, seed=i, timer=timer, ceilings=ceilings, args=args,
                                fi_why=fi_why, fi_broken=fi_broken)
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            del pool
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.out is not None:                 # after every grid: a cut run keeps what it had
            meta["wall_s"] = round(time.time() - t0)
            write_report(rows, meta, args.out, stem)
    bad = [r["point"] for r in rows if not r["ours_ok"]]
    if bad:
        print(f"OURS DISAGREES WITH THE REFERENCE on: {bad}", flush=True)
    return 1 if bad else 0
