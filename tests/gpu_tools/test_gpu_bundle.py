"""The vLLM bundle for a GPU host without network (benchmarks/gpu/offline/bundle.py,
install_bundle.sh): the committed manifest is self-consistent, the keep/carry decision follows the
image's versions, and parts cut here reassemble through the host installer's own code (collect,
marker, unpack)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OFFLINE = REPO / "benchmarks" / "gpu" / "offline"
sys.path.insert(0, str(OFFLINE))
sys.path.insert(1, str(OFFLINE.parent))     # import_probe.py, beside run_on_device.sh
import bundle  # noqa: E402
import device_image  # noqa: E402
import recompress  # noqa: E402

INSTALLER = OFFLINE / "install_bundle.sh"


def _manifest(path: Path) -> dict[str, list[list[str]]]:
    rows: dict[str, list[list[str]]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            rows.setdefault(line.split()[0], []).append(line.split()[1:])
    return rows


@pytest.fixture(params=list(bundle.RELEASES))
def release(request, monkeypatch):
    """Each vLLM release's committed bundle in turn (bundle.select, undone after the test)."""
    for name in ("RELEASE", "BUNDLE", "MANIFEST"):
        monkeypatch.setattr(bundle, name, getattr(bundle, name))
    bundle.select(request.param)
    return request.param


# Per release: the torch its closure was found beside, and the groups its parts hold.
RELEASE_FACTS = {"0.32.0": ("2.13.0", ["core", "torch", "nccl"]),      # vLLM's own pin
                 "0.33.0": (device_image.IMAGE_VERSIONS["torch"], ["core"])}   # the image's


def test_committed_manifest_is_consistent(release):
    m = _manifest(bundle.MANIFEST)
    parts = [int(p[2]) for p in m["part"]]
    assert all(0 < n <= bundle.PART_BYTES for n in parts)
    assert all(n == bundle.PART_BYTES for n in parts[:-1])        # only the last part is short
    offset = 0
    for _, off, length, _ in m["group"]:                            # groups back to back
        assert int(off) == offset
        offset += int(length)
    assert sum(parts) == offset
    assert [p[0] for p in m["part"]] == [f"c{i:02d}" for i in range(1, len(parts) + 1)]
    closure = {name: version for name, version in m["closure"]}
    torch_version, groups = RELEASE_FACTS[release]
    assert closure["vllm"] == release and closure["torch"] == torch_version
    wheels = [w[-1] for w in m["wheel"]]
    assert len(wheels) == len(set(wheels))
    for w in wheels:                     # every wheel installs on CPython 3.12, x86-64 Linux
        tags = w[:-4].split("-")[-3:]
        assert tags[0].startswith(("cp312", "cp3", "py3", "py2.py3")), w
        assert tags[2] == "any" or "x86_64" in tags[2], w
    carried = {w.split("-")[0].lower() for w in wheels}
    for name in device_image.OPTIONAL_MODULES:      # optional imports never travel
        assert name.replace(".", "_") not in carried
    # vLLM first on the image's torch; torch's stack, then NCCL, only if the host asks
    assert [g[0] for g in m["group"]] == groups
    by_group = {}
    for group, _, _, _, fname in m["wheel"]:
        by_group.setdefault(group, set()).add(fname.split("-")[0])
    assert by_group.get("torch", bundle.TORCH_STACK) == bundle.TORCH_STACK
    assert not by_group["core"] & bundle.TORCH_STACK and "vllm" in by_group["core"]
    assert any(f"vllm-{release}-" in w for w in wheels)


