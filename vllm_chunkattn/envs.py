"""Every CHUNKATTN_* environment variable the project reads, in one typed registry.

Python code reads a knob as an attribute of this module, parsed at the moment of reading (so a
test's monkeypatch.setenv takes effect at once):

    from vllm_chunkattn import envs
    envs.STATS_INTERVAL_S      # float, 10.0 unless CHUNKATTN_STATS_INTERVAL_S says otherwise

A malformed value raises a ValueError naming the variable and the type it expects, instead of
being read as some default. The knobs read by the native kernel (std::getenv in csrc/), by
setup.py and by tests are registered here too, with who reads them, so that
docs/configuration.md (`python -m vllm_chunkattn.envs --markdown`) lists them all;
tests/core/test_envs.py checks that no CHUNKATTN_* name is read or mentioned without being here.

This module imports neither torch nor vLLM: setup-time code and light tools may use it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

PREFIX = "CHUNKATTN_"
KINDS = ("bool", "int", "float", "str", "path", "choice")
READERS = ("product", "build", "native kernel", "bench", "test")   # the docs' order


@dataclass(frozen=True)
class Knob:
    name: str                       # the full variable name, CHUNKATTN_...
    kind: str                       # one of KINDS
    default: Any                    # the value when unset or empty; a callable is called then
    doc: str                        # one line: what it does
    read_by: tuple[str, ...]        # of READERS
    choices: tuple[str, ...] = ()   # kind "choice": the accepted values
    default_doc: str | None = None  # how the default reads in the docs, where it is computed

    def parse(self, text: str) -> Any:
        try:
            if self.kind == "bool":
                if text not in ("0", "1"):
                    raise ValueError
                return text == "1"
            if self.kind == "int":
                return int(text)
            if self.kind == "float":
                return float(text)
            if self.kind == "path":
                return Path(text)
            if self.kind == "choice" and text not in self.choices:
                raise ValueError
            return text
        except ValueError:
            raise ValueError(f"{self.name}={text!r}: expected {self.expected()}") from None

    def get(self) -> Any:
        text = os.environ.get(self.name, "")
        if text == "":
            return self.default() if callable(self.default) else self.default
        return self.parse(text)

    def expected(self) -> str:
        if self.kind == "bool":
            return "a bool, 1 or 0"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return {"int": "an int", "float": "a number", "path": "a path",
                "str": "a string"}[self.kind]


def _jit_build_root() -> Path:
    return Path.home() / ".cache" / "vllm_chunkattn" / "jit"


_P, _B, _K, _BE, _T = READERS

_KNOBS = [
    # --- the plugin, under vLLM ---
    Knob("CHUNKATTN_TREE_KV_MANAGER", "bool", True,
         "0: vLLM's own KV cache manager and scheduler instead of the chunk prefix tree (TPP "
         "decode stays; an A/B arm of `bench ablation`).", (_P,)),
    Knob("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "bool", True,
         "Reorder the head of the waiting queue by prefix match with the tree, so sharers decode "
         "in the same steps (0: FCFS order).", (_P,)),
    Knob("CHUNKATTN_SCHED_WINDOW", "int", 256,
         "How many requests at the head of the waiting queue prefix-aware admission reorders.",
         (_P,)),
    Knob("CHUNKATTN_SCHED_MAX_WAIT_STEPS", "int", 64,
         "Steps after which a waiting request goes ahead of every reordered one (no starvation).",
         (_P,)),
    Knob("CHUNKATTN_PLAN_CACHE", "bool", True,
         "Reuse the decode plan while the batch's chunk tree is unchanged (0: rebuild it every "
         "step, for `bench ablation`).", (_P,)),
    Knob("CHUNKATTN_ALLOW_REFERENCE", "bool", False,
         "Where no native kernel loads, serve with the PyTorch reference TPP decode (10-100x "
         "slower) instead of refusing to start.", (_P,)),
    Knob("CHUNKATTN_CHECK_HOST_ROWS", "bool", False,
         "CPU runner: every step, compare the host block-table rows and lengths a plan is built "
         "from with the runner's own (tests).", (_P,)),
    Knob("CHUNKATTN_STATS_INTERVAL_S", "float", 10.0,
         "Seconds between the `chunkattn decode:` / `chunkattn tree:` log lines and the stats "
         "files' writes (0: every step).", (_P,)),
    Knob("CHUNKATTN_STATS_FILE", "path", None,
         "Each engine's first worker (TP rank 0, first PP stage) writes its decode sharing "
         "counters here as JSON at every flush. With data parallelism DP rank 0 writes this "
         "path and rank N > 0 the path with `.dpN` before its suffix (stats.json -> "
         "stats.dp1.json).", (_P,), default_doc="unset: no file"),
    Knob("CHUNKATTN_TREE_STATS_FILE", "path", None,
         "The scheduler writes the chunk tree's counters here as JSON at every flush; setting it "
         "also turns on the exact per-step sharing count. Per DP rank as for "
         "CHUNKATTN_STATS_FILE (rank N > 0: tree.json -> tree.dpN.json).", (_P,),
         default_doc="unset: no file"),
    Knob("CHUNKATTN_DEBUG_TREE", "bool", False,
         "Run the chunk tree's invariant checker every step (slow; soak runs, tests).", (_P,)),
    Knob("CHUNKATTN_METRICS_DIR", "path", None,
         "Set by the plugin, not by hand: the Prometheus multi-process directory EngineCore and "
         "the workers write the `chunkattn:*` values into.", (_P,),
         default_doc="set by the plugin"),
    Knob("CHUNKATTN_JIT", "bool", True,
         "With CUDA and a source checkout but no prebuilt extension, JIT-build csrc/ at import "
         "(0: never; the PyTorch reference then).", (_P,)),
    # --- building the native extension ---
    Knob("CHUNKATTN_BUILD_CUDA", "bool", None,
         "setup.py: build the CUDA kernel into the extension (1) or only the CPU one (0).", (_B,),
         default_doc="1 when nvcc and a CUDA torch are present"),
    Knob("CHUNKATTN_BUILD_DIR", "path", _jit_build_root,
         "Root of the JIT builds, one folder per torch / CUDA / arch / source hash.", (_B,),
         default_doc="~/.cache/vllm_chunkattn/jit"),
    Knob("CHUNKATTN_NVCC_FLAGS", "str", "",
         "Extra nvcc flags for the JIT build, space separated (e.g. -Xptxas=-v); part of the "
         "build's key.", (_B,)),
    Knob("CHUNKATTN_JIT_VERBOSE", "bool", False, "Show the JIT build's compiler output.", (_B,)),
    # --- the native kernels (std::getenv at each eager call) ---
    Knob("CHUNKATTN_CPU_ISA", "choice", "",
         "Restrict the CPU kernel to one instruction set, so tests cover the fallbacks.", (_K,),
         choices=("amx", "avx512_bf16", "avx512", "avx2", "scalar"),
         default_doc="unset: the best this CPU runs"),
    Knob("CHUNKATTN_OVERLAP_FINAL", "bool", True,
         "sm_90+: the final TPP launch overlaps the partial one as its programmatic dependent "
         "(0: after it, as on sm_80). Benchmarks record it.", (_K, _BE)),
    Knob("CHUNKATTN_CHUNK_SPLITS", "int", 0,
         "Force the CUDA op's KV splits of each shared chunk (0: its own choice).", (_K,)),
    Knob("CHUNKATTN_SEQ_SPLITS", "int", 0,
         "Force the CUDA op's KV splits of each private tail (0: its own choice).", (_K,)),
    Knob("CHUNKATTN_FINAL_STAGE_TOKENS", "int", 0,
         "64: the final launch streams tails in the head size's default smem stage instead of "
         "the compact 32-token one.", (_K,)),
    Knob("CHUNKATTN_PARTIAL_STAGE_TOKENS", "int", 0,
         "32: the partial launch uses the compact 32-token smem stage instead of the head size's "
         "default.", (_K,)),
    Knob("CHUNKATTN_SLOT_LIST_CAP", "int", 0,
         "Shorten a row's list of partial-result slots, so they are merged in batches (tests; 0: "
         "the kernel's own length).", (_K,)),
    Knob("CHUNKATTN_KV_OFFSETS_I64", "int", 0,
         "1: 64-bit KV offsets for K and V each, instead of one 32-bit offset a token for both "
         "(the default where the cache fits).", (_K,)),
    # --- tests ---
    Knob("CHUNKATTN_COMPILE_TEST", "bool", False,
         "Run the full CUDA compile check of tests/kernels/test_cuda_contract.py (minutes).", (_T,)),
    Knob("CHUNKATTN_REQUIRE_VLLM_SOURCES", "bool", False,
         "Fail, instead of skip, the tests needing vLLM's sources when they cannot be fetched "
         "(CI sets it).", (_T,)),
    Knob("CHUNKATTN_EXT_SWAP", "bool", True,
         "vLLM's own tests run with the chunk tree swapped in (0: on stock vLLM, to tell our "
         "failures from the environment's).", (_T,)),
    Knob("CHUNKATTN_EXT_REPORT", "path", None,
         "Write the outcome of each of vLLM's own tests here as JSON.", (_T,),
         default_doc="unset: no report"),
    Knob("CHUNKATTN_EXT_CHECK_STALE", "bool", False,
         "Also fail on expected-failure entries that matched no test (full runs only).", (_T,)),
    Knob("CHUNKATTN_SIMT_CSRC", "path", None,
         "The csrc/ the CPU emulation of the CUDA kernel is built from (mutation runs point it "
         "at a mutated copy).", (_T,), default_doc="the checkout's csrc/"),
]

KNOBS: dict[str, Knob] = {k.name.removeprefix(PREFIX): k for k in _KNOBS}


def knob(name: str) -> Knob:
    """The registered knob, by short (STATS_FILE) or full (CHUNKATTN_STATS_FILE) name."""
    short = name.removeprefix(PREFIX)
    if short not in KNOBS:
        raise KeyError(f"{PREFIX}{short} is not a registered knob (vllm_chunkattn/envs.py)")
    return KNOBS[short]


def raw(name: str, default: str | None = None) -> str | None:
    """The variable's text as the environment holds it (a run's record of what it found)."""
    return os.environ.get(knob(name).name, default)


def export(name: str, value) -> None:
    """Sets a knob in this process's environment, so child processes inherit it."""
    os.environ[knob(name).name] = str(value)


