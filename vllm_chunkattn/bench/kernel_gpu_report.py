"""The GPU kernel grid's results: <stem>.csv (every column), <stem>.md (the device, its measured
ceilings, the goals checked against the numbers, one table per grid) and <stem>.png
(one panel per grid: µs per contender and the roofline, log scale)."""
from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from .kernel_trees import ALL_GPU
from .timing import ROUNDS

GRID_TITLES = {
    "paper": "The paper's Table 3 (b = 32, 32/32 heads, d 128, fp16, chunk 64; n_p prompt + 1 new "
             "token per row, the first n_s shared by all)",
    "llama8b": "Llama-3-8B decode (32/8 heads, d 128, bf16, block 16): one prefix of P tokens "
               "shared by all b rows, S private tokens per row",
    "rl": "RL rollouts (Llama-3-8B shape): G prompts x n samples, each prompt shared by its "
          "samples; gen = private generated tokens per sample (+ the new one)",
    "fewshot": "Nested few-shot trees (Llama-3-8B shape): system > few-shot block > question > "
               "samples",
    "smoke": "Smoke points (tiny; a pipeline check, not a benchmark)",
}
TABLE = [("point", "point"), ("rows", "rows"), ("levels", "cascade levels"),
         ("unique_kv_MB", "unique KV MB"), ("roofline_us", "roofline µs"), ("ours_us", "ours µs"),
         ("ours_serial_us", "ours, final not overlapped µs"), ("ours_graph_us", "ours graph µs"), ("ours_vllm_graph_us", "ours vLLM graph µs"),
         ("x_vllm_graph_vs_eager", "eager / vLLM graph"), ("empty_plan_us", "empty plan µs"),
         ("fi_decode_us", "FI decode µs"), ("fi_decode_graph_us", "FI decode graph µs"),
         ("fi_tails_us", "ours + FI tails µs"), ("fi_tails_graph_us", "ours + FI tails graph µs"),
         ("fi_cascade_us", "FI cascade µs"), ("fi_cascade_graph_us", "FI cascade graph µs"),
         ("sdpa_us", "SDPA µs"), ("x_empty_plan", "x empty plan"),
         ("x_fi_decode", "x FI decode"), ("x_fi_decode_graph", "x FI decode (graphs)"),
         ("x_fi_tails", "x ours + FI tails"), ("x_fi_tails_graph", "x ours + FI tails (graphs)"),
         ("x_fi_cascade", "x FI cascade"), ("x_fi_cascade_graph", "x FI cascade (graphs)"),
         ("x_sdpa", "x SDPA"),
         ("pct_roofline", "% roofline"), ("cf_rows", "cf rows/kv head"), ("cf_us", "cf µs"),
         ("cf_TFLOPs", "cf TFLOP/s"), ("cf_pct_peak", "cf % peak")]
CASCADE_LIMITS = """\
What the cascade's levels can and cannot express (`cascade_levels.py`): level k holds each
row's k-th shared node, and its group is the node's sharers. The last level holds each row's
private tail on its own. The levels are positional, so a row with fewer shared nodes than the
deepest row (the `uneven` few-shot point) gets an empty group (0 pages, kv_len 0) at each level
it lacks. That is exact because FlashInfer's FA3 path writes out 0 and lse -inf for kv_len 0,
and the check before timing confirms it on every point (`empty groups` in the CSV). Groups must
be contiguous rows, and the generators emit rows in DFS order of the tree, so no reordering is
timed. Only whole pages are shared, as in our plan. Every level costs one launch over all rows
plus one merge pass. Eager, the cascade also pays each level's launch and output allocation on
the host; `(graphs)` compares replays of captured calls, ours against FlashInfer's, which is how
vLLM runs decode steps and leaves only the GPU work."""


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:g}"
    return str(v)


def _finite(values):
    return [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]


