"""The report of `python -m vllm_chunkattn.bench offline`: its rows as CSV, a markdown table with
the run's setup, and a bar chart."""
from __future__ import annotations

import csv
import math
from pathlib import Path

from vllm_chunkattn.bench.token_identity import TOP_K

SYSTEMS = ("stock", "custom")
COLUMNS = ["workload", "shared_len", "private_len", "prompt_len", "batch", "max_tokens", "system",
           "median_tok_s", "best_tok_s", "median_step_ms", "best_step_ms", "ratio_custom_stock",
           "cached_prompt_pct", "mismatched_requests", "max_logprob_diff", "max_tie_gap",
           "draft_tokens", "accepted_tokens", "seconds"]


def shared_cost_removed(rows: list[dict]) -> list[tuple[int, float]]:
    """(S, share) for each S > 0: (TPOT_stock(S) - TPOT_custom(S)) / (TPOT_stock(S) -
    TPOT_stock(0)), median step times; needs the shared-0 workload at the same private length."""
    step = {(r["shared_len"], r["system"]): r["median_step_ms"] for r in rows}
    if (0, "stock") not in step:
        return []
    out = []
    for s in sorted({r["shared_len"] for r in rows if r["shared_len"] > 0}):
        extra = step[(s, "stock")] - step[(0, "stock")]
        out.append((s, (step[(s, "stock")] - step[(s, "custom")]) / extra if extra > 0
                    else math.nan))
    return out


# ---- report

def write_report(rows: list[dict], setup: dict, out: Path, tag: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"offline_{tag}"
    with open(f"{stem}.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in rows:
            wr.writerow({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()})
    m = setup["model"]
    lines = [f"# Offline A/B: stock vLLM vs `attention_backend=\"CUSTOM\"` ({tag})", "",
             f"Command: `{setup['command']}`", "",
             f"- machine: {setup['machine']}; load average (1/5/15 min) before "
             f"{setup['load_before']}, after {setup['load_after']}",
             f"- model: `{m['path']}` ({m['architecture']}, {m['num_layers']} layers, "
             f"{m['num_heads']} q / {m['num_kv_heads']} kv heads, head_dim {m['head_size']})"
             f"{', dummy weights' if setup['dummy'] else ''}; dtype {setup['dtype']}, "
             f"block size {setup['block_size']}, enforce_eager {setup['enforce_eager']}, "
             f"{setup['kv_space']} per engine"
             + (f"; speculative decoding `{setup['speculative_config']}` on both"
                if setup.get("speculative_config") else ""),
             f"- commit {setup['commit']}, {setup['native']}, {setup['date']}, "
             f"wall {setup['wall_min']:.1f} min; engine logs in `{setup['log_dir']}`",
             "- engines (seconds from the run's start): " + "; ".join(
                 f"{s} started at {t0:.1f}, ready at {ready:.1f}"
                 for s, (t0, ready) in setup["engine_starts"].items()), "",
             f"Each timed call is one `LLM.generate` of the whole batch (greedy, ignore_eos) after "
             f"both engines prefilled and cached every prompt: one 1-token-per-request prefill "
             f"step + {setup['max_tokens'] - 1} decode steps. Order A B B A x {setup['repeats']}. "
             f"tok/s = batch x max_tokens / seconds; step = seconds / max_tokens. Cached % is the "
             f"share of prompt tokens the timed call found in the prefix cache. Mismatched = "
             f"requests whose greedy token ids differ between the systems. From one more "
             f"untimed call per system with top-{TOP_K} logprobs: max |Δ logprob| of the sampled "
             f"token while both saw the same context, and, where tokens differ, the tie gap "
             f"at the first divergence: how much each system preferred its own token (near 0: "
             f"a rounding tie; inf: the other's token not in its top {TOP_K}).", "",
             "| workload | prompt (shared + private) | batch | stock tok/s med / best | "
             "custom tok/s med / best | custom / stock | stock step ms | custom step ms | "
             "cached % stock / custom | mismatched | max \\|Δ logprob\\| | tie gap |",
             "|" + "---|" * 12]
    by = {(r["workload"], r["system"]): r for r in rows}
    for name in dict.fromkeys(r["workload"] for r in rows):
        st, cu = by[(name, "stock")], by[(name, "custom")]
        lines.append(
            f"| {name} | {st['prompt_len']} ({st['shared_len']} + {st['private_len']}) | "
            f"{st['batch']} | {st['median_tok_s']:.1f} / {st['best_tok_s']:.1f} | "
            f"{cu['median_tok_s']:.1f} / {cu['best_tok_s']:.1f} | "
            f"{st['ratio_custom_stock']:.2f}× | {st['median_step_ms']:.1f} | "
            f"{cu['median_step_ms']:.1f} | {st['cached_prompt_pct']:.1f} / "
            f"{cu['cached_prompt_pct']:.1f} | {st['mismatched_requests']} / {st['batch']} | "
            f"{st['max_logprob_diff']:.2g} | {st['max_tie_gap']:.3g} |")
    if setup.get("speculative_config"):
        lines += ["", "Draft tokens verified / accepted over the timed calls (vLLM's "
                  "spec-decode counters): " + "; ".join(
                      f"{name}: stock {by[(name, 'stock')]['draft_tokens']} / "
                      f"{by[(name, 'stock')]['accepted_tokens']}, custom "
                      f"{by[(name, 'custom')]['draft_tokens']} / "
                      f"{by[(name, 'custom')]['accepted_tokens']}"
                      for name in dict.fromkeys(r["workload"] for r in rows)) + "."]
    for s, share in shared_cost_removed(rows):
        lines += ["", f"Share of the shared-prefix attention cost removed at S = {s}: "
                  f"(TPOT_stock({s}) - TPOT_custom({s})) / (TPOT_stock({s}) - TPOT_stock(0)) = "
                  f"**{share:.2f}** (median step times)."]
    png = Path(f"{stem}.png")
    _plot(rows, png)
    lines += ["", f"![tok/s per workload]({png.name})"]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    return [Path(f"{stem}.csv"), Path(f"{stem}.md"), png]


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 3.4))
    for i, s in enumerate(SYSTEMS):
        vals = [next(r["median_tok_s"] for r in rows if r["workload"] == n and r["system"] == s)
                for n in names]
        ax.bar([j + (i - 0.5) * 0.38 for j in range(len(names))], vals, 0.38, label=s)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode output tok/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
