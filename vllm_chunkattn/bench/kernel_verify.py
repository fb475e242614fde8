"""python -m vllm_chunkattn.bench verify: one layer's attention over speculative decoding's verify
rows, our TPP kernel against vLLM's CPU_ATTN on the same KV, for k = 0..4 draft tokens a row.

Every row holds n_p prompt tokens and 1 + k query tokens (the last token sampled and k drafts,
causal among them); the first n_s tokens are one prefix shared by all b rows. Ours runs the query
rows of the step's plan (plan/query_rows.py: a shared chunk read once for every query token of
every sharer, a row's own full chunks once for its k + 1 tokens); CPU_ATTN gets the rows as vLLM
hands them to it (query_start_loc with k + 1 tokens a row, causal). Outputs are checked equal
before timing; the contenders are timed side by side (ABBA).

    python -m vllm_chunkattn.bench verify --out benchmarks/results
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..kv_layout import block_size_of
from ..ops import cpu_kv_layout
from ..plan import PlanCache, query_rows
from .contenders import cpu_attn, host_ms, machine, ours, vllm_cpu_isa
from .kernel import markdown_table
from .kv_pool import Batch, KvPool
from .timing import Timer


def verify_batch(pool: KvPool, n_p: int, n_s: int, b: int, k: int, num_heads: int
                 ) -> tuple[Batch, torch.Tensor]:
    """b rows of n_p + 1 + k tokens (n_s shared), each with its 1 + k last tokens as queries:
    the batch (its query [b * (1 + k), heads, head]) and query_start_loc."""
    bt = pool.batch(n_p + k, n_s, b, num_heads, seed=n_p + b + k)
    q = 1 + k
    g = torch.Generator().manual_seed(k)
    query = torch.randn(b * q, num_heads, bt.query.shape[2], generator=g).to(bt.query.dtype)
    bt.query = query
    return bt, torch.arange(b + 1, dtype=torch.int32) * q


def query_row_batch(bt: Batch, qsl: torch.Tensor) -> Batch:
    """The batch as TPP runs it: one row per query token (plan/query_rows.py)."""
    row_of_token, token_lens = query_rows(qsl.numpy(), bt.seq_lens.numpy())
    return replace(bt, block_table=bt.block_table.index_select(0, torch.from_numpy(row_of_token)),
                   seq_lens=torch.from_numpy(token_lens.astype(np.int32)))


def plan_step(bt: Batch, qsl: torch.Tensor):
    """The step's host work for ours, as the backend does it: the query rows' plan from a
    PlanCache that has not seen these rows."""
    table, lens = bt.block_table.numpy(), bt.seq_lens.numpy()
    return lambda: PlanCache(block_size_of(bt.key_cache)).get(table, lens, query_start_loc=qsl.numpy())


def run_grid(a) -> list[dict]:
    dtype = getattr(torch, a.dtype)
    hq, hkv = a.heads
    timer = Timer(torch.device("cpu"))
    rows = []
    for block in a.block:
        isa = vllm_cpu_isa(dtype, block, a.head_size)
        layout = cpu_kv_layout(isa, a.head_size, dtype)
        per_row = -(-(a.n_p + 1 + max(a.k)) // block)
        pool = KvPool(a.b * per_row + 1, block, hkv, a.head_size, dtype, "cpu", layout)
        for share, k in itertools.product(a.share, a.k):
            n_s = int(a.n_p * share) // block * block
            bt, qsl = verify_batch(pool, a.n_p, n_s, a.b, k, hq)
            step = plan_step(bt, qsl)
            contenders = {"ours": ours(query_row_batch(bt, qsl), step()),
                          "cpu_attn": cpu_attn(bt, isa, query_start_loc=qsl)}
            plan_ms = host_ms(step, a.reps)
            if isa != "amx" or layout == "cpu_attn_amx":   # else timed on the same bytes only
                torch.testing.assert_close(contenders["ours"]().float(),
                                           contenders["cpu_attn"]().float(), atol=a.tol,
                                           rtol=a.tol)
            times = timer.side_by_side(contenders, a.reps)
            row = dict(n_p=a.n_p, n_s=n_s, b=a.b, k=k, query_tokens=a.b * (1 + k),
                       heads=f"{hq}/{hkv}", head_size=a.head_size, block=block, dtype=a.dtype,
                       baseline_isa=isa, cpu_attn_ms=round(times["cpu_attn"], 3),
                       ours_ms=round(times["ours"], 3), plan_ms=round(plan_ms, 3))
            row["ours_vs_cpu_attn"] = round(row["cpu_attn_ms"] / row["ours_ms"], 2)
            row["us_per_query_token"] = round(1e3 * row["ours_ms"] / row["query_tokens"], 1)
            rows.append(row)
            print(" ".join(f"{key}={v}" for key, v in row.items()), flush=True)
        del pool
    return rows


def write_results(rows: list[dict], a, command: str) -> Path:
    import pandas as pd
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"kernel_cpu_verify{'_fp32' if a.dtype == 'float32' else ''}"
    df = pd.DataFrame(rows)
    df.to_csv(f"{stem}.csv", index=False)
    lines = [f"# TPP decode kernel on verify rows vs CPU_ATTN ({a.dtype})", "",
             f"Command: `{command}`", "", f"Machine: {machine()}", "",
             "One layer, one step of speculative decoding: b rows of n_p prompt tokens, each "
             "verifying k draft tokens (k + 1 query tokens, causal among them); the first n_s "
             "tokens shared by all rows. Times are medians in ms after a warm-up, the "
             "contenders timed side by side in rounds whose order reverses every round; "
             f"outputs checked equal (atol = rtol = {a.tol}) before timing. k = 0 is a plain "
             "decode step. plan_ms: the step's host work for ours, once for all layers "
             "(the request rows' plan, expanded to query rows).", "", markdown_table(df)]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    _plot(df, Path(f"{stem}.png"))
    return Path(f"{stem}.md")


def _plot(df, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    blocks = sorted(df["block"].unique())
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.2 * len(blocks), 3.4), squeeze=False)
    for ax, block in zip(axes[0], blocks):
        sub = df[df["block"] == block]
        for n_s, grp in sub.groupby("n_s"):
            ax.plot(grp["k"], grp["ours_vs_cpu_attn"], marker="o", label=f"n_s={n_s}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"block {block}")
        ax.set_xlabel("draft tokens k per row")
        ax.set_ylabel("speed-up vs CPU_ATTN")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench verify",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument("--n-p", type=int, default=2048)
    p.add_argument("--b", type=int, default=32)
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3, 4])
    p.add_argument("--share", type=lambda s: [float(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split("/")), default=(32, 8),
                   help="query / KV heads")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    command = "python -m vllm_chunkattn.bench verify " + " ".join(
        sys.argv[2:] if argv is None else argv)
    rows = run_grid(a)
    if a.out is not None:
        print(f"verify: report {write_results(rows, a, command)}")
    return 0