def goal_lines(rows: list[dict]) -> list[str]:
    """The kernel goals, each checked against the rows that define it (absent rows: not run)."""
    def pick(pred):
        return [r for r in rows if pred(r)]

    def check(name, selected, key, bound, worst=min):
        vals = _finite(r.get(key, math.nan) for r in selected)
        if not vals:
            return f"- {name}: not measured in this run"
        got = worst(vals)
        ok = got >= bound
        return (f"- {name}: {'met' if ok else 'NOT met'}, worst {got:g} over {len(vals)} "
                f"point(s) (goal >= {bound:g})")
    anchor = pick(lambda r: r["grid"] == "paper" and r["point"] == "n_p=4096 n_s=4096")
    trees = pick(lambda r: r["grid"] in ("rl", "fewshot"))
    single = pick(lambda r: r["grid"] in ("paper", "llama8b") and r["nodes"] == 1)
    nothing = pick(lambda r: r["grid"] in ("paper", "llama8b") and r["nodes"] == 0)
    bound = pick(lambda r: r["cf_rows"] >= 256)
    return [
        check("% of the HBM roofline at the paper shape n_s = n_p = 4096", anchor,
              "pct_roofline", 70),
        check("speed-up over our own empty-plan paged decode there", anchor, "x_empty_plan", 20),
        check("speed-up over FlashInfer cascade on the tree batches (rl, fewshot)", trees,
              "x_fi_cascade", 1.3),
        check("  the same, CUDA-graph replays on both sides", trees, "x_fi_cascade_graph", 1.3),
        check("speed-up over FlashInfer cascade with one shared prefix", single, "x_fi_cascade",
              1.0),
        check("  the same, CUDA-graph replays on both sides", single, "x_fi_cascade_graph", 1.0),
        check("speed-up over FlashInfer decode with nothing shared", nothing, "x_fi_decode", 0.95),
        check("  the same, CUDA-graph replays on both sides", nothing, "x_fi_decode_graph", 0.95),
        check("graph replay as vLLM captures it (capacity-padded plan) vs eager, every point",
              rows, "x_vllm_graph_vs_eager", 1.0),
        check("chunk-first % of the measured GEMM peak when compute-bound (rows/kv head >= 256)",
              bound, "cf_pct_peak", 50),
    ]


# Each sweep: its row column, section title, what it says, what the rows forced, and for a
# two-way sweep its (default, other) keys: the section then closes with the default's µs over
# the other's at each point, their median: the other's speed-up, what decides whether it
# becomes the default.
SWEEPS = (
    ("split_sweep_us", "Chunk-first KV splits: the op's choice against forced counts",
     "The host code (csrc/cuda/tpp_host.h, make_tpp_work) picks the fewest splits that "
     "fill the partial launch's waves of resident CTAs within 85 % of the best count. "
     "Here our op (eager) is also timed with CHUNKATTN_CHUNK_SPLITS forced, in a "
     "workspace with room for 16 splits; a forced count well under the choice's µs "
     "means the rule misjudges this device.",
     "forced splits", None),
    ("tail_sweep_us", "Private-tail KV splits: the op's choice against forced counts",
     "With nothing shared the private tails are the whole decode: split 0 of each runs in the "
     "final launch, splits 1.. in the partial one. The host code picks the tails' splits by "
     "the same wave rule; here our op (eager) is also timed with CHUNKATTN_SEQ_SPLITS forced "
     "(up to 9: the workspace's spare rows).",
     "forced splits", None),
    ("final_sweep_us", "Final launch's KV stage: 32 tokens (default) against 64",
     "The final launch streams its private tails in smem stages of 32 tokens (40 KB of smem at "
     "head 128, 128 registers: 4 CTAs an SM, half the warps splitting a stage); "
     "CHUNKATTN_FINAL_STAGE_TOKENS=64 takes the partial launch's 64 at head <= 128 (73 KB: 3 CTAs "
     "an SM). Both timed side by side (eager); the forced counts below are the stage sizes.",
     "stage tokens", ("32", "64")),
    ("partial_sweep_us", "Partial launch's KV stage: 64 tokens (default) against 32",
     "The partial launch (the chunk-first items and the tails' splits 1..) streams its KV in smem "
     "stages of 64 tokens at head <= 128 (86 KB of smem at head 128, 226-242 registers: 2 CTAs "
     "an SM); CHUNKATTN_PARTIAL_STAGE_TOKENS=32 stages 32 (53 KB, 168 registers: 3 CTAs an SM, "
     "twice the stage barriers and rescales a token). Both timed side by side (eager): the whole "
     "op at each stage size, then, on CUDA, its chunk-first launch alone (the torch profiler's "
     "kernel time, tails unsplit).",
     "stage tokens", ("64", "32")),
    ("kv_sweep_us", "KV loads' addresses: one 32-bit offset (default) against 64-bit ones",
     "Each KV token a stage loads takes one int32 offset for K and V where their strides are "
     "equal and every offset fits (vLLM's flash layout; csrc/cuda/tpp_attend_tile.cuh, "
     "load_kv_stage), or two 64-bit ones (CHUNKATTN_KV_OFFSETS_I64=1). Both timed side by side "
     "(eager); i64 / i32 below are the two paths.",
     "address path", ("i32", "i64")),
)


