"""python -m vllm_chunkattn.bench kernel: one decode step of one layer, our TPP kernel against the
stock baselines on the same KV contents and layout, over prompt length n_p, shared prefix n_s and
batch b (every sequence holds n_p prompt tokens + the new one; the first n_s are one prefix shared
by all b). CPU: vLLM's CPU_ATTN (vec / vec16) and per-sequence SDPA. CUDA: per-sequence SDPA, our op
with the empty plan (paged decode, no prefix awareness) and FlashInfer's batch decode if installed.
Outputs are checked against the first baseline before anything is timed."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from ..ops import cpu_kv_layout
from ..plan import build_plan, empty_plan
from .contenders import (Variant, attention_flops, cpu_attn, flashinfer_decode, host_ms, machine,
                         ours, plan_step, sdpa_per_sequence, vllm_cpu_isa)
from .kv_pool import KvPool
from .timing import Timer

FULL = dict(n_p=(1024, 2048, 4096), share=(0, 0.5, 1), b=(8, 32, 64), heads=((32, 8), (32, 32)),
            block=(16, 64))
QUICK = dict(n_p=(1024,), share=(0, 1), b=(8, 32), heads=((32, 8),), block=(16, 64))
# The points the CPU goals are set on (n_p = 2048, b = 32; all or nothing shared).
GOALS = dict(n_p=(2048,), share=(0, 1), b=(32,), heads=((32, 8), (32, 32)), block=(16, 64))
GRIDS = {"full": FULL, "quick": QUICK, "goals": GOALS}
# Tree-shaped GPU grids (kernel_trees.py, run by kernel_gpu.py); gpu = paper + llama8b + rl +
# fewshot; smoke is tiny and also runs on CPU.
GPU_GRIDS = ("gpu", "paper", "llama8b", "rl", "fewshot", "smoke")


def run_grid(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    g = GRIDS["quick" if args.quick else args.grid]
    timer = Timer(device)
    rows = []
    fi_off = ""     # why FlashInfer failed once: not retried (a failed JIT build costs minutes)
    # vLLM's CPU backend keeps fp8 caches in blocks of a multiple of 32 tokens only.
    blocks = [bs for bs in g["block"] if not (args.variant.fp8_dtype and device.type == "cpu"
                                              and bs % 32)]
    for (hq, hkv), block in itertools.product(args.heads or g["heads"], blocks):
        isa = (vllm_cpu_isa(dtype, block, args.head_size, args.variant.kv_cache_dtype)
               if device.type == "cpu" else "")
        layout = (cpu_kv_layout(isa, args.head_size, args.variant.fp8_dtype or dtype)
                  if device.type == "cpu" else "flash")
        # CPU_ATTN's AMX layout where ours cannot read it: timed on the same bytes, not compared
        unreadable = isa == "amx" and layout != "cpu_attn_amx"
        per_seq_blocks = -(-(max(g["n_p"]) + 1) // block)
        pool = KvPool(max(g["b"]) * per_seq_blocks + 1, block, hkv, args.head_size, dtype, device,
                      layout, args.variant.fp8_dtype)
        for n_p, share, b in itertools.product(g["n_p"], g["share"], g["b"]):
            n_s = int(n_p * share) // block * block
            bt = pool.batch(n_p, n_s, b, hq, seed=n_p + b)
            plan_ms = host_ms(plan_step(bt, block), args.reps)
            plan = build_plan(bt.block_table.cpu(), bt.seq_lens.cpu(), block)
            contenders = {"ours": ours(bt, plan, variant=args.variant)}
            if device.type == "cpu":
                contenders["cpu_attn"] = cpu_attn(bt, isa, args.variant)
            else:
                contenders["paged_no_prefix"] = ours(bt, empty_plan(b))
                fi, why = (None, fi_off) if fi_off else flashinfer_decode(bt)
                if fi is not None:
                    contenders["flashinfer"] = fi
                elif not fi_off:
                    fi_off = why
                    print(f"FlashInfer decode left out for the rest of the run: {why}",
                          flush=True)
            if (b <= args.naive_max_b or device.type == "cuda") and args.variant == Variant():
                contenders["sdpa_per_seq"] = sdpa_per_sequence(bt)     # (full attention only)
            base_name = "cpu_attn" if device.type == "cpu" else "sdpa_per_seq"
            expect = contenders["ours" if unreadable else base_name]().clone()
            for name, fn in contenders.items():   # all computed the same thing, or stop
                if unreadable and "cpu_attn" in (name, base_name):
                    continue
                torch.testing.assert_close(fn().float(), expect.float(), atol=args.tol,
                                           rtol=args.tol, msg=lambda m: f"{name} vs {base_name}: {m}")
            row = dict(device=device.type, n_p=n_p, n_s=n_s, b=b, heads=f"{hq}/{hkv}",
                       head_size=args.head_size, block=block, dtype=args.dtype,
                       baseline_isa=isa, plan_ms=round(plan_ms, 3))
            # naive CPU SDPA: seconds a call, already warmed by the check above; one repeat,
            # after the others, which are timed side by side (ABBA)
            naive = contenders.pop("sdpa_per_seq", None) if device.type == "cpu" else None
            for name, ms in timer.side_by_side(contenders, args.reps).items():
                row[f"{name}_ms"] = round(ms, 3)
            if naive is not None:
                row["sdpa_per_seq_ms"] = round(timer(naive, 1, warmup=False), 3)
            row.setdefault("sdpa_per_seq_ms", float("nan"))
            row["ours_vs_" + base_name] = round(row[f"{base_name}_ms"] / row["ours_ms"], 2)
            # The plan is built once per step for all layers: its share of one layer's call.
            row["step_ours_vs_" + base_name] = round(
                row[f"{base_name}_ms"] / (row["ours_ms"] + plan_ms / args.layers), 2)
            if "sdpa_per_seq" != base_name:
                row["ours_vs_sdpa_per_seq"] = round(row["sdpa_per_seq_ms"] / row["ours_ms"], 2)
            row["ours_gflops"] = round(attention_flops(bt) / row["ours_ms"] / 1e6, 1)
            if device.type == "cpu":
                row["ours_vs_torch_gemm"] = round(row["ours_gflops"] / args.gemm_gflops, 2)
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            del bt, contenders, expect
        del pool
    return rows


def write_results(rows, args, out_dir: Path, command: str):
    import pandas as pd
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"kernel_{args.device}" + ("" if args.grid == "full" else f"_{args.grid}")
    stem += f"_{args.model_shape}" if args.model_shape else ""
    stem += "_fp32" if args.dtype == "float32" else ""
    v = args.variant
    stem += (f"_w{v.sliding_window}" if v.sliding_window else "") + (
        f"_cap{v.soft_cap:g}" if v.soft_cap else "") + ("_sinks" if v.sinks else "") + (
        f"_{v.kv_cache_dtype}" if v.kv_cache_dtype != "auto" else "")
    df = pd.DataFrame(rows)
    df.to_csv(out_dir / f"{stem}.csv", index=False)
    base = "cpu_attn" if args.device == "cpu" else "sdpa_per_seq"
    lines = [f"# TPP decode kernel vs {base} ({args.device})", "",
             f"Command: `{command}`", "", f"Machine: {machine()}", "",
             f"One layer ({args.variant.label()}), one decode step, {args.dtype}, head_size "
             f"{args.head_size}; times are "
             f"medians in ms after a warm-up, the contenders timed side by side in rounds whose "
             f"order reverses every round (ABBA; per-sequence SDPA on CPU: one call, after "
             f"them); speed-up = baseline / ours. Every sequence holds "
             f"n_p prompt tokens + 1; the first n_s are shared by all b sequences. Outputs were "
             f"checked equal (atol = rtol = {args.tol}) before timing.", "",
             f"- baseline_isa: the CPU_ATTN ISA vLLM picks itself on this machine and block size "
             f"(amx on AMX CPUs for bf16 at block % 32 == 0): the cache holds that ISA's layout, "
             f"which ours reads in place as the plugin serves it (bf16 kernels, head sizes "
             f"64-256).",
             f"- plan_ms: the host work of one step, done once for all layers (plan from the "
             f"block table, to the device, TppLaunch); step_ours_vs_*: the speed-up with "
             f"plan_ms / {args.layers} layers added to ours.",
             f"- ours_vs_torch_gemm: ours_gflops over torch's own {args.dtype} GEMM rate on "
             f"2048^3 measured in this run: {args.gemm_gflops:.0f} GFLOP/s.", "",
             markdown_table(df)]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(df, base, out_dir / f"{stem}.png")


def markdown_table(df) -> str:
    head = "| " + " | ".join(df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def plot(df, base: str, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(itertools.product(sorted(df["heads"].unique()), sorted(df["block"].unique())))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (heads, block) in zip(axes[0], panels):
        sub = df[(df["heads"] == heads) & (df["block"] == block)]
        for (n_p, b), grp in sub.groupby(["n_p", "b"]):
            share = grp["n_s"] / grp["n_p"]
            ax.plot(share, grp[f"ours_vs_{base}"], marker="o", label=f"n_p={n_p} b={b}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"heads {heads}, block {block}")
        ax.set_xlabel("shared fraction n_s / n_p")
        ax.set_ylabel(f"speed-up vs {base}")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench kernel", description=__doc__)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="small subset (smoke run)")
    p.add_argument("--grid", default="full", choices=tuple(GRIDS) + GPU_GRIDS,
                   help="full: the whole grid; goals: only its goal points (file stem "
                        "kernel_<device>_goals); gpu, paper, llama8b, rl, fewshot: the tree "
                        "grids against FlashInfer (--device cuda; each fixes its own heads, "
                        "dtype and block; kernel_gpu.py); smoke: tiny tree points, any device")
    p.add_argument("--out", type=Path, default=None, help="folder for kernel_<device>.{csv,md,png}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="KV and query dtype (float32: the CPU kernels' fp32 path, as the tiny "
                        "model's fp32 exactness runs serve it)")
    p.add_argument("--layers", type=int, default=None,
                   help="layers the per-step plan cost is divided over in step_ours_vs_* "
                        "(default: the --model-shape's, else 16)")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--model-shape", default=None,
                   help="heads / kv heads / head size of a vllm_chunkattn.bench.model_shapes shape "
                        "(e.g. llama-3.2-1b) instead of the grid's and --head-size")
    p.add_argument("--reps", type=int, default=7, help="timed repeats (fewer past ~2 s a point)")
    p.add_argument("--naive-max-b", type=int, default=8,
                   help="CPU: time per-sequence SDPA (seconds a call) only up to this batch, once")
    p.add_argument("--tol", type=float, default=2e-2, help="output agreement required before timing")
    p.add_argument("--sliding-window", type=int, default=0,
                   help="time a windowed layer: each row sees its last N keys (gpt-oss: 128)")
    p.add_argument("--soft-cap", type=float, default=0.0, help="logit soft-cap (Gemma 2: 50)")
    p.add_argument("--sinks", action="store_true", help="attention sinks, one logit a head (gpt-oss)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e5m2"),
                   help="an fp8 KV cache (CPU: vLLM's CPU_ATTN reads its own fp8 layout)")
    args = p.parse_args(argv)
    args.variant = Variant(args.sliding_window, args.soft_cap, args.sinks, args.kv_cache_dtype)
    command = "python -m vllm_chunkattn.bench kernel " + " ".join(
        sys.argv[2:] if argv is None else argv)
    if args.grid in GPU_GRIDS:
        if args.device == "cuda" and not torch.cuda.is_available():
            p.error("--device cuda needs a CUDA GPU")
        if args.device == "cpu" and args.grid != "smoke":
            p.error(f"--grid {args.grid} is sized for a GPU: use --device cuda (or --grid smoke)")
        from .kernel_gpu import run_tree_grids
        return run_tree_grids(args, command)
    args.heads = None
    from .model_shapes import SHAPES, attention_shape
    if args.model_shape:
        if args.model_shape not in SHAPES:
            p.error(f"--model-shape: choose from {list(SHAPES)}")
        num_heads, num_kv_heads, args.head_size = attention_shape(args.model_shape)
        args.heads = ((num_heads, num_kv_heads),)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    if args.layers is None:
        args.layers = (SHAPES[args.model_shape]["num_hidden_layers"] if args.model_shape else 16)
    from .roofline import measure_gemm_tflops      # (it imports this module)
    # torch's own 2048^3 GEMM rate on this CPU in this run: what ours_vs_torch_gemm divides by
    args.gemm_gflops = (1e3 * measure_gemm_tflops(torch.device("cpu"), getattr(torch, args.dtype),
                                                  n=2048, reps=5)
                        if args.device == "cpu" else float("nan"))
    rows = run_grid(args)
    if args.out is not None:
        write_results(rows, args, args.out, command)
    return 0
