"""`python -m vllm_chunkattn.bench offline`: decode throughput of stock vLLM vs
`attention_backend="CUSTOM"` through `LLM.generate`, no API server.

Two engines live for the whole run, each in its own process driven over a pipe, started at once
(each with a fixed KV pool, `--kv-cache-gb`); only one works at a time. Per workload (`--batch`
requests sharing one `--shared`-token prefix, each with its own
private tokens), both engines first prefill and cache every prompt (max_tokens=1); each prompt is
a multiple of the block size plus one token long, so a timed generate recomputes only its last
token: one 1-token-per-request prefill step, then max_tokens - 1 decode steps. Timed calls run in
A B B A order, `--repeats` times; the report gives median and best decode tok/s per system.

    python -m vllm_chunkattn.bench offline                                   # tiny model
    python -m vllm_chunkattn.bench offline --model models/llama-3.2-1b --tag llama1b
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_chunkattn.bench import provenance
from vllm_chunkattn.bench.offline_report import SYSTEMS, shared_cost_removed, write_report
from vllm_chunkattn.bench.token_identity import TOP_K, compare, position_logprobs
from vllm_chunkattn.bench.model_shapes import describe, has_weights


@dataclass
class Workload:
    shared_len: int
    private_len: int
    prompts: list[list[int]]

    @property
    def name(self) -> str:
        return f"shared{self.shared_len}"


def make_workloads(a, vocab: list[int]) -> list[Workload]:
    """Token-id prompts: one prefix shared by the whole batch + private tokens, each prompt
    rounded up to k * block_size + 1 tokens (all k blocks cached, the last token recomputed)."""
    out = []
    for shared in a.shared:
        rng = random.Random(a.seed + shared)
        length = -(-(shared + a.private) // a.block_size) * a.block_size + 1
        prefix = [rng.choice(vocab) for _ in range(shared)]
        prompts = [prefix + [rng.choice(vocab) for _ in range(length - shared)]
                   for _ in range(a.batch)]
        out.append(Workload(shared, length - shared, prompts))
    return out


# ---- engine processes

def _engine_main(conn, engine_kwargs: dict, log_path: str) -> None:
    """Child: one LLM; answers ("generate", prompts, max_tokens, logprobs) with (seconds, token
    ids, cached prompt tokens, per-position logprobs or None) until ("stop",). Its (and its
    EngineCore's) output goes to log_path."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(**engine_kwargs)
    except Exception as e:  # noqa: BLE001  (whatever failed, the parent reports it)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            # Before exit: multiprocessing's exit joins the (non-daemon) EngineCore process,
            # which would wait forever for this client's shutdown.
            llm.llm_engine.engine_core.shutdown()
            break
        _, prompts, max_tokens, logprobs = msg
        # No detokenizing: model_shapes models emit ids past their small tokenizer's vocab.
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, logprobs=logprobs)
        before = _spec_counts(llm)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = _spec_counts(llm)
        conn.send(("done", (seconds, [list(o.outputs[0].token_ids) for o in outs],
                            sum(o.num_cached_tokens or 0 for o in outs),
                            [position_logprobs(o.outputs[0]) for o in outs] if logprobs
                            else None,
                            tuple(b - a for a, b in zip(before, after)) if after else None)))
    conn.close()


SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _spec_counts(llm) -> tuple[int, ...]:
    """(draft tokens, accepted draft tokens) so far, from vLLM's own spec-decode counters; ()
    without speculative decoding."""
    if llm.llm_engine.vllm_config.speculative_config is None:
        return ()
    values = {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}
    return tuple(int(values.get(name, 0)) for name in SPEC_COUNTERS)