def sweep_times(cell: str) -> dict[str, float]:
    """A sweep cell, "64: 41.2; 32: 38.0; chunk-first 64: 20.1", as {"64": 41.2, ...}."""
    return {k: float(v) for k, v in (part.rsplit(": ", 1) for part in cell.split("; "))}


def speedup_line(swept: list[dict], column: str, default: str, other: str, what: str) -> str:
    ratios = []
    for r in swept:
        t = sweep_times(r[column])
        if t.get(default, 0) > 0 and t.get(other, 0) > 0:
            ratios.append(t[default] / t[other])
    if not ratios:
        return f"- {what}: not timed"
    return (f"- {what}, µs at {default} / µs at {other}: median "
            f"**{statistics.median(ratios):.3f}x** at {len(ratios)} points "
            f"({min(ratios):.3f}-{max(ratios):.3f}x; above 1: {other} is faster)")


def split_sweep_lines(rows: list[dict]) -> list[str]:
    lines = []
    for column, title, text, forced, two_way in SWEEPS:
        swept = [r for r in rows if r.get(column)]
        if not swept:
            continue
        lines += [f"## {title}", "", text, "",
                  *[f"- {r['grid']} {r['point']}: the op's choice {_fmt(r['ours_us'])} µs; "
                    f"{forced}: µs {r[column]}" for r in swept], ""]
        if two_way:
            default, other = two_way
            lines.append(speedup_line(swept, column, default, other, "the whole op"))
            if column == "partial_sweep_us":
                lines.append(speedup_line(swept, column, f"chunk-first {default}",
                                          f"chunk-first {other}", "its chunk-first launch alone"))
            lines.append("")
    return lines


def tails_lines(rows: list[dict]) -> list[str]:
    """ours / (ours + FI tails): whether the private tails are better left to FlashInfer."""
    pairs = sorted((r["ours_us"] / r["fi_tails_us"], f"{r['grid']} {r['point']}") for r in rows
                   if len(_finite([r.get("fi_tails_us", math.nan), r["ours_us"]])) == 2
                   and r["fi_tails_us"] > 0)
    if not pairs:
        return []
    better = [p for p in pairs if p[0] > 1]
    return ["## The private tails left to FlashInfer", "",
            "`ours + FI tails`: our op over the shared nodes only, FlashInfer batch decode over "
            "each row's private tail (with its LSE), FlashInfer's merge_state; what the backend "
            "would do if it handed the tails to the engine's own decode kernel. Ours / that, "
            f"eager, over {len(pairs)} points: median {statistics.median(p for p, _ in pairs):.2f}, "
            f"lowest {pairs[0][0]:.2f} ({pairs[0][1]}), highest {pairs[-1][0]:.2f} "
            f"({pairs[-1][1]}); above 1 (the tails faster left to FlashInfer) at {len(better)} "
            "points" + (": " + ", ".join(f"{n} {p:.2f}" for p, n in better[-8:]) if better
                        else "") + ".", ""]