def test_a_closure_that_breaks_its_own_pins_is_refused():
    """The closure's venv must hold what vLLM pins: vLLM 0.33's first bundle carried
    apache-tvm-ffi 0.1.15.post2 (installed there beside vLLM with --no-deps) where vLLM pins
    ==0.1.11. Torch's stack at the image's version is no conflict where no torch group travels."""
    def dist(name, version, *requires):
        return {"name": name, "version": version, "requires": list(requires)}
    dists = {"vllm": dist("vllm", "0.33.0", "apache-tvm-ffi==0.1.11", "torch==2.14.0",
                          'orjson>=9; python_version < "3.0"', "numpy>=2"),
             "apache-tvm-ffi": dist("apache-tvm-ffi", "0.1.15.post2"),
             "torch": dist("torch", "2.11.0"), "orjson": dist("orjson", "3.13.0"),
             "numpy": dist("numpy", "?")}
    assert bundle.conflicts(dists, ("core",)) == [
        "apache-tvm-ffi 0.1.15.post2: vllm needs ==0.1.11"]
    assert bundle.conflicts(dists, ("core", "torch", "nccl")) == [
        "apache-tvm-ffi 0.1.15.post2: vllm needs ==0.1.11", "torch 2.11.0: vllm needs ==2.14.0"]
    dists["apache-tvm-ffi"]["version"] = "0.1.11"
    assert bundle.conflicts(dists, ("core",)) == []


def test_plan_carries_what_the_image_lacks_or_breaks(monkeypatch):
    monkeypatch.setattr(bundle, "IMAGE_PACKAGES", ["torch", "numpy", "requests", "six"])
    monkeypatch.setattr(bundle, "IMAGE_VERSIONS", {"torch": "2.11.0", "numpy": "2.5.2"})
    dists = {
        "vllm": {"name": "vllm", "version": "0.32.0",
                 "requires": ["torch==2.13.0", "numpy", "requests>=2.33.0", "six",
                              "fastapi; extra == 'server'", "pywin32; sys_platform == 'win32'"]},
        "torch": {"name": "torch", "version": "2.13.0", "requires": ["numpy>=2"]},
        "numpy": {"name": "numpy", "version": "2.3.5", "requires": []},
        "requests": {"name": "requests", "version": "2.34.2", "requires": []},
        "six": {"name": "six", "version": "1.17.0", "requires": []},
    }
    carry, reserve, reuse = bundle.plan(dists)
    assert [(n, v) for n, v, _ in carry] == [("torch", "2.13.0"), ("vllm", "0.32.0")]
    assert [(r[0], r[3]) for r in reserve] == [("requests", ">=2.33.0")]
    assert {(n, v) for n, v, _ in reuse} == {("numpy", "2.5.2"), ("six", "?")}


