"""`python -m vllm_chunkattn.bench host`: where a served decode step's time goes, stock vs CUSTOM.

For each system a child process builds vLLM's in-process engine (`LLM`,
VLLM_ENABLE_V1_MULTIPROCESSING=0, so the scheduler and the model runner share one thread) and
runs `bench ab`'s nothing-shared serving shape offline: `--prompts` random prompts of
`--prompt-len` tokens ± `--range-ratio`, `--output-len` tokens each, all submitted at once.
Every part of a step vLLM and the plugin run is timed where it is called (the scheduler's
schedule / update_from_output, the runner's input preparation, the attention metadata build,
each layer's attention, the rest of the forward pass, sampling): ms per engine step, side by
side, averaged over `--repeats` runs in ABBA order. The parts CUSTOM replaces are those named
"attention ..." and "scheduler ..." (tree KV manager and admission).

    python -m vllm_chunkattn.bench host --model models/llama-3l-gqa4 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from vllm_chunkattn.bench import child_process, provenance

# What is timed, in call order; "step" is the whole engine step (the rest is its remainder).
PARTS = ("scheduler.schedule", "runner.reorder_batch", "runner.update_states",
         "runner.prepare_inputs",
         "attention.metadata_build", "attention.forward", "runner.model_forward",
         "runner.sample", "scheduler.update_from_output")

NESTED = {"attention.forward": "runner.model_forward",   # part -> the part it runs inside
          "runner.reorder_batch": "runner.update_states"}
FORWARD = ("runner.model_forward", "attention.forward")    # the model: the rest is host work


class Timers:
    def __init__(self):
        self.ns = defaultdict(int)        # wall clock
        self.cpu_ns = defaultdict(int)    # this thread's CPU time: host work without the noise
        self.calls = defaultdict(int)

    def wrap(self, obj, attr: str, part: str, owner=None):
        """Times obj.attr (an instance's bound method, or a class's function when owner is a
        class) under `part`; nested parts are subtracted from their parent in the report."""
        target = owner or obj
        original = getattr(target, attr)
        ns, cpu_ns, calls = self.ns, self.cpu_ns, self.calls
        wall, cpu = time.perf_counter_ns, time.thread_time_ns

        def timed(*args, **kwargs):
            t0, c0 = wall(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                ns[part] += wall() - t0
                cpu_ns[part] += cpu() - c0
                calls[part] += 1
        setattr(target, attr, timed)


def child(job: dict) -> dict:
    import random

    from vllm import LLM, SamplingParams
    kw = dict(model=job["model"], dtype=job["dtype"], block_size=64, max_model_len=4096,
              kv_cache_memory_bytes=512 << 20, enforce_eager=True, seed=0,
              max_num_seqs=job["prompts"])
    if not job["weights"]:
        kw["load_format"] = "dummy"
    if job["system"] == "custom":
        kw["attention_backend"] = "CUSTOM"
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    counter = Timers()
    counter.wrap(core, "step_fn", "step")
    counter.wrap(core.scheduler, "schedule", "scheduler.schedule")
    counter.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    counter.wrap(runner, "_update_states", "runner.update_states")
    counter.wrap(runner, "_may_reorder_batch", "runner.reorder_batch")
    counter.wrap(runner, "_prepare_inputs", "runner.prepare_inputs")
    counter.wrap(runner, "_build_attention_metadata", "attention.metadata_build")
    counter.wrap(runner, "_model_forward", "runner.model_forward")
    counter.wrap(runner, "sample_tokens", "runner.sample")
    if job["system"] == "custom":
        from vllm_chunkattn.plugin.backend import ChunkAttnImpl as impl
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl
    counter.wrap(None, "forward", "attention.forward", owner=impl)

    rng = random.Random(job["seed"])
    lo = int(job["prompt_len"] * (1 - job["range_ratio"]))
    hi = int(job["prompt_len"] * (1 + job["range_ratio"]))
    prompts = [{"prompt_token_ids": [rng.randrange(10, 2000) for _ in range(rng.randint(lo, hi))]}
               for _ in range(job["prompts"])]
    params = SamplingParams(max_tokens=job["output_len"], temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)              # warm-up
    llm.reset_prefix_cache()
    for counts in (counter.ns, counter.cpu_ns, counter.calls):
        counts.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    n = counter.calls["step"]
    return {"seconds": seconds, "steps": n,
            "tokens": job["prompts"] * job["output_len"],
            "ms_per_step": {k: v / 1e6 / n for k, v in counter.ns.items()},
            "cpu_ms_per_step": {k: v / 1e6 / n for k, v in counter.cpu_ns.items()},
            "calls": dict(counter.calls)}


def run_child(job: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    return child_process.run([sys.executable, "-m", "vllm_chunkattn.bench", "host", "--child",
                              json.dumps(job)], env, 3600, job["system"])


def exclusive(ms: dict) -> dict:
    """Each part without the one nested in it (attention runs inside the forward pass, the
    batch reorder inside the state update), and the step's remainder as "other"."""
    out = {p: ms.get(p, 0.0) for p in PARTS}
    for part, parent in NESTED.items():
        out[parent] -= out[part]
    out["other"] = ms.get("step", 0.0) - sum(ms.get(p, 0.0) for p in PARTS
                                             if p not in NESTED)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench host",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local model dir (default: the tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="ABBA rounds")
    p.add_argument("--out", default=None, help="folder for host_<tag>.md/.json (default: print)")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_process.report(child(json.loads(a.child)))
        return 0
    from vllm_chunkattn.bench.model_shapes import has_weights
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    model = a.model or str(ensure_tiny_model())
    command = "python -m vllm_chunkattn.bench host " + " ".join(
        sys.argv[2:] if argv is None else argv)
    load_before = provenance.load_average()

    def job(system):
        return dict(model=model, dtype=a.dtype, system=system, prompts=a.prompts,
                    prompt_len=a.prompt_len, range_ratio=a.range_ratio, output_len=a.output_len,
                    seed=0, weights=has_weights(model))
    runs = defaultdict(list)
    for r in range(a.repeats):
        for system in (("stock", "custom") if r % 2 == 0 else ("custom", "stock")):
            res = run_child(job(system))
            runs[system].append(res)
            print(f"round {r} {system}: {res['tokens'] / res['seconds']:.0f} tok/s, "
                  f"{1e3 * res['seconds'] / res['steps']:.2f} ms/step", flush=True)
    report = write_report(runs, a, model, command, load_before)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"host_{a.tag}"
        (out / f"{stem}.md").write_text(report)
        (out / f"{stem}.json").write_text(json.dumps(runs, indent=1) + "\n")
        plot_parts(runs, a.tag, out / f"{stem}.png")
    print(report)
    return 0