def overlap_lines(rows: list[dict], overlap_knob: str = "") -> list[str]:
    """ours_serial / ours: what overlapping the final launch with the partial one gives.
    overlap_knob: CHUNKATTN_OVERLAP_FINAL as the run found it ("0": both columns are serial)."""
    gain = sorted((r["ours_serial_us"] / r["ours_us"], f"{r['grid']} {r['point']}") for r in rows
                  if len(_finite([r.get("ours_serial_us", math.nan), r["ours_us"]])) == 2
                  and r["ours_us"] > 0)
    if not gain:
        return []
    return ["## The final launch beside the partial one", "",
            "On sm_90+ the op launches its final kernel (split 0 of each private tail, then the "
            "merge) as a programmatic dependent of the partial kernel: its CTAs start on the SMs "
            "the partial launch leaves idle and wait for the partial grid only before merging. "
            "`ours, final not overlapped` is the same op with CHUNKATTN_OVERLAP_FINAL=0. "
            f"Not overlapped / overlapped over {len(gain)} points: median "
            f"{statistics.median(g for g, _ in gain):.2f}, lowest {gain[0][0]:.2f} "
            f"({gain[0][1]}), highest {gain[-1][0]:.2f} ({gain[-1][1]}). Below 1 the overlap "
            "costs time at that point." + (
                " **This run had CHUNKATTN_OVERLAP_FINAL=0 in its environment** (run_on_device.sh "
                "turns it off when the GPU tests fail only with the overlap on): `ours` is the "
                "serial launch too, and these ratios measure nothing." if overlap_knob == "0"
                else ""), ""]