def _installer(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALLER), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def _wheel(path: Path, rng, files: int = 3) -> Path:
    """A small installable wheel (random payload, so it does not compress away)."""
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    members = {f"{name}/__init__.py": f"VALUE = {rng.randrange(1 << 30)}\n".encode(),
               **{f"{name}/blob{i}.bin": rng.randbytes(rng.randrange(1000, 6000))
                  for i in range(files)},
               f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in members.items():
            z.writestr(zipfile.ZipInfo(arc, (2024, 1, 2, 3, 4, 6)), data)
        z.writestr(f"{info}/RECORD", "".join(f"{a},,\n" for a in [*members, f"{info}/RECORD"]))
    return path


def _members(whl: Path) -> list[tuple]:
    with zipfile.ZipFile(whl) as z:
        return [(i.filename, i.date_time, i.external_attr, z.read(i)) for i in z.infolist()]


@pytest.mark.parametrize("part_bytes", [4096, 7000])
def test_parts_reassemble_through_the_installer(tmp_path, monkeypatch, part_bytes):
    """bundle._pack's parts, copied and collected one at a time, unpack through the installer's
    own code: big wheels re-compressed and back, the torch group optional (the image's torch
    stands in) and the nccl group optional after it (the shim stands in)."""
    bundle_dir = tmp_path / "bundle"
    monkeypatch.setattr(bundle, "BUNDLE", bundle_dir)
    monkeypatch.setattr(bundle, "PART_BYTES", part_bytes)
    monkeypatch.setattr(bundle, "XZ_MIN", 8000)
    rng = __import__("random").Random(part_bytes)
    groups = {"core": [_wheel(tmp_path / f"core{i}-1.0-py3-none-any.whl", rng, files=1 + 2 * i)
                       for i in range(3)],
              "torch": [_wheel(tmp_path / "torch0-1.0-py3-none-any.whl", rng, files=3)],
              "nccl": [_wheel(tmp_path / "nccl0-1.0-py3-none-any.whl", rng, files=4)]}
    big = {w.name for g, ws in groups.items() if g not in bundle.GROUPS_AS_SHIPPED for w in ws
           if w.stat().st_size >= bundle.XZ_MIN}
    assert "core2-1.0-py3-none-any.whl" in big and "core0-1.0-py3-none-any.whl" not in big
    assert groups["nccl"][0].stat().st_size >= bundle.XZ_MIN       # big, but travels as shipped
    bundle_dir.mkdir()
    wheel_lines, layout = bundle._pack({g: [("wheels", w) for w in ws] for g, ws in groups.items()})
    assert [ln.split()[-1] for ln in wheel_lines] == [w.name for ws in groups.values() for w in ws]
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("# test\n" + "\n".join(layout) + "\n")
    rows = [ln.split()[1:] for ln in layout if ln.startswith("part ")]
    ends = {ln.split()[1]: int(ln.split()[2]) + int(ln.split()[3])
            for ln in layout if ln.startswith("group ")}
    core_parts = (ends["core"] + part_bytes - 1) // part_bytes
    torch_parts = (ends["torch"] + part_bytes - 1) // part_bytes
    assert len(rows) > torch_parts > core_parts      # torch and nccl need parts of their own

    carried = tmp_path / "carried"          # what one copy holds: a single cNN folder
    env = {"VLLM_MANIFEST": str(manifest), "VLLM_BUNDLE_DIR": str(carried),
           "VLLM_PARTS": str(tmp_path / "parts"), "VLLM_WHEELS": str(tmp_path / "wheels"),
           "VLLM_MARKER": str(tmp_path / "marker")}
    unpacked = tmp_path / "wheels" / "wheels"

    def check_unpacked(names):
        assert sorted(p.name for p in unpacked.iterdir()) == sorted(names)
        for ws in groups.values():
            for w in ws:
                if w.name not in names:
                    continue
                got = unpacked / w.name
                if w.name in big:           # stored, not deflated: same members, same order
                    assert _members(got) == _members(w)
                    assert {i.compress_type for i in zipfile.ZipFile(got).infolist()} == {0}
                else:
                    assert got.read_bytes() == w.read_bytes()

    for i, (folder, name, _, _) in enumerate(rows):
        (carried / folder).mkdir(parents=True)
        (carried / folder / name).write_bytes((bundle_dir / folder / name).read_bytes())
        out = _installer(env, "collect")
        assert out.returncode == 0, out.stdout + out.stderr
        assert ("no marker" if i == 0 else "marker found") in out.stdout
        assert f"part {name} ok" in out.stdout
        for f in carried.iterdir():             # the next copy brings another folder
            for p in f.iterdir():
                p.unlink()
            f.rmdir()
        if i + 1 == core_parts:                 # core complete: vLLM on the image's torch
            assert "group core: complete" in out.stdout
            assert "group torch: missing" in out.stdout and "image's torch" in out.stdout
            out = _installer(env, "unpack")
            assert out.returncode == 0, out.stdout + out.stderr
            assert "torch group not carried" in out.stdout and "nccl group" not in out.stdout
            check_unpacked([w.name for w in groups["core"]])
        if i + 1 == torch_parts:                # torch complete, nccl not: the shim's case
            assert "group torch: complete" in out.stdout
            assert "group nccl: missing" in out.stdout and "nccl_compat.c" in out.stdout
            out = _installer(env, "unpack")
            assert out.returncode == 0, out.stdout + out.stderr
            assert "nccl group not carried" in out.stdout
            check_unpacked([w.name for g in ("core", "torch") for w in groups[g]])
    assert "group core: complete" in out.stdout and "group nccl: complete" in out.stdout
    folder, name = rows[0][:2]                              # an earlier copy's folder left over
    (carried / folder).mkdir(parents=True)
    (carried / folder / name).write_bytes((bundle_dir / folder / name).read_bytes())
    out = _installer(env, "collect")
    assert out.returncode == 0 and " ok (" not in out.stdout     # not copied or checked again

    out = _installer(env, "unpack")
    assert out.returncode == 0, out.stdout + out.stderr
    check_unpacked([w.name for ws in groups.values() for w in ws])

    first = tmp_path / "parts" / rows[0][1]                    # one flipped byte is refused
    data = bytearray(first.read_bytes())
    data[100] ^= 1
    first.write_bytes(data)
    out = _installer(env, "unpack")
    assert out.returncode != 0 and "BAD checksum" in out.stdout


def test_rebuild_from_manifest_checks_wheels_and_rewrites_only_the_packing(tmp_path, monkeypatch,
                                                                          capsys):
    """--from-manifest: the manifest's wheels (checksums checked) packed again; parts packed
    differently (another liblzma) rewrite only the group / part lines, which the host reads."""
    bundle_dir = tmp_path / "bundle"
    wheels = bundle_dir / "wheels"
    wheels.mkdir(parents=True)
    monkeypatch.setattr(bundle, "BUNDLE", bundle_dir)
    monkeypatch.setattr(bundle, "PART_BYTES", 5000)
    monkeypatch.setattr(bundle, "XZ_MIN", 8000)
    monkeypatch.setattr(bundle, "_download", lambda pins, dest: None)    # already here
    rng = __import__("random").Random(3)
    members = [("core", _wheel(wheels / "aaa-1.0-py3-none-any.whl", rng, 5)),
               ("core", _wheel(wheels / "bbb-2.0-py3-none-any.whl", rng, 1)),
               ("nccl", _wheel(wheels / "ccc-3.0-py3-none-any.whl", rng, 2))]
    lines, layout = bundle._pack({"core": [("wheels", w) for g, w in members if g == "core"],
                                  "nccl": [("wheels", w) for g, w in members if g == "nccl"]})
    manifest = tmp_path / "manifest.txt"
    monkeypatch.setattr(bundle, "MANIFEST", manifest)
    monkeypatch.setattr(bundle, "REPO", tmp_path)
    stale = [ln.replace(ln.split()[-1], "0" * 64) for ln in layout]      # packed elsewhere
    manifest.write_text("\n".join(["# head", "closure aaa 1.0", *lines, *stale]) + "\n")
    bundle._rebuild()
    assert "rewritten" in capsys.readouterr().out
    text = manifest.read_text().splitlines()
    assert text[:2 + len(lines)] == ["# head", "closure aaa 1.0", *lines]
    assert [ln for ln in text if ln.startswith(("group ", "part "))] == layout
    bundle._rebuild()                                   # the same bytes again: nothing to rewrite
    assert "all match the manifest" in capsys.readouterr().out

    _wheel(wheels / "bbb-2.0-py3-none-any.whl", rng, 1)     # not the registry's wheel any more
    with pytest.raises(SystemExit, match="bbb-2.0-py3-none-any.whl: checksum differs"):
        bundle._rebuild()


def test_recompressed_wheel_is_deterministic_and_installs(tmp_path, monkeypatch):
    """Several xz streams back to back inflate to the stored wheel, the same bytes every build
    (the manifest's checksums), and pip installs that wheel as it would the original."""
    monkeypatch.setattr(recompress, "BLOCK", 4096)
    whl = _wheel(tmp_path / "demo_pkg-1.0-py3-none-any.whl", __import__("random").Random(1), 6)
    first = recompress.recompressed(whl, tmp_path / "a")
    again = recompress.recompressed(whl, tmp_path / "b")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes().count(b"\xfd7zXZ\x00") > 3         # one stream per 4 KiB block
    assert first.stat().st_size < whl.stat().st_size * 1.2
    dest = tmp_path / "device"
    dest.mkdir()
    (dest / first.name).write_bytes(first.read_bytes())
    out = subprocess.run([sys.executable, str(OFFLINE / "recompress.py"), "inflate", str(dest)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and f"inflated {whl.name}" in out.stdout, out.stderr
    stored = dest / whl.name
    assert not (dest / first.name).exists() and _members(stored) == _members(whl)
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--target", str(site), str(stored)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    value = subprocess.run([sys.executable, "-c", "import demo_pkg; print(demo_pkg.VALUE)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert value.stdout.strip() == _members(whl)[0][3].decode().split("= ")[1].strip()

    damaged = bytearray(first.read_bytes())          # xz's CRC catches a flipped byte
    damaged[len(damaged) // 2] ^= 0x40
    (dest / first.name).write_bytes(damaged)
    out = subprocess.run([sys.executable, str(OFFLINE / "recompress.py"), "inflate", str(dest)],
                         capture_output=True, text=True)
    assert out.returncode != 0


def test_nccl_compat_defines_the_missing_symbols_and_fails_loudly(tmp_path):
    """The shim exports exactly the 8 NCCL 2.29 names that torch 2.13's libtorch_cuda.so needs and
    NCCL 2.28.9 lacks (nm -D of both wheels, device_image.py's SHARED_LIBS note); a call returns
    ncclInvalidUsage and names itself on stderr; `env` preloads it only when installed."""
    so = tmp_path / "site" / "nccl_compat.so"
    so.parent.mkdir()
    env = {"VLLM_SITE": str(so.parent)}
    assert "LD_PRELOAD" not in _installer(env, "env").stdout
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(so), str(OFFLINE / "nccl_compat.c")],
                   check=True)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True)
    exported = {ln.split()[-1] for ln in nm.stdout.splitlines() if " T " in ln}
    assert exported == {"ncclCommSuspend", "ncclCommResume", "ncclCommMemStats", "ncclSignal",
                        "ncclWaitSignal", "ncclPutSignal", "ncclGetPeerDevicePointer",
                        "ncclGetLsaMultimemDevicePointer"}
    call = subprocess.run([sys.executable, "-c", f"import ctypes; "
                           f"print(ctypes.CDLL({str(so)!r}).ncclCommResume(None))"],
                          capture_output=True, text=True)
    assert call.stdout.strip() == "5"                        # ncclInvalidUsage
    assert "ncclCommResume is not in this NCCL" in call.stderr
    assert f"export LD_PRELOAD={so}" in _installer(env, "env").stdout


def test_installer_script_parses():
    assert subprocess.run(["bash", "-n", str(INSTALLER)]).returncode == 0
    # its check runs on the GPU host only: at least it must compile
    compile((OFFLINE / "install_check.py").read_text(), "install_check.py", "exec")


def test_the_installer_takes_each_releases_bundle(tmp_path, release):
    """VLLM_RELEASE gives install_bundle.sh the manifest and the carried folder bundle.py writes
    for that release (RELEASES): a part in that folder is checked against that manifest, and with
    nothing carried collect names exactly that manifest's groups and parts as missing. A release
    without a bundle is refused."""
    repo = tmp_path / "repo"                      # the scripts beside both manifests, no parts
    (repo / "benchmarks" / "gpu" / "offline").mkdir(parents=True)
    manifests = [manifest for manifest, _, _ in bundle.RELEASES.values()]
    for f in ["offline/install_bundle.sh", "detached_bench.sh", *(f"offline/{m}" for m in manifests)]:
        (repo / "benchmarks" / "gpu" / f).write_bytes((OFFLINE.parent / f).read_bytes())
    script = repo / "benchmarks" / "gpu" / "offline" / "install_bundle.sh"
    env = {**os.environ, "PYTHON": sys.executable, "VLLM_RELEASE": release,
           "VLLM_PARTS": str(tmp_path / "parts"), "VLLM_MARKER": str(tmp_path / "marker"),
           "BENCH_STATE": str(tmp_path / "bench")}
    for name in ("VLLM_MANIFEST", "VLLM_BUNDLE_DIR"):
        env.pop(name, None)

    def collect() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), "collect"], capture_output=True, text=True,
                              env=env)

    carried = repo / bundle.BUNDLE.name / "c01"
    carried.mkdir(parents=True)
    (carried / "bundle.part01").write_bytes(b"not the manifest's part")
    out = collect()
    assert out.returncode != 0 and "BAD checksum: bundle.part01" in out.stdout, out.stdout
    (carried / "bundle.part01").unlink()
    out = collect()
    assert out.returncode == 0, out.stdout + out.stderr
    m = _manifest(bundle.MANIFEST)
    groups = re.findall(r"group (\w+): missing ([\w. ]+?) ?(?:\(|$)", out.stdout, re.M)
    assert [g for g, _ in groups] == [g[0] for g in m["group"]]
    named = [p for _, parts in groups for p in parts.split()]
    assert sorted(set(named)) == [p[1] for p in m["part"]]
    env["VLLM_RELEASE"] = "0.31.0"
    out = collect()
    assert out.returncode == 2 and "no bundle for it" in out.stdout


