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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kv_layout import alloc_kv_cache, kv_cache_views
from ..decode import TppLaunch
from ..plan import TppWorkspace
from ..plan import build_plan, empty_plan
from ..plan.cache import PlanCache
from . import provenance
from .timing import Timer

FULL = dict(n_p=(1024, 2048, 4096), share=(0, 0.5, 1), b=(8, 32, 64), heads=((32, 8), (32, 32)),
            block=(16, 64))
QUICK = dict(n_p=(1024,), share=(0, 1), b=(8, 32), heads=((32, 8),), block=(16, 64))
# The points the CPU issue sets its goals on (n_p = 2048, b = 32; all or nothing shared).
GOALS = dict(n_p=(2048,), share=(0, 1), b=(32,), heads=((32, 8), (32, 32)), block=(16, 64))
GRIDS = {"full": FULL, "quick": QUICK, "goals": GOALS}
# Tree-shaped GPU grids (kernel_trees.py, run by kernel_gpu.py); gpu = paper + llama8b + rl +
# fewshot; smoke is tiny and also runs on CPU.
GPU_GRIDS = ("gpu", "paper", "llama8b", "rl", "fewshot", "smoke")


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor      # vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    #                             (KvPool layout "paged_nhd": [num_blocks, 2, block, kv heads, head])
    key_cache: torch.Tensor     # our [num_blocks, block_size, num_kv_heads, head_size] views of it
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    scale: float


