"""A run of run_on_device.sh, filed: its $OUT folder (copied back from the GPU host) into
benchmarks/results under the GPU's name, and the kernel grid set beside the same GPU kind's
previous run.

  .venv/bin/python benchmarks/gpu/take_results.py <OUT folder> --gpu h100 [--out benchmarks/results]

Each table of results.tar.gz lands as <stem>_<gpu>.<ext> (kernel_cuda_gpu_h100.md, ...). A file of
that name from an earlier run is kept as <stem>_<gpu>_<its commit>.<ext>, and the two kernel grids
are set side by side in kernel_cuda_gpu_<gpu>_runs.md: per point our op and FlashInfer decode in
each run. The two runs are minutes apart on two machines of one kind, not side by side in one run,
so FlashInfer's own change between them is printed as the yardstick: a change of ours well past
FlashInfer's is the kernel's, one within it may be the machine's.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# results.tar.gz path (no extension) -> stem in benchmarks/results (before _<gpu>)
TABLES = {"bench/kernel_cuda_gpu": "kernel_cuda_gpu", "bench/kernel_cuda_goals": "kernel_cuda_goals",
          "bench/kernel_cuda": "kernel_cuda", "bench/tpot_cuda": "tpot_cuda",
          "bench/tpot_cuda_serve": "tpot_cuda_serve", "ncu": "ncu"}
EXTS = (".md", ".csv", ".png")
# `commit 2e01a0f`, or `commit 81f9c98+changes (the tree of 3fbe78e)`: the tree is what ran
COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})(?:\+changes \(the tree of ([0-9a-f]{7,40})\))?")
SUMMARY_COMMIT = re.compile(r"^== summary \([^,]+, ([0-9a-f]{7,40})\)", re.M)


def commit_of(md: Path) -> str | None:
    """The tree a result file was measured on, from its provenance line (`commit 2e01a0f`)."""
    found = COMMIT.search(md.read_text(errors="replace")) if md.exists() else None
    return (found.group(2) or found.group(1))[:7] if found else None


def place(src: Path, dest: Path, old_commit: str | None, moved: list[str]) -> None:
    """src to dest; an earlier dest that differs is kept under its commit first (never over
    another kept file: a second one of that name gets _2, _3, ...)."""
    if dest.exists() and dest.read_bytes() != src.read_bytes():
        base, n = f"{dest.stem}_{old_commit or 'earlier'}", 1
        keep = dest.with_name(base + dest.suffix)
        while keep.exists() and keep.read_bytes() != dest.read_bytes():
            n += 1
            keep = dest.with_name(f"{base}_{n}{dest.suffix}")
        if not keep.exists():
            dest.rename(keep)
            moved.append(f"{dest.name} -> {keep.name}")
    shutil.copyfile(src, dest)


def read_grid(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with path.open(newline="") as f:
        return {(r["grid"], r["point"]): r for r in csv.DictReader(f)}


def number(text: str | None) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value == value and value > 0 else None     # nan / 0: not measured


def ratio(new: float | None, old: float | None) -> float | None:
    return new / old if new is not None and old is not None else None


def runs_table(old_csv: Path, new_csv: Path, old_commit: str, new_commit: str, gpu: str) -> str:
    """The two runs' grids point by point: ours and FlashInfer decode (eager), new / old each."""
    old, new = read_grid(old_csv), read_grid(new_csv)
    fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"       # noqa: E731
    lines = [f"# The kernel grid on the {gpu.upper()}: run {new_commit} against run {old_commit}", "",
             "`benchmarks/gpu/take_results.py`: the two runs' `kernel_cuda_gpu_*.csv`, eager µs (CUDA "
             "events, cold L2, medians). Two runs on two machines of one kind, not one run: "
             "FlashInfer decode's new / old is the yardstick of what the machine alone changed.", "",
             "| grid | point | ours µs old | ours µs new | ours new/old | FI decode µs old | "
             "FI decode µs new | FI new/old | % roofline new |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = {"ours_us": [], "fi_decode_us": []}     # new / old per point, for the medians
    for key, n in new.items():
        if key not in old:
            continue
        cells = [*key]
        for column, column_ratios in ratios.items():
            before, after = number(old[key].get(column)), number(n.get(column))
            r = ratio(after, before)
            if r is not None:
                column_ratios.append(r)
            cells += [fmt(before), fmt(after), fmt(r, 3)]
        lines.append("| " + " | ".join(cells + [fmt(number(n.get("pct_roofline")))]) + " |")
    only = sorted(set(new) ^ set(old))
    median = lambda xs: fmt(statistics.median(xs), 3) if xs else "–"   # noqa: E731
    lines += ["", f"Points in both runs: {len(ratios['ours_us'])}; median new/old: ours "
              f"{median(ratios['ours_us'])}, FlashInfer decode {median(ratios['fi_decode_us'])}."]
    if only:
        lines.append("In one run only: " + ", ".join(f"{g} {p}" for g, p in only) + ".")
    return "\n".join(lines) + "\n"


def take(run_out: Path, gpu: str, out: Path) -> list[str]:
    """Places every table of the run's results.tar.gz; returns what it did, a line each."""
    tarball = run_out / "results.tar.gz"
    if not tarball.is_file():
        raise SystemExit(f"{tarball}: not found (run_on_device.sh's $OUT holds results.tar.gz)")
    summary = run_out / "summary.md"
    found = SUMMARY_COMMIT.search(summary.read_text()) if summary.is_file() else None
    done, moved = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with tarfile.open(tarball) as tar:
            tar.extractall(work, filter="data")
        new_commit = found.group(1)[:7] if found else commit_of(work / "bench/kernel_cuda_gpu.md")
        old_grid, new_grid = out / f"kernel_cuda_gpu_{gpu}.csv", work / "bench/kernel_cuda_gpu.csv"
        old_commit = commit_of(out / f"kernel_cuda_gpu_{gpu}.md")
        runs = None      # the two grids side by side, read before the new one replaces the old
        if old_grid.exists() and new_grid.exists() and new_commit != old_commit:
            runs = runs_table(old_grid, new_grid, old_commit or "earlier", new_commit or "new", gpu)
        for src_stem, stem in TABLES.items():
            earlier = commit_of(out / f"{stem}_{gpu}.md") or old_commit   # before its .md is replaced
            for ext in EXTS:
                src = work / f"{src_stem}{ext}"
                if src.is_file():
                    dest = out / f"{stem}_{gpu}{ext}"
                    place(src, dest, earlier, moved)
                    done.append(f"{src.relative_to(work)} -> {dest.name}")
        micro = {p.stem.removeprefix("microbench_"): json.loads(p.read_text())
                 for p in sorted(work.glob("microbench_*.json"))}
        if micro:
            src = work / "tpp_microbench.json"
            src.write_text(json.dumps(micro, indent=1) + "\n")
            dest = out / f"tpp_microbench_{gpu}.json"
            place(src, dest, old_commit, moved)
            done.append(f"microbench_{{{','.join(micro)}}}.json -> {dest.name}")
        if runs is not None:
            (out / f"kernel_cuda_gpu_{gpu}_runs.md").write_text(runs)
            done.append(f"run against run -> kernel_cuda_gpu_{gpu}_runs.md")
    return done + [f"kept: {m}" for m in moved]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_out", type=Path, help="run_on_device.sh's $OUT folder")
    ap.add_argument("--gpu", required=True, help="the GPU kind's short name: h100, h200")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9]+", a.gpu):
        ap.error(f"--gpu {a.gpu!r}: a short lower-case name such as h100")
    for line in take(a.run_out, a.gpu, a.out):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