def test_every_part_fits_the_transfer_limit_beside_the_checkout(release):
    """A transfer that carries the checkout (tracked files and untracked ones git does not
    ignore) beside one part must stay under the default transfer limit (64 MiB): a big file
    committed or left lying in the checkout would make every such transfer too big."""
    tree, transfer = bundle.largest_transfer_bytes()
    assert tree > 1 << 20                       # the tree was counted (sources, results, models)
    assert transfer < bundle.TRANSFER_BYTES, (
        f"the tree ({tree / 2**20:.2f} MiB) + the largest part come to {transfer / 2**20:.2f} MiB: "
        f"keep big files out of the checkout or git-ignore them")


def test_the_part_size_and_the_transfer_limit_are_flags(monkeypatch):
    """--part-mib / --transfer-mib set what build, resplit and status cut and check against (a
    transfer limit of the user's choosing); closure takes neither."""
    for name in ("RELEASE", "BUNDLE", "MANIFEST", "PART_BYTES", "TRANSFER_BYTES"):
        monkeypatch.setattr(bundle, name, getattr(bundle, name))
    seen = []
    monkeypatch.setattr(bundle, "resplit",
                        lambda args: seen.append((bundle.PART_BYTES, bundle.TRANSFER_BYTES)))
    bundle.main(["resplit"])
    bundle.main(["resplit", "--part-mib", "20", "--transfer-mib", "32"])
    assert seen == [(50 << 20, 64 << 20), (20 << 20, 32 << 20)]
    with pytest.raises(SystemExit):
        bundle.main(["closure", "--python", "python3", "--part-mib", "20"])