def disagreement_lines(rows: list[dict]) -> list[str]:
    bad = [r["point"] for r in rows if not r["ours_ok"]]
    if not bad:
        return []
    return [f"**Our op disagreed with the reference on: {bad}** (not timed there).", ""]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# TPP decode on tree batches vs FlashInfer: {meta['device']}", "",
             f"Command: `{meta['command']}`  ", f"Device: {meta['device']}; torch {meta['torch']}; "
             f"flashinfer {meta['flashinfer']}; commit {meta['commit']}; "
             f"wall {meta.get('wall_s', '?')} s", "",
             f"Measured once in this run: HBM bandwidth {meta['hbm_GBs']} GB/s (a "
             f"{meta['copy_MiB']} MiB device-to-device copy, read + write bytes / time, median); "
             f"dense {meta['gemm_n']}^3 torch.matmul "
             f"{meta['gemm_TFLOPs_bfloat16']} TFLOP/s bf16, {meta['gemm_TFLOPs_float16']} "
             f"TFLOP/s fp16.", "",
             *disagreement_lines(rows),
             "## Goals", "", *goal_lines(rows), "", *split_sweep_lines(rows),
             *overlap_lines(rows, meta.get("overlap_final", "")), *tails_lines(rows),
             "## Method", "",
             f"One layer, one decode step. Times are µs, the median of up to {meta['reps']} "
             "repeats after a warm-up, each timed with CUDA events after a 256 MB write that "
             "flushes L2 (on a CPU, smoke only: wall clock). Every contender of a point, and "
             "ours under each knob below, is timed side by side with the others in "
             f"{ROUNDS} rounds whose order reverses every round (ABBA), so a ratio does not "
             "also measure the device drifting between two contenders' turns. `ours` is our "
             "op as a layer calls it (TppLaunch built beforehand). "
             "`ours graph` replays the same call from a CUDA graph. `ours vLLM graph` replays "
             "it as vLLM's FULL decode graphs run it: the plan padded to the batch size's "
             "capacity (plan/capacity.py; pruned where the tree exceeds it), no split spares in "
             "the workspace; `eager / vLLM graph` = ours µs / ours vLLM graph µs. `empty plan` is our op with "
             "no plan (paged decode, no prefix awareness). `FI decode` is FlashInfer "
             "BatchDecodeWithPagedKVCacheWrapper. `FI cascade` is FlashInfer "
             "MultiLevelCascadeAttentionWrapper with one level per tree depth plus the private "
             "level. `graph` columns replay the same call from a CUDA graph captured after its "
             "plan; `x ... (graphs)` = baseline graph µs / ours graph µs. `SDPA` is torch SDPA per sequence (only up to 32 rows). All of them read "
             "the same KV pool: FlashInfer's NHD pages, with our op reading the K and V halves "
             "in place. Before timing, every output is checked against an fp32 per-sequence "
             f"reference that knows nothing of the tree (atol = rtol = {meta['tol']}). A "
             "contender that disagrees is shown as n/a, with the reason in the notes. "
             "x <baseline> = baseline µs / ours µs.", "",
             "- unique KV MB: each KV token of the batch counted once (the sum over distinct "
             "blocks of the tokens used, i.e. P + B*S for one prefix), x 2 (K, V) x kv heads x "
             "head size x dtype bytes. roofline µs = unique bytes / measured HBM bandwidth; "
             "% roofline = roofline µs / ours µs.",
             "- cf (chunk-first): the shared nodes' work, 4 x sharers x node tokens x q heads x "
             "head size FLOPs summed over nodes. cf µs is the kernel time of tpp_partial_kernel "
             "under the torch profiler with CHUNKATTN_SEQ_SPLITS=1, which leaves that launch "
             "only the chunk-first CTAs (same flush, median). cf % peak is relative to the "
             "measured GEMM peak of the point's dtype. cf rows/kv head = the widest node's "
             "sharers x q heads per kv head, the height of its GEMMs. The goal's "
             "'G·n·GQA rows >= 256' is read per node (n·GQA for a rollout group): a node's KV is "
             "read once for its own sharers only, so its FLOPs per byte grow with its own rows, "
             "not with G.", "",
             CASCADE_LIMITS, ""]
    for grid in [g for g in (*ALL_GPU, "smoke") if any(r["grid"] == g for r in rows)]:
        sub = [r for r in rows if r["grid"] == grid]
        lines += [f"## {grid}: {GRID_TITLES[grid]}", "", f"Shape: {sub[0]['shape']}", "",
                  "| " + " | ".join(title for _, title in TABLE) + " |",
                  "|" + "|".join("---" for _ in TABLE) + "|"]
        lines += ["| " + " | ".join(_fmt(r[key]) for key, _ in TABLE) + " |" for r in sub]
        notes = [f"- {r['point']} ({r['tree']}): {r['notes']}" for r in sub if r["notes"]]
        lines += ["", *(["Notes:", *notes, ""] if notes else [])]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grids = [g for g in (*ALL_GPU, "smoke") if any(r["grid"] == g for r in rows)]
    fig, axes = plt.subplots(1, len(grids), figsize=(6 * len(grids), 5.5), squeeze=False)
    series = [("ours_us", "ours", "o-"), ("ours_graph_us", "ours graph", "o:"),
              ("ours_vllm_graph_us", "ours vLLM graph", "o--"),
              ("empty_plan_us", "empty plan", "s-"), ("fi_decode_us", "FI decode", "^-"),
              ("fi_decode_graph_us", "FI decode graph", "^:"),
              ("fi_tails_us", "ours + FI tails", "d-"),
              ("fi_cascade_us", "FI cascade", "v-"),
              ("fi_cascade_graph_us", "FI cascade graph", "v:"), ("sdpa_us", "SDPA", "x-"),
              ("roofline_us", "HBM roofline", "k--")]
    for ax, grid in zip(axes[0], grids):
        sub = [r for r in rows if r["grid"] == grid]
        x = list(range(len(sub)))
        for key, label, style in series:
            ys = [r[key] for r in sub]
            if _finite(ys):
                ax.plot(x, ys, style, label=label, ms=4, lw=1)
        ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([r["point"] for r in sub], rotation=90, fontsize=6)
        ax.set_ylabel("µs per layer (median, cold L2)")
        ax.set_title(f"{grid}: {sub[0]['shape']}", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"TPP decode vs FlashInfer\n{meta['device']}, HBM {meta['hbm_GBs']} GB/s "
                 f"measured", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(rows: list[dict], meta: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / f"{stem}.md").write_text(markdown(rows, meta))
    plot(rows, meta, out_dir / f"{stem}.png")
