"""One vLLM run of the prefix-aware admission workload (a child process of bench/sched.py):
G system prompts, requests arriving interleaved across groups (g0, g1, ..., g0, g1, ...), fewer
slots than requests, so admission order decides who decodes together. Reports (child_process):
output tokens/s and the worker's decode sharing counters (plugin/stats.py).

    python -m vllm_chunkattn.bench.sched_admission MODEL STATS_FILE [key=value ...]
"""
from __future__ import annotations

import json
import random
import sys
import time

from vllm_chunkattn.bench.child_process import report


def main(argv: list[str]) -> None:
    model, stats_file = argv[:2]
    cfg = dict(groups=4, per_group=8, system_len=512, suffix_len=16, out_len=64, max_num_seqs=8)
    cfg.update({k: int(v) for k, v in (a.split("=") for a in argv[2:])})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", attention_backend="CUSTOM", block_size=32,
              max_model_len=2048, enforce_eager=True, kv_cache_memory_bytes=256 << 20, seed=0,
              max_num_seqs=cfg["max_num_seqs"])
    rng = random.Random(0)
    systems = [[rng.randrange(3, 2000) for _ in range(cfg["system_len"])]
               for _ in range(cfg["groups"])]
    prompts = [systems[g] + [rng.randrange(3, 2000) for _ in range(cfg["suffix_len"])]
               for _ in range(cfg["per_group"]) for g in range(cfg["groups"])]
    params = SamplingParams(temperature=0.0, max_tokens=cfg["out_len"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)    # warm-up
    llm.reset_prefix_cache()
    time.sleep(0.5)
    before = json.load(open(stats_file))      # the worker writes after every decode step
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    elapsed = time.perf_counter() - t0
    time.sleep(0.5)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    after = json.load(open(stats_file))
    keys = ("decode_steps", "decode_rows", "kv_tokens", "shared_kv_tokens")
    stats = {k: after[k] - before[k] for k in keys}
    stats["shared_fraction"] = stats["shared_kv_tokens"] / max(stats["kv_tokens"], 1)
    stats["rows_per_decode_step"] = stats["decode_rows"] / max(stats["decode_steps"], 1)
    report({**cfg, "output_tokens": num_out, "seconds": elapsed,
            "output_tok_s": num_out / elapsed, "worker": stats})


if __name__ == "__main__":
    main(sys.argv[1:])