class Engine:
    def __init__(self, system: str, engine_kwargs: dict, log_path: Path):
        self.system, self.log_path = system, log_path
        self.started, self.ready = time.monotonic(), math.nan
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, name=f"offline-{system}",
                                args=(child, engine_kwargs, str(log_path)))
        self.proc.start()
        child.close()

    def wait_ready(self) -> None:
        self._recv("ready")
        self.ready = time.monotonic()

    def generate(self, prompts, max_tokens: int, logprobs: int | None = None):
        """(seconds, token ids per prompt, cached prompt tokens, logprobs per prompt or None,
        (draft tokens, accepted) of the call or None without speculative decoding)"""
        self.conn.send(("generate", prompts, max_tokens, logprobs))
        return self._recv("done")

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop",))
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)

    def _recv(self, kind: str):
        try:
            tag, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.system} engine died; log: {self.log_path}\n"
                               + _tail(self.log_path)) from None
        if tag != kind:
            raise RuntimeError(f"{self.system} engine: {payload}; log: {self.log_path}\n"
                               + _tail(self.log_path))
        return payload


def _tail(path: Path, n: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


# ---- measurement

def run_workload(engines: dict[str, Engine], w: Workload, a) -> list[dict]:
    for e in engines.values():              # prefill + cache: the prefix once, then every prompt
        e.generate(w.prompts[:1], 1)
        e.generate(w.prompts, 1)
    times = {s: [] for s in SYSTEMS}
    cached, drafts = {}, {s: [0, 0] for s in SYSTEMS}
    for _ in range(a.repeats):
        for s in ("stock", "custom", "custom", "stock"):
            seconds, _, num_cached, _, spec = engines[s].generate(w.prompts, a.max_tokens)
            times[s].append(seconds)
            cached.setdefault(s, num_cached)
            if spec:
                drafts[s] = [n + d for n, d in zip(drafts[s], spec)]
    # One untimed call more per system, with logprobs: same tokens as the timed calls (greedy,
    # same batch), and how close the systems' numbers are.
    checked = {s: engines[s].generate(w.prompts, a.max_tokens, TOP_K) for s in SYSTEMS}
    identity = compare(checked["stock"][1], checked["custom"][1], checked["stock"][3],
                       checked["custom"][3])
    num_out = len(w.prompts) * a.max_tokens
    rows = []
    for s in SYSTEMS:
        med, best = statistics.median(times[s]), min(times[s])
        rows.append({"workload": w.name, "shared_len": w.shared_len, "private_len": w.private_len,
                     "prompt_len": len(w.prompts[0]), "batch": len(w.prompts),
                     "max_tokens": a.max_tokens, "system": s,
                     "median_tok_s": num_out / med, "best_tok_s": num_out / best,
                     "median_step_ms": 1e3 * med / a.max_tokens,
                     "best_step_ms": 1e3 * best / a.max_tokens,
                     "cached_prompt_pct": 100 * cached[s] / sum(map(len, w.prompts)),
                     "mismatched_requests": identity.mismatched,
                     "max_logprob_diff": identity.max_logprob_diff,
                     "max_tie_gap": identity.max_tie_gap,
                     "draft_tokens": drafts[s][0], "accepted_tokens": drafts[s][1],
                     "seconds": " ".join(f"{t:.3f}" for t in times[s])})
    ratio = rows[1]["median_tok_s"] / rows[0]["median_tok_s"]
    for r in rows:
        r["ratio_custom_stock"] = ratio
    return rows


# ---- command

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench offline",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local model dir (default: the tiny model); "
                   "a dir without weights (vllm_chunkattn.bench.model_shapes) loads dummy weights")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=64, help="CPU_ATTN needs a multiple of 32")
    p.add_argument("--shared", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2048],
                   help="comma list of shared-prefix lengths, one workload each")
    p.add_argument("--private", type=int, default=160,
                   help="private tokens per prompt (rounded up: prompt = k * block + 1)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="A B B A rounds per workload")
    p.add_argument("--kv-cache-gb", type=int, default=1,
                   help="KV pool per engine, on any device (vLLM's kv_cache_memory_bytes; 1 GiB: "
                        "32K tokens of Llama-3.2-1B, each of its engines then holds ~5.5 GB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="per engine on a GPU, where both engines share the device: with the KV "
                        "pool fixed, only vLLM's start-up check that this share is free (its "
                        "default 0.9 would fail the second engine's); unused on CPU")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None,
                   help="JSON for both engines, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}'")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="report stem offline_<tag> (default: model name)")
    p.add_argument("--log-dir", default=None, help="engine logs (default: a temp dir)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.model is None:
        from vllm_chunkattn.tiny_model import ensure_tiny_model
        a.model = str(ensure_tiny_model())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    special = set(tok.all_special_ids)
    workloads = make_workloads(a, [i for i in range(len(tok)) if i not in special])
    max_len = max(len(w.prompts[0]) for w in workloads) + a.max_tokens
    dummy = not has_weights(a.model)
    kwargs = dict(model=a.model, dtype=a.dtype, block_size=a.block_size, seed=a.seed,
                  max_model_len=-(-max_len // a.block_size) * a.block_size,
                  max_num_seqs=max(a.batch, 1), enforce_eager=a.enforce_eager,
                  kv_cache_memory_bytes=a.kv_cache_gb << 30)
    if dummy:
        kwargs["load_format"] = "dummy"
    if a.speculative_config:
        kwargs["speculative_config"] = json.loads(a.speculative_config)
        kwargs["disable_log_stats"] = False       # the spec-decode counters (both engines)
    import torch
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = a.gpu_memory_utilization
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="chunkattn-offline-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    tag = a.tag or Path(a.model).name
    setup = {"command": "python -m vllm_chunkattn.bench offline " + shlex.join(argv),
             "machine": provenance.machine(), "load_before": provenance.load_average(),
             "model": {"path": a.model, **describe(a.model)}, "dummy": dummy, "dtype": a.dtype,
             "block_size": a.block_size, "enforce_eager": a.enforce_eager,
             "speculative_config": a.speculative_config,
             "kv_space": f"a KV pool of {a.kv_cache_gb} GiB" + (
                 f" (gpu_memory_utilization {a.gpu_memory_utilization})"
                 if "gpu_memory_utilization" in kwargs else ""), "commit": provenance.git_commit(),
             "native": provenance.native_build(), "date": time.strftime("%Y-%m-%d %H:%M"),
             "max_tokens": a.max_tokens, "repeats": a.repeats, "log_dir": str(log_dir)}
    print(f"offline: {len(workloads)} workloads on {a.model} ({a.dtype}); engine logs in "
          f"{log_dir}", flush=True)
    t_start = time.monotonic()
    engines: dict[str, Engine] = {}
    rows: list[dict] = []
    rc = 0
    try:
        # At once: with its KV pool fixed, vLLM skips the start-up memory profile that fails on
        # a GPU when another process's memory changes meanwhile (serve_ab.sh's pairs start so);
        # one start's wall time saved (torch.compile and graph capture on a GPU).
        for s in SYSTEMS:
            engines[s] = Engine(s, {**kwargs, "attention_backend": "CUSTOM"} if s == "custom"
                                else kwargs, log_dir / f"{s}.log")
        for e in engines.values():
            e.wait_ready()
        setup["engine_starts"] = {s: (round(e.started - t_start, 1), round(e.ready - t_start, 1))
                                  for s, e in engines.items()}
        print("offline: engines ready after " + ", ".join(
            f"{s} {ready:.0f} s" for s, (_, ready) in setup["engine_starts"].items())
            + " (started at once)", flush=True)
        for w in workloads:
            t0 = time.monotonic()
            mine = run_workload(engines, w, a)
            rows += mine
            st, cu = mine
            print(f"offline: {w.name} (prompt {len(w.prompts[0])}): stock "
                  f"{st['median_tok_s']:.1f} tok/s (step {st['median_step_ms']:.1f} ms), custom "
                  f"{cu['median_tok_s']:.1f} tok/s (step {cu['median_step_ms']:.1f} ms), "
                  f"{st['ratio_custom_stock']:.2f}x, {st['mismatched_requests']} mismatched, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    except (RuntimeError, KeyboardInterrupt) as e:     # an engine died, or Ctrl-C
        print(f"offline: stopped: {e}", flush=True)
        rc = 1
    finally:
        for engine in engines.values():
            engine.stop()
    if not rows:
        return rc
    for s, share in shared_cost_removed(rows):
        print(f"offline: share of the shared-prefix attention cost removed at S={s}: {share:.2f}")
    setup.update(load_after=provenance.load_average(),
                 wall_min=(time.monotonic() - t_start) / 60)
    paths = write_report(rows, setup, Path(a.out), tag)
    print(f"offline: report: {', '.join(map(str, paths))}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
