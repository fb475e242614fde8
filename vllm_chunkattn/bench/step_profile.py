"""`python -m vllm_chunkattn.bench step`: where one decode step's time goes, stock vs CUSTOM.

For each system × shared-prefix length, a child process builds `LLM` (dummy weights), caches
the batch's prompts, then times `LLM.generate` of `--steps` tokens under the torch profiler and
reports ms per step and the attention op's share of CPU time. `--engine` picks vLLM's default
multiprocess engine (EngineCore in its own process) or the in-process one
(VLLM_ENABLE_V1_MULTIPROCESSING=0; the profiler then sees the model's ops): the two side by side
show what the engine's process split costs on a small CPU, apart from attention.

    python -m vllm_chunkattn.bench step --model models/llama-3.2-1b
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vllm_chunkattn.bench import child_process, provenance

ATTENTION_OPS = ("chunkattn::tpp_decode", "_C::cpu_attention_with_kv_cache")


def child(job: dict) -> dict:
    """One engine, one measurement (runs in its own process)."""
    import random

    import torch
    from vllm import LLM, SamplingParams
    kw = dict(model=job["model"], load_format="dummy", dtype=job["dtype"], block_size=64,
              max_model_len=4096, kv_cache_memory_bytes=1 << 30, enforce_eager=True, seed=0)
    if job["system"] == "custom":
        kw["attention_backend"] = "CUSTOM"
    llm = LLM(**kw)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 30000) for _ in range(job["shared"])]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(10, 30000)
                                              for _ in range(job["private"])]}
               for _ in range(job["batch"])]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    params = SamplingParams(max_tokens=job["steps"], temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)          # warm-up, prompts cached
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values()) or 1.0
    attention = sum(ops.get(k, 0.0) for k in ATTENTION_OPS)
    return {"step_ms": 1e3 * seconds / job["steps"],
            "attention_share": attention / total if job["engine"] == "in-process" else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/llama-3.2-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shared", default="0,2048")
    p.add_argument("--private", type=int, default=193)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=9, help="generated tokens (1 prefill + decodes)")
    p.add_argument("--engines", default="in-process,multiprocess")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="cpu_llama-3.2-1b")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        result = child(json.loads(a.child))
        child_process.report(result)
        return 0
    command = "python -m vllm_chunkattn.bench step " + " ".join(
        sys.argv[2:] if argv is None else argv)
    load_before = provenance.load_average()
    rows = []
    for engine in a.engines.split(","):
        for shared in (int(s) for s in a.shared.split(",")):
            for system in ("stock", "custom"):
                job = dict(model=a.model, dtype=a.dtype, system=system, shared=shared,
                           private=a.private, batch=a.batch, steps=a.steps, engine=engine)
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING":
                       "0" if engine == "in-process" else "1"}
                result = child_process.run([sys.executable, "-m", "vllm_chunkattn.bench",
                                            "step", "--child", json.dumps(job)], env, 900,
                                           str(job))
                rows.append({**job, **result})
                print(f"{engine} {system} shared={shared}: {rows[-1]['step_ms']:.1f} ms/step",
                      flush=True)
    write_report(rows, a, command, load_before)
    return 0


def write_report(rows, a, command, load_before) -> None:
    by = {(r["engine"], r["system"], r["shared"]): r for r in rows}
    lines = [f"# Decode step: stock vs CUSTOM, in-process vs multiprocess engine ({a.tag})", "",
             f"Command: `{command}`", "",
             f"- machine: {provenance.machine()}; load average before {load_before}, after "
             f"{provenance.load_average()}; commit {provenance.git_commit()}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}",
             f"- model `{a.model}` (dummy weights), {a.dtype}, batch {a.batch}, prompts = shared "
             f"prefix + {a.private} tokens, cached before the timed `LLM.generate` of {a.steps} "
             "tokens (1 cached-prompt step + decodes), under the torch profiler; one run each",
             "- attention share: the attention op's self CPU time over all ops' (the in-process "
             "engine only: the profiler sees the model there)", "",
             "| engine | shared | stock ms/step | custom ms/step | custom/stock speed | stock "
             "attention % | custom attention % | prefix cost stock ms | prefix cost custom ms "
             "| share removed |", "|---|---|---|---|---|---|---|---|---|---|"]
    shared = [int(s) for s in a.shared.split(",")]
    for engine in a.engines.split(","):
        for s in shared:
            st, cu = by[(engine, "stock", s)], by[(engine, "custom", s)]
            pct = (lambda r: "–" if r["attention_share"] is None
                   else f"{100 * r['attention_share']:.0f}")
            base_s = by[(engine, "stock", shared[0])]
            cost_s = st["step_ms"] - base_s["step_ms"]
            cost_c = cu["step_ms"] - base_s["step_ms"]
            removed = (cost_s - cost_c) / cost_s if s != shared[0] and cost_s > 0 else None
            lines.append(
                f"| {engine} | {s} | {st['step_ms']:.1f} | {cu['step_ms']:.1f} | "
                f"{st['step_ms'] / cu['step_ms']:.2f}× | {pct(st)} | {pct(cu)} | "
                f"{cost_s:.1f} | {cost_c:.1f} | "
                f"{'–' if removed is None else f'{removed:.2f}'} |")
    lines += ["", "prefix cost = step ms − stock's step ms with no shared prefix (same engine); "
              "share removed = (stock's prefix cost − CUSTOM's) / stock's.", ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_{a.tag}.md").write_text("\n".join(lines))
    (out / f"step_{a.tag}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"step: report {out / f'step_{a.tag}.md'}")


if __name__ == "__main__":
    sys.exit(main())