def __getattr__(name: str):
    if name in KNOBS:
        return KNOBS[name].get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *KNOBS])


def markdown() -> str:
    """docs/configuration.md."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default(k: Knob) -> str:
        if k.default_doc is not None:
            return k.default_doc
        if k.kind == "bool":
            return "`1`" if k.default else "`0`"
        return f"`{k.default}`" if k.default != "" else "empty"

    def kind(k: Knob) -> str:
        return {"bool": "bool (1 / 0)", "choice": "one of " + ", ".join(k.choices)}.get(
            k.kind, k.kind)

    lines = ["# Configuration", "",
             "Every `CHUNKATTN_*` environment variable the project reads. Generated from "
             "`vllm_chunkattn/envs.py` by `python -m vllm_chunkattn.envs --markdown`: edit the "
             "registry, not this file. An unset or empty variable takes its default; a malformed "
             "one is an error naming it. The plugin needs none of them: "
             "`--attention-backend CUSTOM` alone serves.", "",
             "Read by: *product* the plugin under vLLM; *build* setup.py and the JIT build; "
             "*native kernel* the C++/CUDA op on each eager call; *bench* the benchmarks; "
             "*test* the test suite.", "",
             "| Variable | Type | Default | What it does | Read by |",
             "|---|---|---|---|---|"]
    order = {r: i for i, r in enumerate(READERS)}
    for k in sorted(_KNOBS, key=lambda k: order[k.read_by[0]]):
        lines.append(f"| `{k.name}` | {cell(kind(k))} | {cell(default(k))} | {cell(k.doc)} | "
                     f"{', '.join(k.read_by)} |")
    return "\n".join(lines) + "\n"


def _check_registry() -> None:
    for k in _KNOBS:
        assert k.name.startswith(PREFIX) and k.kind in KINDS, k
        assert k.read_by and set(k.read_by) <= set(READERS), k
        assert (k.kind == "choice") == bool(k.choices), k


_check_registry()


def main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv:
        print("usage: python -m vllm_chunkattn.envs [--markdown]", file=sys.stderr)
        return 2
    for short, k in KNOBS.items():   # the values this environment gives
        state = "set" if os.environ.get(k.name, "") != "" else "default"
        try:
            value = k.get()
        except ValueError as e:
            value = f"error: {e}"
        print(f"{k.name}={value}  ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