class KvPool:
    """One random KV cache per (heads, block) config, sized for the largest point and reused:
    filling GBs of cache per point would dominate the run."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_size, dtype, device, layout):
        if layout == "paged_nhd":
            # FlashInfer's (and vLLM's FLASHINFER backend's) pages [blocks, 2, block, kv heads,
            # head]: our op reads the K and V halves in place, so both read the same bytes.
            self.kv_cache = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_size,
                                        dtype=dtype, device=device)
            self.key_cache, self.value_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]
        else:
            self.kv_cache = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                           dtype, device, layout)
            self.key_cache, self.value_cache = kv_cache_views(self.kv_cache, layout)
        self.kv_cache.normal_()
        self.block_size = block_size

    def batch(self, n_p, n_s, b, num_heads, seed) -> Batch:
        bs = self.block_size
        seq_len = n_p + 1
        shared = n_s // bs
        private = -(-seq_len // bs) - shared
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(self.kv_cache.shape[0] - 1, generator=g)[:shared + b * private] + 1
        table = torch.cat([ids[:shared].expand(b, shared), ids[shared:].view(b, private)], dim=1)
        head_size = self.key_cache.shape[-1]
        dev = self.kv_cache.device
        query = torch.randn(b, num_heads, head_size, generator=g).to(self.kv_cache.dtype).to(dev)
        return Batch(query, self.kv_cache, self.key_cache, self.value_cache,
                     table.to(torch.int32).to(dev),
                     torch.full((b,), seq_len, dtype=torch.int32, device=dev), head_size ** -0.5)

    def from_table(self, block_table, seq_lens, num_heads, generator) -> Batch:
        """A batch over given host block table / seq_lens (kernel_trees.tree_block_table)."""
        head_size = self.key_cache.shape[-1]
        dev = self.kv_cache.device
        query = torch.randn(block_table.shape[0], num_heads, head_size, generator=generator)
        return Batch(query.to(self.kv_cache.dtype).to(dev), self.kv_cache, self.key_cache,
                     self.value_cache, block_table.to(torch.int32).to(dev),
                     seq_lens.to(torch.int32).to(dev), head_size ** -0.5)


# ---- the contenders: each returns a zero-argument callable writing into a preallocated output

def ours(bt: Batch, plan, workspace: TppWorkspace | None = None):
    """One layer's call, as the backend makes it: the step's TppLaunch is built beforehand.
    workspace: its own TppWorkspace() unless given (graph mode: no split spares)."""
    out = torch.empty_like(bt.query)
    launch = TppLaunch(plan.to(bt.query.device), bt.block_table, bt.seq_lens, bt.query.shape[1],
                       bt.query.shape[2], bt.query.device, workspace or TppWorkspace(),
                       kernel="native")
    return lambda: launch.run(bt.query, bt.key_cache, bt.value_cache, bt.scale, out)


def plan_step(bt: Batch, block_size: int):
    """The host work of one step, shared by every layer, as ChunkAttnMetadataBuilder.build does
    it on a rebuild: a PlanCache that never reuses (key, plan, shared-token count, the host plan
    check on a GPU, the upload: pinned staging and an async copy there), then TppLaunch. Time it
    with the host clock (Timer(cpu)): it is host work, and the copy overlaps the GPU."""
    host_table, host_lens = bt.block_table.cpu().numpy(), bt.seq_lens.cpu().numpy()
    plans = PlanCache(block_size, bt.query.device)
    plans.enabled = False
    workspace = TppWorkspace()

    def run():
        plan = plans.get(host_table, host_lens)
        return TppLaunch(plan, bt.block_table, bt.seq_lens, bt.query.shape[1], bt.query.shape[2],
                         bt.query.device, workspace, kernel="native")
    return run


def host_ms(fn, reps: int) -> float:
    """Median host milliseconds of fn (wall clock, no device events)."""
    return Timer(torch.device("cpu"))(fn, reps)


def vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU_ATTN ISA vLLM itself picks on this machine (amx where the CPU has AMX)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_size)


def sdpa_per_sequence(bt: Batch):
    """Naive: gather each sequence's KV, one SDPA call per sequence (GQA by the op)."""
    bs = bt.key_cache.shape[1]
    out = torch.empty_like(bt.query)
    lens = bt.seq_lens.tolist()

    def run():
        for i, n in enumerate(lens):
            ids = bt.block_table[i, :-(-n // bs)].long()
            k = bt.key_cache[ids].flatten(0, 1)[:n].transpose(0, 1)
            v = bt.value_cache[ids].flatten(0, 1)[:n].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(bt.query[i][:, None], k, v, scale=bt.scale,
                                                    enable_gqa=True)[:, 0]
        return out
    return run


def cpu_attn(bt: Batch, isa: str):
    """vLLM's CPU_ATTN decode, called as vllm/v1/attention/backends/cpu_attn.py calls it."""
    from vllm import _custom_ops as ops
    num_seqs, num_heads, head_size = bt.query.shape
    num_blocks, num_kv_heads, block_size, _ = bt.kv_cache.shape
    key_cache, value_cache = bt.kv_cache.view(num_blocks, num_kv_heads, block_size * 2,
                                              head_size).chunk(2, dim=2)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=bt.seq_lens, dtype=bt.query.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=_vllm_split_kv())
    out = torch.empty_like(bt.query)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=bt.query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=bt.seq_lens, scale=bt.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=bt.block_table, softcap=0,
            scheduler_metadata=sched, s_aux=None)
        return out
    return run


def _vllm_split_kv() -> bool:
    from vllm import envs
    return envs.VLLM_CPU_ATTN_SPLIT_KV


def flashinfer_decode(bt: Batch):
    """FlashInfer's paged batch decode (no prefix awareness: flashinfer_baselines.batch_decode),
    planned and run once, as (callable, "") or (None, why not). Any failure is a reason, not a
    crash: a JIT build that fails inside plan() raises RuntimeError, not ImportError, and the
    bench that asked for the baseline carries on without it."""
    if bt.query.dtype not in (torch.float16, torch.bfloat16):
        return None, f"FlashInfer decode has no {bt.query.dtype} kernels"
    try:
        from .flashinfer_baselines import batch_decode
        fn = batch_decode(bt, bt.key_cache.shape[1])
        fn()
    except Exception as e:
        return None, error_reason(e, 160)
    return fn, ""