def test_env_keeps_the_v2_samplers_choice_off_flashinfer(tmp_path):
    """FlashInfer does not travel (the manifest), and vLLM 0.32's V2 model runner imports its
    FlashInfer attention backend to choose a sampler on CUDA: a GPU server without FlashInfer
    dies there. Under `install_bundle.sh env` that choice is made without FlashInfer; without
    the export it imports the missing module, as on the GPU host."""
    pytest.importorskip("vllm")
    manifest = _manifest(OFFLINE / "bundle_manifest.txt")
    shipped = [" ".join(row).lower() for kind in ("wheel", "reserve") for row in manifest[kind]]
    assert any("vllm-0.32.0" in row for row in shipped)
    assert not any("flashinfer" in row for row in shipped)
    probe = ("import vllm.v1.sample.ops.topk_topp_sampler as s\n"
             "s.current_platform.is_cuda = lambda: True          # the device's platform\n"
             "print('sampler', s.flashinfer_sampler_supported())\n")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    env_lines = _installer({"VLLM_SITE": str(tmp_path / "site")}, "env").stdout
    scrubbed = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}

    def run(exports: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'{exports}\nexport PYTHONPATH="{REPO}"\n'
                               f'"{sys.executable}" "{script}"'],
                              capture_output=True, text=True, env=scrubbed, timeout=300)

    with_env = run("\n".join(ln for ln in env_lines.splitlines() if "PYTHONPATH" not in ln))
    assert with_env.returncode == 0, with_env.stderr[-2000:]
    assert "sampler False" in with_env.stdout
    without = run("")
    assert without.returncode != 0 and "No module named 'flashinfer'" in without.stderr