def median_parts(runs: list[dict], key: str) -> dict:
    """Per part, the median over runs (a run slowed by another job on the machine drops out)."""
    parts = [exclusive(r[key]) for r in runs]
    return {k: statistics.median(p[k] for p in parts) for k in parts[0]}


def plot_parts(runs, tag: str, path: Path) -> None:
    """Host parts of a step (CPU time, medians), stock and CUSTOM side by side."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("host: matplotlib not installed: no plot", flush=True)
        return
    from vllm_chunkattn.bench.ab_report import _save
    st = median_parts(runs["stock"], "cpu_ms_per_step")
    cu = median_parts(runs["custom"], "cpu_ms_per_step")
    parts = [p for p in (*PARTS, "other") if p not in FORWARD]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ys = range(len(parts))
    ax.barh([y - 0.2 for y in ys], [st[p] for p in parts], 0.4, label="stock")
    ax.barh([y + 0.2 for y in ys], [cu[p] for p in parts], 0.4, label="CUSTOM")
    ax.set_yticks(list(ys), parts)
    ax.invert_yaxis()
    ax.set_xlabel("engine thread CPU ms per step (median of runs)")
    ax.set_title(f"host work of a served step, nothing shared ({tag})", fontsize=9)
    ax.legend()
    _save(fig, path)


def write_report(runs, a, model, command, load_before) -> str:
    steps = {s: runs[s][0]["steps"] for s in runs}
    lines = [f"# Host step breakdown: stock vs CUSTOM ({a.tag})", "", f"Command: `{command}`", "",
             f"- machine: {provenance.machine()}; load average before {load_before}, after "
             f"{provenance.load_average()}; commit {provenance.git_commit()}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}",
             f"- model `{model}`, {a.dtype}, in-process engine, block size 64, "
             f"{a.prompts} prompts of {a.prompt_len} ± {int(100 * a.range_ratio)} % random "
             f"tokens (nothing shared), {a.output_len} output tokens each, all at once; engine "
             f"steps: stock {steps['stock']}, CUSTOM {steps['custom']}"]
    st, cu = median_parts(runs["stock"], "ms_per_step"), median_parts(runs["custom"], "ms_per_step")
    cst = median_parts(runs["stock"], "cpu_ms_per_step")
    ccu = median_parts(runs["custom"], "cpu_ms_per_step")
    tok_s = {s: [r["tokens"] / r["seconds"] for r in runs[s]] for s in runs}
    ratios = [c / s for s, c in zip(tok_s["stock"], tok_s["custom"])]
    lines += [f"- {a.repeats} runs per system in ABBA order; tok/s per round: stock "
              f"{', '.join(f'{t:.0f}' for t in tok_s['stock'])}; CUSTOM "
              f"{', '.join(f'{t:.0f}' for t in tok_s['custom'])}; CUSTOM/stock "
              f"{', '.join(f'{x:.3f}' for x in ratios)}",
              "- CPU = the engine thread's CPU time (host work, free of the time it spends "
              "descheduled on a shared machine); wall = elapsed time (includes the other "
              "threads' share of multi-threaded ops); each part's median over the runs", "",
              "| part (ms per engine step, exclusive) | stock CPU | CUSTOM CPU | CUSTOM − stock "
              "CPU | stock wall | CUSTOM wall | CUSTOM − stock wall |",
              "|---|---|---|---|---|---|---|"]
    for k in (*PARTS, "other"):
        lines.append(f"| {k} | {cst[k]:.3f} | {ccu[k]:.3f} | {ccu[k] - cst[k]:+.3f} | "
                     f"{st[k]:.3f} | {cu[k]:.3f} | {cu[k] - st[k]:+.3f} |")
    tots = [sum(d.values()) for d in (cst, ccu, st, cu)]
    host = [t - sum(d[p] for p in FORWARD) for t, d in zip(tots, (cst, ccu, st, cu))]
    lines += [f"| **host work** (step − forward) | {host[0]:.3f} | {host[1]:.3f} | "
              f"{host[1] - host[0]:+.3f} | {host[2]:.3f} | {host[3]:.3f} | "
              f"{host[3] - host[2]:+.3f} |",
              f"| **step** | {tots[0]:.3f} | {tots[1]:.3f} | {tots[1] - tots[0]:+.3f} | "
              f"{tots[2]:.3f} | {tots[3]:.3f} | {tots[3] - tots[2]:+.3f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
