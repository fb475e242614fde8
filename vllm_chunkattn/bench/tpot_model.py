"""python -m vllm_chunkattn.bench tpot: decode TPOT on paper, stock vs CUSTOM, from measured parts.

One decode step of a model shape at batch B (every sequence: a prompt of n_p tokens + the new
one, the first n_s shared by the whole batch) is predicted as
    stock  TPOT = layers x (stock attention + linear) + head
    CUSTOM TPOT = layers x (our attention + linear) + head + plan
attention: one layer's decode on the same KV contents, with bench kernel's building blocks: ours
(TPP with the step's plan) against stock's, FlashInfer's batch decode on CUDA (our op with the
empty plan where FlashInfer is missing, labelled so) and vLLM's CPU_ATTN on CPU; linear: one
decoder layer without attention as torch ops (bench/linear_layers.py); head: final norm, lm_head,
argmax; plan: the plan's host work, once a step.

    python -m vllm_chunkattn.bench tpot --device cuda --out DIR   # the GPU grid below
    python -m vllm_chunkattn.bench tpot --out DIR                 # CPU: bench step's points

On CPU the points are those `bench step` measured in vLLM's in-process engine (--check JSON), and
the report sets predicted beside measured step ms and speed-ups. On CUDA nothing imports vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .model_shapes import SHAPES, attention_shape
from ..ops import cpu_kv_layout
from ..plan import build_plan, empty_plan
from . import provenance
from .contenders import (cpu_attn, flashinfer_decode, host_ms, machine, ours, plan_step,
                         vllm_cpu_isa)
from .kernel import markdown_table
from .kv_pool import KvPool
from .linear_layers import (LayerWeights, decoder_layer_without_attention, layer_flops, lm_head,
                            lm_head_weight)
from .roofline import kv_bytes_per_token, measure_hbm_bandwidth, roofline_us, unique_kv_tokens
from .timing import Timer, cuda_graph
from .vllm_flash_attn import vllm_fa3_decode

# The GPU points: 2-4K shared of a 4096-token prompt (0: the no-sharing control), plus a
# private tail per sequence.
CUDA_GRID = dict(shapes="llama-3-8b,qwen2.5-32b", batch="32,128,256", prompt=4096,
                 shared="0,2048,4096", private=128, block=16)
CPU_CHECK = Path(__file__).resolve().parents[2] / "benchmarks/results/step_cpu_llama-3.2-1b.json"
CPU_BLOCK = 64          # bench step's LLM(block_size=64)


@dataclass(frozen=True)
class Point:
    shape: str
    batch: int
    prompt: int         # n_p: prompt tokens of every sequence (the new token comes on top)
    shared: int         # n_s: the leading prompt tokens all sequences share


def predict(layers: int, stock_attention_ms: float, custom_attention_ms: float,
            linear_ms: float, head_ms: float, plan_ms: float,
            custom_roofline_ms: float | None = None) -> dict:
    """The two TPOTs and their ratio, and two ceilings of that ratio with everything but our
    attention as measured: at its roofline (`custom_roofline_ms`: the batch's unique KV bytes at
    the measured memory bandwidth, what no decode kernel that reads each byte once beats) and
    with attention costing nothing (what no kernel beats)."""
    stock = layers * (stock_attention_ms + linear_ms) + head_ms
    custom = layers * (custom_attention_ms + linear_ms) + head_ms + plan_ms
    rest = layers * linear_ms + head_ms + plan_ms
    out = dict(stock_tpot_ms=stock, custom_tpot_ms=custom, predicted_speedup=stock / custom,
               stock_attention_share=layers * stock_attention_ms / stock,
               custom_attention_share=layers * custom_attention_ms / custom)
    if custom_roofline_ms is not None:
        out["speedup_at_roofline"] = stock / (rest + layers * custom_roofline_ms)
    out["speedup_attention_free"] = stock / rest
    return out


def grid_points(shapes, batches, shared, prompt: int | None, private: int) -> list[Point]:
    """prompt None: each prompt is its shared prefix + the private tail (bench step's)."""
    return [Point(s, b, (n_s if prompt is None else prompt) + private, n_s)
            for s in shapes for b in batches for n_s in shared]


def measured_steps(path: Path, engine: str) -> tuple[str, dict[Point, dict[str, float]]]:
    """bench step's JSON: (dtype, {point: {"stock": ms, "custom": ms}}) of one engine's rows."""
    steps: dict[Point, dict[str, float]] = {}
    dtypes = set()
    for r in json.loads(path.read_text()):
        if r["engine"] != engine:
            continue
        point = Point(Path(r["model"]).name, r["batch"], r["shared"] + r["private"], r["shared"])
        steps.setdefault(point, {})[r["system"]] = r["step_ms"]
        dtypes.add(r["dtype"])
    if len(dtypes) != 1:
        raise ValueError(f"{path}: expected one dtype among the {engine} rows, got {dtypes}")
    return dtypes.pop(), steps


def stock_attention(bt, device: torch.device, isa: str):
    """(label, callable, others) of what stock vLLM runs for one layer's decode attention: on a
    GPU its FlashAttention 3 where vLLM is installed, else FlashInfer's decode as its stand-in;
    others: {name: callable} timed beside (FlashInfer's decode where FA3 is stock)."""
    if device.type == "cpu":
        return f"vLLM CPU_ATTN ({isa})", cpu_attn(bt, isa), {}
    fi, why = flashinfer_decode(bt)
    fa3, why_fa3 = vllm_fa3_decode(bt)
    if fa3 is not None:
        return "vLLM FLASH_ATTN (FlashAttention 3)", fa3, {"flashinfer": fi} if fi else {}
    print(f"stock's FlashAttention 3 not timed: {why_fa3}", flush=True)
    if fi is not None:
        return "FlashInfer batch decode", fi, {}
    return (f"ours with the empty plan (FlashInfer unavailable: {why})",
            ours(bt, empty_plan(bt.query.shape[0])), {})


def measure_shape(shape: str, points: list[Point], args, timer: Timer,
                  bandwidth_gbs: float) -> list[dict]:
    """The points of one model shape; bandwidth_gbs: the device's, measured once a run (the
    roofline ceiling's)."""
    config = SHAPES[shape]
    layers = config["num_hidden_layers"]
    num_heads, num_kv_heads, head_dim = attention_shape(shape)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batches = sorted({p.batch for p in points})
    # On CUDA the layer's dozen ops and the head replay from a CUDA graph, as a served decode
    # step runs them: timed eager, their launches weighed as much as their GPU work (the H100's
    # 0.47 ms a layer at b = 128 against a served step of 14.7 ms for 32 layers).
    graphed = cuda_graph if device.type == "cuda" else (lambda fn: fn)
    weights = LayerWeights.random(config, dtype, device)
    linear_ms = {b: timer(graphed(decoder_layer_without_attention(config, weights, b)), args.reps)
                 for b in batches}
    del weights
    head_weight = lm_head_weight(config, dtype, device)
    head_ms = {b: timer(graphed(lm_head(config, head_weight, b)), args.reps) for b in batches}
    del head_weight
    isa = vllm_cpu_isa(dtype, args.block, head_dim) if device.type == "cpu" else ""
    layout = cpu_kv_layout(isa, head_dim, dtype) if device.type == "cpu" else "flash"
    blocks_per_seq = -(-(max(p.prompt for p in points) + 1) // args.block)
    pool = KvPool(max(batches) * blocks_per_seq + 1, args.block, num_kv_heads, head_dim, dtype,
                  device, layout)
    kv_bytes = kv_bytes_per_token(num_kv_heads, head_dim, dtype)
    rows = []
    for p in points:
        bt = pool.batch(p.prompt, p.shared, p.batch, num_heads, seed=p.prompt + p.batch)
        plan = build_plan(bt.block_table.cpu(), bt.seq_lens.cpu(), args.block)
        custom = ours(bt, plan)
        stock_label, stock, others = stock_attention(bt, device, isa)
        if isa != "amx" or layout == "cpu_attn_amx":   # else timed on the same bytes only
            for fn in (stock, *others.values()):
                torch.testing.assert_close(custom().float(), fn().float(), atol=args.tol,
                                           rtol=args.tol)
        attention = timer.side_by_side({"stock": stock, "custom": custom, **others}, args.reps)
        parts = dict(stock_attention_ms=attention["stock"],
                     custom_attention_ms=attention["custom"],
                     linear_ms=linear_ms[p.batch], head_ms=head_ms[p.batch],
                     plan_ms=host_ms(plan_step(bt, args.block), args.reps))
        beside = {f"{name}_attention_ms": attention[name] for name in others}
        unique_bytes = unique_kv_tokens(bt.block_table, bt.seq_lens, args.block) * kv_bytes
        roofline_ms = roofline_us(unique_bytes, bandwidth_gbs) / 1e3
        row = dict(**asdict(p), layers=layers, dtype=args.dtype, block=args.block,
                   stock_attention=stock_label, **parts, custom_roofline_ms=roofline_ms,
                   bandwidth_gbs=bandwidth_gbs, **beside,
                   **predict(layers, **parts, custom_roofline_ms=roofline_ms),
                   linear_tflops=layer_flops(config, p.batch) / parts["linear_ms"] / 1e9)
        rows.append(row)
        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        del bt, custom, stock, others
    del pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_measured(rows: list[dict], measured: dict[Point, dict[str, float]]):
    """Measured step ms beside the prediction; residual = measured - predicted."""
    for row in rows:
        m = measured[Point(row["shape"], row["batch"], row["prompt"], row["shared"])]
        row.update(measured_stock_ms=m["stock"], measured_custom_ms=m["custom"],
                   residual_stock_ms=m["stock"] - row["stock_tpot_ms"],
                   residual_custom_ms=m["custom"] - row["custom_tpot_ms"],
                   measured_speedup=m["stock"] / m["custom"])


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return v


REPORT_COLUMNS = ("shape", "batch", "prompt", "shared", "stock_attention_ms",
                  "custom_attention_ms", "custom_roofline_ms", "linear_ms", "head_ms", "plan_ms",
                  "stock_tpot_ms", "custom_tpot_ms", "predicted_speedup", "speedup_at_roofline",
                  "speedup_attention_free", "stock_attention_share", "custom_attention_share")
CHECK_COLUMNS = ("shape", "batch", "prompt", "shared", "stock_tpot_ms", "measured_stock_ms",
                 "residual_stock_ms", "custom_tpot_ms", "measured_custom_ms",
                 "residual_custom_ms", "predicted_speedup", "measured_speedup")


def write_results(rows: list[dict], args, command: str) -> Path:
    import pandas as pd
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tpot_{args.device}" + (f"_{args.tag}" if args.tag else "")
    df = pd.DataFrame(rows)
    df.to_csv(out / f"{stem}.csv", index=False)
    gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    timing = ("CUDA events after a warm-up, L2 flushed before each repeat; linear and head "
              "replayed from a CUDA graph" if args.device == "cuda" else "wall clock after a warm-up")
    timing += "; the two attentions timed side by side, the order reversed every round (ABBA)"
    lines = [f"# Decode TPOT predicted from measured parts: stock vs CUSTOM ({args.device})", "",
             f"Command: `{command}`", "",
             f"Machine: {machine()}{gpu}; {provenance.native_build()}", "",
             "Method: per decode step, TPOT = layers x (attention + linear) + head, plus the "
             "plan's host work once a step for CUSTOM. attention is one layer's decode timed on "
             f"the same KV contents (ours with the step's plan; stock: "
             f"{rows[0]['stock_attention']}), outputs checked equal first; linear is one "
             "decoder layer's non-attention ops at batch B (RMSNorm, qkv_proj, rotary, "
             "o_proj, residual, RMSNorm, gate_up_proj, SiLU*up, down_proj, residual; random "
             "weights; the projections as vLLM runs them on the device: its own CPU GEMM "
             "dispatch, oneDNN on prepacked weights, on CPU; F.linear, cuBLAS, on CUDA); head is the final RMSNorm, the lm_head GEMM and an argmax over fp32 "
             "logits. Left out: the embedding lookup, the KV-cache write, stock's own per-step "
             "attention metadata, scheduling, sampling beyond the argmax, and the framework's "
             "Python.", "",
             f"- {args.dtype}, block size {args.block}; every sequence holds `prompt` tokens + "
             f"the new one, the first `shared` shared by the whole batch; times are medians in "
             f"ms ({timing}); "
             "attention, linear: per layer; head, plan: per step; speed-up = stock / CUSTOM.",
             f"- Ceilings of the speed-up, everything else as measured: `speedup_at_roofline` "
             f"with our attention at `custom_roofline_ms`, the batch's unique KV bytes (each "
             f"block once, `roofline.unique_kv_tokens`) at the measured copy bandwidth "
             f"({rows[0]['bandwidth_gbs']:.0f} GB/s), which no kernel reading each byte once "
             f"beats; `speedup_attention_free` with our attention costing nothing.",
             ]
    if args.device == "cpu":
        lines.append(f"- torch.set_num_threads({args.threads}): all cores, as vLLM's in-process "
                     "engine leaves torch (its OpenMP binding applies to multiprocess-executor "
                     "workers only).")
    lines += ["", markdown_table(df[list(REPORT_COLUMNS)].map(_fmt)), ""]
    if "flashinfer_attention_ms" in df:
        # Where stock is vLLM's FA3: how far FlashInfer's decode, the stand-in of the runs
        # without vLLM, is from it on the same KV contents (timed in the same ABBA rounds).
        df["fa3_vs_flashinfer"] = df["stock_attention_ms"] / df["flashinfer_attention_ms"]
        lines += ["## Stock's kernel beside FlashInfer's decode", "",
                  markdown_table(df[["shape", "batch", "shared", "stock_attention_ms",
                                     "flashinfer_attention_ms", "fa3_vs_flashinfer",
                                     "custom_attention_ms"]].map(_fmt)), ""]
    if "measured_stock_ms" in df:
        lines += [f"## Predicted vs measured (`bench step`, {args.engine} engine: "
                  f"`{_display_path(args.check)}`)", "",
                  "The measured step also holds what the prediction leaves out (scheduling, "
                  "input preparation, sampling, Python): the residual. The GPU prediction relies "
                  "on the speed-up, not on the absolute step time.", "",
                  markdown_table(df[list(CHECK_COLUMNS)].map(_fmt)), ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    plot(df, out / f"{stem}.png")
    return out / f"{stem}.md"


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(CPU_CHECK.parents[2]))
    except ValueError:
        return str(path)


def plot(df, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(df["shape"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(max(5.0, 0.9 * len(df)), 3.8),
                             squeeze=False)
    bars = [("stock_tpot_ms", "stock (predicted)", "tab:grey", None),
            ("custom_tpot_ms", "CUSTOM (predicted)", "tab:blue", None)]
    if "measured_stock_ms" in df:
        bars += [("measured_stock_ms", "stock (measured)", "white", "tab:grey"),
                 ("measured_custom_ms", "CUSTOM (measured)", "white", "tab:blue")]
    width = 0.8 / len(bars)
    for ax, shape in zip(axes[0], shapes):
        sub = df[df["shape"] == shape].reset_index(drop=True)
        for i, (column, label, color, edge) in enumerate(bars):
            ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in range(len(sub))],
                   sub[column], width, label=label, color=color, edgecolor=edge or color,
                   hatch="//" if edge else None)
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f"B={b}\nshared {s}\nof {n}" for b, s, n in
                            zip(sub["batch"], sub["shared"], sub["prompt"])], fontsize=7)
        ax.set_ylabel("ms per decode step")
        ax.set_title(shape)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench tpot",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--check", type=Path, default=None,
                   help=f"CPU: bench step's JSON whose {{model, batch, shared, private}} points "
                        f"are predicted and compared (default {_display_path(CPU_CHECK)}; "
                        f"'none': use the grid options)")
    p.add_argument("--engine", default="in-process", help="which engine's rows of --check")
    p.add_argument("--shapes", default=None, help=f"model_shapes names (CUDA default "
                                                  f"{CUDA_GRID['shapes']})")
    p.add_argument("--batch", default=CUDA_GRID["batch"])
    p.add_argument("--shared", default=CUDA_GRID["shared"], help="shared prefix lengths")
    p.add_argument("--prompt", type=int, default=CUDA_GRID["prompt"],
                   help="prompt tokens before the private tail (0: the shared length)")
    p.add_argument("--private", type=int, default=CUDA_GRID["private"],
                   help="private tokens after the prompt")
    p.add_argument("--block", type=int, default=None,
                   help=f"KV block size (default: CUDA {CUDA_GRID['block']}, CPU {CPU_BLOCK})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU: torch threads")
    p.add_argument("--reps", type=int, default=7, help="timed repeats of each part")
    p.add_argument("--tol", type=float, default=2e-2, help="ours vs stock agreement first")
    p.add_argument("--out", type=Path, default=None, help="folder for tpot_<device>.{csv,md,png}")
    p.add_argument("--tag", default="", help="file stem suffix: tpot_<device>_<tag>")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    if args.block is None:
        args.block = CUDA_GRID["block"] if args.device == "cuda" else CPU_BLOCK
    measured = None
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        if args.check is None:
            args.check = CPU_CHECK
        if str(args.check) != "none":
            args.dtype, measured = measured_steps(args.check, args.engine)
    elif args.check is not None:
        p.error("--check compares CPU measurements: no measured GPU steps to compare")
    if measured:
        points = sorted(measured, key=lambda q: (q.shape, q.batch, q.shared))
    else:
        points = grid_points((args.shapes or CUDA_GRID["shapes"]).split(","), _ints(args.batch),
                             _ints(args.shared), args.prompt or None, args.private)
    unknown = sorted({q.shape for q in points} - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    timer = Timer(torch.device(args.device))
    bandwidth_gbs = measure_hbm_bandwidth(torch.device(args.device))
    rows = []
    for shape in dict.fromkeys(q.shape for q in points):
        rows += measure_shape(shape, [q for q in points if q.shape == shape], args, timer,
                              bandwidth_gbs)
    if measured:
        add_measured(rows, measured)
    if args.out is not None:
        command = "python -m vllm_chunkattn.bench tpot " + " ".join(
            sys.argv[2:] if argv is None else argv)
        print(write_results(rows, args, command))
    return 0