def error_reason(e: Exception, limit: int) -> str:
    """A baseline left out, in one line: the exception's type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


# ---- timing

def attention_flops(bt: Batch) -> float:
    num_heads, head_size = bt.query.shape[1:]
    return 4.0 * num_heads * head_size * float(bt.seq_lens.sum())


def machine() -> str:
    return (f"{provenance.machine()}, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads, {torch.backends.cpu.get_cpu_capability()}), load average "
            f"{provenance.load_average()}, commit {provenance.git_commit()}")


def run_grid(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    g = GRIDS["quick" if args.quick else args.grid]
    layout = "cpu_attn" if device.type == "cpu" else "flash"
    timer = Timer(device)
    rows = []
    fi_off = ""     # why FlashInfer failed once: not retried (a failed JIT build costs minutes)
    for (hq, hkv), block in itertools.product(args.heads or g["heads"], g["block"]):
        isa = vllm_cpu_isa(dtype, block, args.head_size) if device.type == "cpu" else ""
        per_seq_blocks = -(-(max(g["n_p"]) + 1) // block)
        pool = KvPool(max(g["b"]) * per_seq_blocks + 1, block, hkv, args.head_size, dtype, device,
                      layout)
        for n_p, share, b in itertools.product(g["n_p"], g["share"], g["b"]):
            n_s = int(n_p * share) // block * block
            bt = pool.batch(n_p, n_s, b, hq, seed=n_p + b)
            plan_ms = host_ms(plan_step(bt, block), args.reps)
            plan = build_plan(bt.block_table.cpu(), bt.seq_lens.cpu(), block)
            contenders = {"ours": ours(bt, plan)}
            if device.type == "cpu":
                contenders["cpu_attn"] = cpu_attn(bt, isa)
            else:
                contenders["paged_no_prefix"] = ours(bt, empty_plan(b))
                fi, why = (None, fi_off) if fi_off else flashinfer_decode(bt)
                if fi is not None:
                    contenders["flashinfer"] = fi
                elif not fi_off:
                    fi_off = why
                    print(f"FlashInfer decode left out for the rest of the run: {why}",
                          flush=True)
            if b <= args.naive_max_b or device.type == "cuda":
                contenders["sdpa_per_seq"] = sdpa_per_sequence(bt)
            base_name = "cpu_attn" if device.type == "cpu" else "sdpa_per_seq"
            expect = contenders["ours" if isa == "amx" else base_name]().clone()
            for name, fn in contenders.items():   # all computed the same thing, or stop
                if isa == "amx" and "cpu_attn" in (name, base_name):
                    continue    # AMX reads K packed in tiles: timed on the same bytes, not compared
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
    df = pd.DataFrame(rows)
    df.to_csv(out_dir / f"{stem}.csv", index=False)
    base = "cpu_attn" if args.device == "cpu" else "sdpa_per_seq"
    lines = [f"# TPP decode kernel vs {base} ({args.device})", "",
             f"Command: `{command}`", "", f"Machine: {machine()}", "",
             f"One layer, one decode step, {args.dtype}, head_size {args.head_size}; times are "
             f"medians in ms after a warm-up, the contenders timed side by side in rounds whose "
             f"order reverses every round (ABBA; per-sequence SDPA on CPU: one call, after "
             f"them); speed-up = baseline / ours. Every sequence holds "
             f"n_p prompt tokens + 1; the first n_s are shared by all b sequences. Outputs were "
             f"checked equal (atol = rtol = {args.tol}) before timing.", "",
             f"- baseline_isa: the CPU_ATTN ISA vLLM picks itself on this machine and block size "
             f"(amx on AMX CPUs for bf16 at block % 32 == 0; that layout packs K, so it is timed "
             f"on the same bytes but not compared).",
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
    args = p.parse_args(argv)
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
