"""The vLLM bundle for the lent GPU (benchmarks/gpu/bundle.py, install_bundle.sh): the committed
manifest is self-consistent, the keep/carry decision follows the image's versions, and parts cut
here reassemble through the device installer's own code (collect, marker, unpack)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))
import bundle  # noqa: E402

INSTALLER = GPU / "install_bundle.sh"


def _manifest(path: Path) -> dict[str, list[list[str]]]:
    rows: dict[str, list[list[str]]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            rows.setdefault(line.split()[0], []).append(line.split()[1:])
    return rows


def test_committed_manifest_is_consistent():
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
    assert closure["vllm"] == "0.32.0" and closure["torch"] == "2.13.0"
    wheels = [w[-1] for w in m["wheel"]]
    assert len(wheels) == len(set(wheels))
    for w in wheels:                     # every wheel installs on CPython 3.12, x86-64 Linux
        tags = w[:-4].split("-")[-3:]
        assert tags[0].startswith(("cp312", "cp3", "py3", "py2.py3")), w
        assert tags[2] == "any" or "x86_64" in tags[2], w
    carried = {w.split("-")[0].lower() for w in wheels}
    for name in bundle.OPTIONAL_MODULES:            # optional imports never travel
        assert name.replace(".", "_") not in carried


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


@pytest.mark.parametrize("part_bytes", [4096, 7000])
def test_parts_reassemble_through_the_installer(tmp_path, monkeypatch, part_bytes):
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    monkeypatch.setattr(bundle, "BUNDLE", bundle_dir)
    monkeypatch.setattr(bundle, "PART_BYTES", part_bytes)
    rng = __import__("random").Random(part_bytes)
    groups, tars, lines, offset = {"core": 3, "nccl": 1}, [], [], 0
    for group, n in groups.items():
        files = []
        for i in range(n):
            whl = tmp_path / f"{group}_{i}-1.0-py3-none-any.whl"
            whl.write_bytes(rng.randbytes(rng.randrange(1000, 9000)))
            files.append((f"wheels/{whl.name}", whl))
        sums = tmp_path / f"{group}.sums"
        sums.write_text("".join(f"{bundle._sha256(p)}  {a}\n" for a, p in sorted(files)))
        tar = tmp_path / f"{group}.tar"
        bundle._tar(files + [(f"SHA256SUMS.{group}", sums)], tar)
        lines.append(f"group {group} {offset} {tar.stat().st_size} {bundle._sha256(tar)}")
        offset += tar.stat().st_size
        tars.append(tar)
    rows = bundle._split(tars)
    lines += [f"part {f} {n} {b} {s}" for f, n, b, s in rows]
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("# test\n" + "\n".join(lines) + "\n")
    assert b"".join((bundle_dir / f / n).read_bytes() for f, n, _, _ in rows) == \
        b"".join(t.read_bytes() for t in tars)

    carried = tmp_path / "carried"          # what one device call holds: a single cNN folder
    env = {"VLLM_MANIFEST": str(manifest), "VLLM_BUNDLE_DIR": str(carried),
           "VLLM_PARTS": str(tmp_path / "parts"), "VLLM_WHEELS": str(tmp_path / "wheels"),
           "VLLM_MARKER": str(tmp_path / "marker")}
    for i, (folder, name, _, _) in enumerate(rows):
        (carried / folder).mkdir(parents=True)
        (carried / folder / name).write_bytes((bundle_dir / folder / name).read_bytes())
        out = _installer(env, "collect")
        assert out.returncode == 0, out.stdout + out.stderr
        assert ("no marker" if i == 0 else "marker found") in out.stdout
        assert f"part {name} ok" in out.stdout
        for f in carried.iterdir():             # the next call carries another folder
            for p in f.iterdir():
                p.unlink()
            f.rmdir()
    assert "group core: complete" in out.stdout and "group nccl: complete" in out.stdout
    folder, name = rows[0][:2]                              # an earlier call's folder left over
    (carried / folder).mkdir(parents=True)
    (carried / folder / name).write_bytes((bundle_dir / folder / name).read_bytes())
    out = _installer(env, "collect")
    assert out.returncode == 0 and " ok (" not in out.stdout     # not copied or checked again

    out = _installer(env, "unpack")
    assert out.returncode == 0, out.stdout + out.stderr
    for group, n in groups.items():
        for i in range(n):
            name = f"{group}_{i}-1.0-py3-none-any.whl"
            got = hashlib.sha256((tmp_path / "wheels" / "wheels" / name).read_bytes()).digest()
            assert got == hashlib.sha256((tmp_path / name).read_bytes()).digest()

    first = tmp_path / "parts" / rows[0][1]                    # one flipped byte is refused
    data = bytearray(first.read_bytes())
    data[100] ^= 1
    first.write_bytes(data)
    out = _installer(env, "unpack")
    assert out.returncode != 0 and "BAD checksum" in out.stdout


def test_installer_script_parses():
    assert subprocess.run(["bash", "-n", str(INSTALLER)]).returncode == 0