def test_resplit_cuts_the_same_bytes_at_a_new_part_size(tmp_path, monkeypatch):
    """`bundle.py resplit`: the built parts cut again (the part size shrank when the tree that
    travels beside each part outgrew 4 MiB): the groups' bytes and checksums are unchanged, the
    manifest's part lines and layout comments are the new cut's, its other lines stay."""
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    monkeypatch.setattr(bundle, "BUNDLE", bundle_dir)
    monkeypatch.setattr(bundle, "MANIFEST", tmp_path / "manifest.txt")
    monkeypatch.setattr(bundle, "REPO", tmp_path)
    monkeypatch.setattr(bundle, "PART_BYTES", 7000)
    monkeypatch.setattr(bundle, "XZ_MIN", 1 << 30)
    rng = __import__("random").Random(11)
    groups = {"core": [("wheels", _wheel(tmp_path / f"c{i}-1.0-py3-none-any.whl", rng, 3)) for i in range(2)],
              "nccl": [("wheels", _wheel(tmp_path / "n0-1.0-py3-none-any.whl", rng, 4))]}
    wheel_lines, layout = bundle._pack(groups)
    bundle.MANIFEST.write_text("\n".join(["# head", *bundle._layout_comments(wheel_lines, layout),
                                          "# tail", "closure x 1", *wheel_lines, *layout]) + "\n")
    before = b"".join((bundle_dir / ln.split()[1] / ln.split()[2]).read_bytes()
                      for ln in layout if ln.startswith("part "))
    monkeypatch.setattr(bundle, "PART_BYTES", 4096)
    bundle.resplit(None)
    m = _manifest(bundle.MANIFEST)
    sizes = [int(p[2]) for p in m["part"]]
    assert len(sizes) == -(-len(before) // 4096) and all(n == 4096 for n in sizes[:-1])
    after = b"".join((bundle_dir / f / name).read_bytes() for f, name, *_ in m["part"])
    assert after == before                                   # the same stream, cut elsewhere
    assert sorted(p.name for p in bundle_dir.glob("c[0-9]*")) == [p[0] for p in m["part"]]
    for _, name, size, sha in m["part"]:
        assert hashlib.sha256((bundle_dir / _ / name).read_bytes()).hexdigest() == sha
    for _, off, n, sha in m["group"]:                          # groups untouched, still whole
        assert hashlib.sha256(after[int(off):int(off) + int(n)]).hexdigest() == sha
    text = bundle.MANIFEST.read_text().splitlines()
    assert text[0] == "# head" and "# tail" in text and "closure x 1" in text
    assert sum(ln.startswith("# group ") for ln in text) == 2
    assert f"# {len(sizes)} parts of <= 0 MiB: {bundle.BUNDLE.name}/c01 .. c{len(sizes):02d}, a folder each" in text
    last = (int(m["group"][-1][1]) + int(m["group"][-1][2]) - 1) // 4096 + 1
    assert any(ln.startswith("# group nccl:") and ln.split(" (")[0].endswith(f"-{last}") for ln in text)
    (bundle_dir / "c01" / "bundle.part01").write_bytes(b"x")   # a part that is not the manifest's
    with pytest.raises(SystemExit, match="not the manifest's part"):
        bundle.resplit(None)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_the_import_probe_finds_its_modules_in_each_vllm_the_cuda_extra_allows(version):
    """bundle.py's closure imports import_probe.SERVE_MODULES and builds `vllm serve`'s parsers;
    a module a vLLM version moved fails the probe there (0.33 moved make_arg_parser from
    entrypoints/launchers/ to entrypoints/common/). Read from each version's sources; the
    compiled extensions (`_C...`) have none there."""
    import import_probe
    from vllm_sources import vllm_sources

    root = vllm_sources(version) / "pkg"

    def source(module: str) -> Path | None:
        path = root.joinpath(*module.split("."))
        return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.exists()),
                    None)

    missing = [m for m in import_probe.SERVE_MODULES if m.startswith("vllm.")
               and not m.rsplit(".", 1)[-1].startswith("_C") and source(m) is None]
    assert missing == []
    parsers = [m for m in import_probe.SERVE_ARG_PARSER
               if source(m) and "\ndef make_arg_parser(" in source(m).read_text()]
    assert parsers, f"no make_arg_parser in vLLM {version}'s {import_probe.SERVE_ARG_PARSER}"
