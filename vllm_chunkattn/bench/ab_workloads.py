"""Workloads for `python -m vllm_chunkattn.bench ab`: each is a set of `vllm bench serve` flags.

Everything goes through vLLM's own client and datasets:
- one shared prefix (0 / 1024 / 2048 tokens) with private 64-256 and output 128-512 tokens:
  `random --random-prefix-len P --random-input-len 160 --random-output-len 320
  --random-range-ratio 0.6` (lengths drawn uniformly in [0.4x, 1.6x]);
- several distinct prefixes: `prefix_repetition` (it takes fixed lengths, so the private part is
  160 and the output 320 tokens, the means of the ranges above);
- the request-rate sweep (paper Fig. 5): the `random` workload with `--request-rate R` (Poisson);
- n > 1: `random` with `--extra-body '{"n": 4}'` (the client has no `--n`; the completions API
  takes `n` and the client forwards extra-body keys into every request);
- a tree of nested prefixes: `custom` over a JSONL file made here (system prompt -> document ->
  question), since no built-in dataset nests prefixes.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# Private/output lengths around these means, +-60 %: 64-256 private, 128-512 output.
PRIVATE_MEAN, OUTPUT_MEAN, RANGE = 160, 320, 0.6


@dataclass
class Workload:
    name: str
    group: str                      # shared | prefixes | sweep | n | tree (report sections)
    bench_args: list[str]           # `vllm bench serve` flags (dataset, lengths, rate)
    num_prompts: int
    shared_len: int = 0             # tokens shared per prefix group (for the report)
    num_prefixes: int = 1
    request_rate: float = float("inf")
    n: int = 1
    tree: dict | None = None        # parameters of the nested-prefix JSONL (custom dataset)
    meta: dict = field(default_factory=dict)


def shared_prefix(p: int, num_prompts: int, rate: float = float("inf"), name: str | None = None,
                  group: str = "shared", out_mean: int = OUTPUT_MEAN) -> Workload:
    args = ["--dataset-name", "random", "--random-prefix-len", str(p),
            "--random-input-len", str(PRIVATE_MEAN), "--random-output-len", str(out_mean),
            "--random-range-ratio", str(RANGE)]
    return Workload(name or f"shared{p}", group, args, num_prompts, shared_len=p,
                    request_rate=rate)


def distinct_prefixes(p: int, k: int, num_prompts: int, out_len: int = OUTPUT_MEAN) -> Workload:
    args = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(p),
            "--prefix-repetition-suffix-len", str(PRIVATE_MEAN),
            "--prefix-repetition-num-prefixes", str(k),
            "--prefix-repetition-output-len", str(out_len)]
    return Workload(f"shared{p}-x{k}prefixes", "prefixes", args, num_prompts, shared_len=p,
                    num_prefixes=k)


def n_sampling(prompt_len: int, n: int, num_prompts: int, out_mean: int = OUTPUT_MEAN) -> Workload:
    # The whole prompt is shared by the n sequences of a request; sampled (temperature 1) so
    # the n continuations differ, as they would in practice. No per-request "seed": vLLM 0.32's
    # CPU sampler fails on seeded requests ("CPU Generator does not use offset").
    args = ["--dataset-name", "random", "--random-prefix-len", "0",
            "--random-input-len", str(prompt_len), "--random-output-len", str(out_mean),
            "--random-range-ratio", json.dumps({"input": 0.0, "output": RANGE}),
            "--extra-body", json.dumps({"n": n, "temperature": 1.0})]
    return Workload(f"n{n}-prompt{prompt_len}", "n", args, num_prompts, shared_len=prompt_len,
                    num_prefixes=num_prompts, n=n)


def tree(system_len: int, docs: int, doc_len: int, questions: int, num_prompts: int | None = None,
         out_mean: int = OUTPUT_MEAN) -> Workload:
    total = docs * questions
    t = dict(system_len=system_len, docs=docs, doc_len=doc_len, questions=questions)
    # --custom-output-len -1: take each line's own output_tokens (128-512).
    args = ["--dataset-name", "custom", "--skip-chat-template", "--custom-output-len", "-1"]
    return Workload(f"tree{system_len}+{docs}x{doc_len}", "tree", args, num_prompts or total,
                    shared_len=system_len + doc_len, num_prefixes=docs, tree=t,
                    meta={"out_mean": out_mean})


def write_tree_jsonl(w: Workload, path: Path, words: list[str], seed: int = 0) -> Path:
    """system prompt -> `docs` documents -> `questions` questions each: prefixes nest two deep.

    Words from a plain English list: one token each with the tiny model's word-level tokenizer,
    about one token each with a BPE tokenizer (lengths are then approximate)."""
    rng = random.Random(seed)
    t = w.tree

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    lo, hi = int(PRIVATE_MEAN * (1 - RANGE)), int(PRIVATE_MEAN * (1 + RANGE))
    out_mean = w.meta.get("out_mean", OUTPUT_MEAN)
    olo, ohi = int(out_mean * (1 - RANGE)), int(out_mean * (1 + RANGE))
    system = text(t["system_len"])
    with open(path, "w") as f:
        for _ in range(t["docs"]):
            doc = text(t["doc_len"])
            for _ in range(t["questions"]):
                f.write(json.dumps({"prompt": f"{system} {doc} {text(rng.randint(lo, hi))}",
                                    "output_tokens": rng.randint(olo, ohi)}) + "\n")
    return path


def full_workloads() -> list[Workload]:
    """The committed CPU run (2 cores, tiny model): request counts scaled so three servers'
    worth of runs fit in ~25 minutes; lengths are the full-size ones the goals name."""
    ws = [shared_prefix(p, 32) for p in (0, 1024, 2048)]
    ws += [distinct_prefixes(p, k, 32) for p in (1024, 2048) for k in (4, 16)]
    # Sweep: shorter outputs (51-205, mean 128) and 24 prompts a point so 12 points per system
    # fit; the rates straddle the tiny model's saturation on 2 cores (~4-8 req/s at 128 tokens).
    ws += [shared_prefix(p, 24, rate=r, name=f"sweep{p}@{r:g}rps", group="sweep", out_mean=128)
           for p in (0, 1024, 2048) for r in (2, 4, 8, 16)]
    ws.append(n_sampling(1024, 4, 8))
    ws.append(tree(1024, 4, 512, 4))
    return ws


def smoke_workloads() -> list[Workload]:
    """CI: tiny versions that still touch both dataset kinds and a shared prefix."""
    return [shared_prefix(0, 4, out_mean=16), shared_prefix(1024, 4, out_mean=16)]
