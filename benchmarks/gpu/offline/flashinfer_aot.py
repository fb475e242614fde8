"""FlashInfer's bench modules compiled ahead of time, so the GPU host does not wait on nvcc.

FlashInfer's JIT build of the bench's modules (the FA2 and FA3 batch-prefill modules of both
dtypes and the cascade merge, 42 nvcc units) takes 60-112 s on an H100 or H200 host. FlashInfer
loads a module from `flashinfer/data/aot/<name>/<name>.so` without building when that file
exists (jit/core.py: JitSpec.is_aot), and its modules bind through tvm-ffi, not torch's C++ ABI:
a module compiled elsewhere with the same FlashInfer, the same nvcc (13.0, as on the image) and
the GPU's arch is the one the GPU host would build.

  build    (once, on any machine with nvcc: ~14 min on 2 cores) compiles the modules
           bench.flashinfer_baselines.jit_module_specs() names, for sm_90a from the fetched
           FlashInfer wheel, and packs the .so files with a manifest into
           benchmarks/gpu/offline/wheels/flashinfer_aot_sm90a.tar.xz, copied to the GPU host
           with the wheels (git ignores the folder).
  install  (on the GPU host: run_on_device.sh) unpacks them into the installed FlashInfer's
           data/aot if the manifest's FlashInfer version and arch are the GPU's, then loads each
           module in a fresh process (torch, then tvm_ffi.load_module) and removes any that does
           not load, which FlashInfer then JIT-builds as before: at worst the run is as slow as
           without the pack.

    python3 benchmarks/gpu/offline/flashinfer_aot.py build
    python3 benchmarks/gpu/offline/flashinfer_aot.py install --site /tmp/site --arch 9.0a
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEELS = HERE / "wheels"
ARCH = "9.0a"                              # H100 and H200
PACK = WHEELS / "flashinfer_aot_sm90a.tar.xz"
MANIFEST = "manifest.json"


# ---- the pack: pure file work (tests/gpu_tools/test_flashinfer_aot.py)

def pack(modules: dict[str, Path], manifest: dict, out: Path) -> Path:
    """modules: name -> built .so; the tar holds <name>/<name>.so and manifest.json."""
    manifest = dict(manifest, modules={n: _sha256(p) for n, p in sorted(modules.items())})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for name, path in sorted(modules.items()):
            tar.add(path, arcname=f"{name}/{name}.so")
    tmp.replace(out)
    return out


def read_manifest(tar_path: Path) -> dict:
    with tarfile.open(tar_path) as tar:
        return json.load(tar.extractfile(MANIFEST))


def unpack(tar_path: Path, aot_dir: Path, version: str, arch: str) -> tuple[list[str], str]:
    """Installs the pack's modules under aot_dir if it was built for this FlashInfer version and
    arch. Returns (module names installed, why none were if so)."""
    manifest = read_manifest(tar_path)
    for key, want in (("flashinfer", version), ("arch", arch)):
        if manifest.get(key) != want:
            return [], f"built for {key} {manifest.get(key)}, this is {want}"
    names = sorted(manifest["modules"])
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.name != MANIFEST]
        for m in members:           # only <name>/<name>.so of a listed name: nothing else lands
            name = m.name.split("/")[0]
            if not (m.isfile() and name in names and m.name == f"{name}/{name}.so"):
                raise ValueError(f"{tar_path}: unexpected member {m.name}")
        aot_dir.mkdir(parents=True, exist_ok=True)
        tar.extractall(aot_dir, members=members, filter="data")
    bad = [n for n in names if not (aot_dir / n / f"{n}.so").is_file()
           or _sha256(aot_dir / n / f"{n}.so") != manifest["modules"][n]]
    if bad:        # none stays: FlashInfer would load a module present here without a check
        for name in names:
            shutil.rmtree(aot_dir / name, ignore_errors=True)
        raise ValueError(f"{tar_path}: {', '.join(bad)} does not match its checksum")
    return names, ""


def prune_unloadable(aot_dir: Path, names: list[str], loader: str) -> dict[str, str]:
    """Loads every module in one fresh Python (`loader`: code with `path` in scope) and removes
    each that fails, or that the checker did not reach (it crashed); returns name -> error."""
    code = ("import sys\nfor path in sys.argv[1:]:\n    try:\n"
            + "".join(f"        {line}\n" for line in loader.splitlines())
            + "        print('OK', path, flush=True)\n"
            "    except Exception as e:\n"
            "        print('ERR', path, type(e).__name__, str(e).replace(chr(10), ' '), flush=True)\n")
    paths = [str(aot_dir / n / f"{n}.so") for n in names]
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                          timeout=300)
    said = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        path, _, error = rest.partition(" ")
        said[path] = "" if word == "OK" else error
    died = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    failed = {}
    for name, path in zip(names, paths):
        error = said.get(path, f"not reached: the checker died ({died})")
        if error:
            failed[name] = error
            shutil.rmtree(aot_dir / name, ignore_errors=True)
    return failed


# torch first: it loads the CUDA runtime the modules need (libcudart.so.13), as the bench does.
TVM_FFI_LOADER = "import torch, tvm_ffi\ntvm_ffi.load_module(path)"


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- build (any machine with nvcc)

def _one(pattern: str) -> Path:
    found = sorted(WHEELS.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"want one {pattern} in {WHEELS} (bash benchmarks/gpu/offline/fetch_wheels.sh), "
                         f"found {len(found)}")
    return found[0]


def build(out: Path, work: Path, jobs: int) -> None:
    """Installs the fetched FlashInfer (and this Python's build of the same tvm-ffi) into work,
    compiles the bench's modules for ARCH there, and packs them."""
    fi_wheel, ffi_wheel = _one("flashinfer_python-*.whl"), _one("apache_tvm_ffi-*.whl")
    ffi_version = ffi_wheel.name.split("-")[1]
    site, stub, cuda = work / "site", work / "cudastub", Path(os.environ.get("CUDA_HOME",
                                                                              "/usr/local/cuda"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run(pip + [str(fi_wheel), f"apache-tvm-ffi=={ffi_version}", "nvidia-ml-py"],
                   check=True)
    cudaflags = []
    if not (cuda / "include" / "curand_kernel.h").exists():
        # FA3's headers include curand_kernel.h; the GPU host takes it from torch's nvidia-curand.
        subprocess.run(pip + ["nvidia-curand"], check=True)
        cudaflags = [f"-I{next(site.glob('nvidia/*/include'))}"]
    # The link names -lcuda; the driver is the GPU host's (the module's NEEDED libcuda.so.1, if
    # any, resolves there). An empty stub with that soname satisfies the linker here.
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "stub.c").write_text("")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(stub / "libcuda.so"), str(stub / "stub.c")], check=True)
    env = dict(os.environ, PYTHONPATH=f"{site}:{HERE.parents[2]}", CUDA_HOME=str(cuda),
               FLASHINFER_CUDA_ARCH_LIST=ARCH, FLASHINFER_WORKSPACE_BASE=str(work),
               FLASHINFER_EXTRA_LDFLAGS=f"-L{stub}", MAX_JOBS=str(jobs),
               FLASHINFER_EXTRA_CUDAFLAGS=" ".join(cudaflags))
    code = ("import json\nfrom vllm_chunkattn.bench.flashinfer_baselines import jit_module_specs\n"
            "out = {}\nfor spec in jit_module_specs():\n"
            "    spec.build(verbose=False)\n    out[spec.name] = str(spec.jit_library_path)\n"
            "    print('built', spec.name, flush=True)\n"
            "import flashinfer, tvm_ffi\n"
            "print('RESULT', json.dumps({'modules': out, 'flashinfer': flashinfer.__version__,"
            " 'tvm_ffi': tvm_ffi.__version__}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          text=True)
    print(proc.stdout, end="")
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit("flashinfer_aot build failed (above)")
    result = json.loads(line[7:])
    nvcc = subprocess.run([str(cuda / "bin" / "nvcc"), "--version"], capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    pack({n: Path(p) for n, p in result["modules"].items()},
         {"flashinfer": result["flashinfer"], "tvm_ffi": result["tvm_ffi"], "arch": ARCH,
          "nvcc": nvcc}, out)
    print(f"packed {len(result['modules'])} modules: {out} ({out.stat().st_size >> 20} MiB)")


def install(site: Path, tar_path: Path, arch: str) -> int:
    """Prints one summary line; always exits 0: without the modules FlashInfer builds them."""
    if not tar_path.exists():
        print(f"not carried ({tar_path.name}): FlashInfer builds its modules on the device")
        return 0
    sys.path.insert(0, str(site))
    try:
        import flashinfer                              # the carried one
    except Exception as e:                             # the bench stage then says more
        print(f"not used: import flashinfer failed: {type(e).__name__}: {e}")
        return 0
    aot_dir = Path(flashinfer.__file__).parent / "data" / "aot"
    stamp, digest = aot_dir / ".pack_sha256", _sha256(tar_path)
    if stamp.exists() and stamp.read_text() == digest:       # an earlier run on this host
        print(f"ready (installed by an earlier run: {stamp.with_suffix('.txt').read_text()})")
        return 0
    try:
        names, why = unpack(tar_path, aot_dir, flashinfer.__version__, arch)
    except (ValueError, OSError, tarfile.TarError) as e:
        print(f"not used: {e}")
        return 0
    if not names:
        print(f"not used: {why}")
        return 0
    failed = prune_unloadable(aot_dir, names, TVM_FFI_LOADER)
    manifest = read_manifest(tar_path)
    line = (f"{len(names) - len(failed)} of {len(names)} modules ready ({manifest['nvcc']}, "
            f"{arch})" + "".join(f"; {n[:40]}... failed to load, left to the JIT build: {e}"
                                 for n, e in failed.items()))
    stamp.write_text(digest)
    stamp.with_suffix(".txt").write_text(line)
    print(line)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=PACK)
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    i = sub.add_parser("install")
    i.add_argument("--site", type=Path, required=True, help="where the carried FlashInfer is")
    i.add_argument("--tar", type=Path, default=PACK)
    i.add_argument("--arch", required=True, help="FLASHINFER_CUDA_ARCH_LIST of the device")
    a = p.parse_args(argv)
    if a.cmd == "build":
        with tempfile.TemporaryDirectory(prefix="flashinfer-aot-") as work:
            build(a.out, Path(work), a.jobs)
        return 0
    return install(a.site, a.tar, a.arch)


if __name__ == "__main__":
    sys.exit(main())
