"""FlashInfer's modules compiled ahead of time (benchmarks/gpu/offline/flashinfer_aot.py): what
the GPU host installs from a pack, what it refuses, and that a module that does not load is
removed (so FlashInfer JIT-builds it as it would without the pack). Shared libraries made here
with gcc stand in for the modules; the loader is ctypes (the GPU host's is tvm_ffi.load_module
after torch)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

OFFLINE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "offline"
sys.path.insert(0, str(OFFLINE))
import flashinfer_aot as aot  # noqa: E402

CTYPES_LOADER = "import ctypes\nctypes.CDLL(path)"
META = {"flashinfer": "0.6.14", "tvm_ffi": "0.1.15.post2", "arch": "9.0a", "nvcc": "V13.0.88"}


def _shared_lib(tmp: Path, name: str, needs: str | None = None) -> Path:
    """A .so exporting one function; with `needs`, linked against a library that then vanishes
    (the way a module built against a library the device lacks fails to load)."""
    src = tmp / f"{name}.c"
    src.write_text(f"int {name}_answer(void) {{ return 42; }}\n")
    out = tmp / f"{name}.so"
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src)]
    if needs:
        dep = tmp / f"lib{needs}.so"
        (tmp / "dep.c").write_text("int dep(void) { return 1; }\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(dep), str(tmp / "dep.c")],
                       check=True)
        cmd += ["-Wl,--no-as-needed", f"-L{tmp}", f"-l{needs}"]
    subprocess.run(cmd, check=True)
    if needs:
        dep.unlink()
    return out


@pytest.fixture
def modules(tmp_path):
    built = tmp_path / "built"
    built.mkdir()
    return {"cascade": _shared_lib(built, "cascade"),
            "batch_prefill_sm90": _shared_lib(built, "prefill", needs="chunkattn_gone")}


def test_a_pack_installs_its_modules_where_flashinfer_looks_and_drops_one_that_fails_to_load(
        tmp_path, modules):
    tar = aot.pack(modules, META, tmp_path / "pack.tar.xz")
    aot_dir = tmp_path / "site" / "flashinfer" / "data" / "aot"
    names, why = aot.unpack(tar, aot_dir, "0.6.14", "9.0a")
    assert (names, why) == (["batch_prefill_sm90", "cascade"], "")
    for name, src in modules.items():     # <aot>/<name>/<name>.so: FlashInfer's JitSpec.aot_path
        assert (aot_dir / name / f"{name}.so").read_bytes() == src.read_bytes()
    failed = aot.prune_unloadable(aot_dir, names, CTYPES_LOADER)
    assert list(failed) == ["batch_prefill_sm90"]
    assert "libchunkattn_gone.so" in failed["batch_prefill_sm90"]
    assert not (aot_dir / "batch_prefill_sm90").exists()     # left to FlashInfer's JIT build
    assert (aot_dir / "cascade" / "cascade.so").exists()


def test_a_crashing_checker_removes_the_modules_it_did_not_reach(tmp_path, modules):
    tar = aot.pack(modules, META, tmp_path / "pack.tar.xz")
    aot_dir = tmp_path / "aot"
    names, _ = aot.unpack(tar, aot_dir, "0.6.14", "9.0a")
    crash_on_second = ("import os\nif path.endswith('cascade.so'):\n    os.abort()\n"
                       "import ctypes\nctypes.CDLL(path)")
    failed = aot.prune_unloadable(aot_dir, names, crash_on_second)
    assert sorted(failed) == ["batch_prefill_sm90", "cascade"]     # one failed, one not reached
    assert "not reached" in failed["cascade"]
    assert not any(aot_dir.iterdir())


@pytest.mark.parametrize("version, arch, why", [
    ("0.6.15", "9.0a", "built for flashinfer 0.6.14, this is 0.6.15"),
    ("0.6.14", "10.0a", "built for arch 9.0a, this is 10.0a"),
])
def test_a_pack_for_another_flashinfer_or_gpu_is_not_installed(tmp_path, modules, version, arch,
                                                              why):
    tar = aot.pack(modules, META, tmp_path / "pack.tar.xz")
    aot_dir = tmp_path / "aot"
    assert aot.unpack(tar, aot_dir, version, arch) == ([], why)
    assert not aot_dir.exists()


def _tar_with(tmp_path: Path, members: dict[str, bytes], manifest: dict) -> Path:
    out = tmp_path / "odd.tar.xz"
    with tarfile.open(out, "w:xz") as tar:
        for name, data in {aot.MANIFEST: json.dumps(manifest).encode(), **members}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_a_pack_with_a_member_outside_its_modules_is_refused_before_anything_lands(tmp_path):
    manifest = dict(META, modules={"cascade": "0" * 64})
    tar = _tar_with(tmp_path, {"cascade/cascade.so": b"x", "../outside.so": b"x"}, manifest)
    with pytest.raises(ValueError, match="unexpected member ../outside.so"):
        aot.unpack(tar, tmp_path / "aot", "0.6.14", "9.0a")
    assert not (tmp_path / "aot").exists() and not (tmp_path / "outside.so").exists()


def test_a_module_that_does_not_match_its_checksum_fails_the_whole_pack(tmp_path, modules):
    import hashlib
    sums = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in modules.items()}
    manifest = dict(META, modules=sums)
    tar = _tar_with(tmp_path, {"cascade/cascade.so": b"truncated", "batch_prefill_sm90/"
                               "batch_prefill_sm90.so": modules["batch_prefill_sm90"].read_bytes()},
                    manifest)
    with pytest.raises(ValueError, match="cascade does not match its checksum"):
        aot.unpack(tar, tmp_path / "aot", "0.6.14", "9.0a")
    assert not any((tmp_path / "aot").iterdir())     # the intact one is not left unchecked


def test_install_without_a_pack_says_flashinfer_builds_on_the_device(tmp_path, capsys):
    assert aot.install(tmp_path, tmp_path / "missing.tar.xz", "9.0a") == 0
    assert "not carried" in capsys.readouterr().out
