"""Bundle builder: the wheels a GPU host without network lacks for `vllm serve` + `vllm bench
serve` with vllm 0.32.0 (CUDA), the big ones re-compressed (recompress.py), split into parts of
at most --part-mib (50 MiB by default: a transfer limit of your choosing) that are copied over
and gathered there by install_bundle.sh (README.md). Three groups, back to back: core (vLLM on
the host's torch), torch (torch 2.13's stack: TORCH_STACK) and nccl (SHARED_LIBS), the last two
copied only if the host's install asks for them. What the host image holds: device_image.py.
`--vllm 0.33.0` before the command: vLLM 0.33's bundle instead, core alone (RELEASES).

    .venv/bin/python benchmarks/gpu/offline/bundle.py closure --python /tmp/b312/bin/python [--live]
    .venv/bin/python benchmarks/gpu/offline/bundle.py build          # download, tar, split, manifest
    .venv/bin/python benchmarks/gpu/offline/bundle.py build --from-manifest   # the committed bundle again
    .venv/bin/python benchmarks/gpu/offline/bundle.py resplit        # the built parts cut again
    .venv/bin/python benchmarks/gpu/offline/bundle.py status         # what is built, part by part

`closure` runs import_probe.py in a Python 3.12 venv holding vLLM's wheels (and with --live
records a real CPU serve + bench run in this venv); `build` keeps what the host image lacks or
has at an incompatible version and writes bundle_manifest.txt (committed) and .bundle/ (ignored),
or for 0.33 bundle_manifest_vllm0.33.0.txt and .bundle-vllm0.33.0/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name as canon
from packaging.version import Version

from bundle_closure import closure, conflicts, wants_of   # this folder is sys.path[0]
from device_image import (IMAGE_PACKAGES, IMAGE_VERSIONS, PLATFORMS, SHARED_LIBS,
                          TORCH_STACK)
from recompress import recompressed

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# A bundle per vLLM release: (its manifest, committed; its folder, git-ignored: wheels/, cNN/,
# a part each; the groups it builds). 0.33.0's is vLLM on the image's torch 2.11
# alone: its fallback torch stack (2.14, triton 3.8, NCCL 2.30) would be ~12 more parts, and
# nothing here has checked a shim for the image's NCCL under torch 2.14 (README.md).
RELEASES = {"0.32.0": ("bundle_manifest.txt", ".bundle", ("core", "torch", "nccl")),
            "0.33.0": ("bundle_manifest_vllm0.33.0.txt", ".bundle-vllm0.33.0", ("core",))}
RELEASE = "0.32.0"
BUNDLE = REPO / RELEASES[RELEASE][1]
MANIFEST = HERE / RELEASES[RELEASE][0]
# The default transfer: the checkout beside one part in at most 64 MiB. 50 MiB parts leave the
# checkout 14 MiB; the core group's 244.7 MiB take 5 parts. --part-mib / --transfer-mib change them.
PART_BYTES = 50 << 20
TRANSFER_BYTES = 64 << 20      # one transfer at most: the checkout and one part
DEFAULT_SIZES = (PART_BYTES, TRANSFER_BYTES)
RESERVE_MAX = 2 << 20          # a reserve wheel larger than this is not worth carrying blind
XZ_MIN = 16 << 20              # wheels this big travel as xz (torch, vllm, triton: 21 -> 16 parts)
GROUPS_AS_SHIPPED = {"nccl"}
# Groups after core that are copied only if the host's install asks (install_bundle.sh): why.
OPTIONAL_GROUPS = {"torch": "sent only if the check on the image's torch fails: TORCH_STACK",
                   "nccl": "sent only if the NCCL check fails: SHARED_LIBS"}


def plan(dists: dict) -> tuple[list, list, list]:
    """(carry, reserve, reuse) rows (name, version, why); reserve rows add the specifier the
    host's version must meet. Carry: the image lacks it, or its version fails a requirement of
    the closure. Reserve: the image has it at a version nobody read and something constrains it:
    carried, installed on the host only if its own version fails that specifier."""
    wants = wants_of(dists)
    image = {canon(n) for n in IMAGE_PACKAGES}
    carry, reserve, reuse = [], [], []
    for key, d in sorted(dists.items()):
        reqs = [(who, r.specifier) for who, r in wants.get(key, []) if r.specifier]
        specs = [f"{who} needs {spec}" for who, spec in reqs]
        have = IMAGE_VERSIONS.get(key)
        if key not in image:
            carry.append((d["name"], d["version"], "not in the image"))
        elif have is None and specs:
            need = SpecifierSet()
            for _, spec in reqs:
                need &= spec
            reserve.append((d["name"], d["version"], "image version unread; " + "; ".join(specs),
                            str(need)))
        elif have is None:
            reuse.append((d["name"], "?", "unconstrained"))
        else:
            bad = [f"{who} needs {spec}" for who, spec in reqs
                   if not spec.contains(Version(have), prereleases=True)]
            if bad:
                carry.append((d["name"], d["version"], f"image has {have}; " + "; ".join(bad)))
            else:
                reuse.append((d["name"], have, "; ".join(specs) or "unconstrained"))
    return carry, reserve, reuse


def _download(pins: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}    # the registry only, no local wheels
    if "PIP_CERT" not in env and Path("/etc/ssl/certs/ca-certificates.crt").exists():
        env["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary", ":all:", "--python-version", "3.12", "--implementation",
                    "cp", *plat, "--index-url", "https://pypi.org/simple", "-d", str(dest),
                    *pins], check=True, env=env)


def _wheel_for(dest: Path, name: str, version: str) -> Path:
    stem = f"{canon(name).replace('-', '_')}-{version}-"
    hits = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if len(hits) != 1:
        sys.exit(f"expected one wheel for {name}=={version} in {dest}, found {hits}")
    return hits[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tar(files: list[tuple[str, Path]], out: Path) -> None:
    """Deterministic tar (fixed owner/time/order): same wheels, same bytes, same part sums."""
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for arc, path in sorted(files):
            info = tar.gettarinfo(str(path), arcname=arc)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)


def _split(tars: list[Path]) -> list[tuple[str, str, int, str]]:
    """The tars, back to back, cut into BUNDLE/cNN/bundle.partNN (one folder a part): a group
    needs only the parts its byte range touches. Rows (folder, file, bytes, sha256)."""
    rows, buf = [], bytearray()

    def flush():
        folder = BUNDLE / f"c{len(rows) + 1:02d}"
        folder.mkdir(exist_ok=True)
        name = f"bundle.part{len(rows) + 1:02d}"
        (folder / name).write_bytes(buf)
        rows.append((folder.name, name, len(buf), hashlib.sha256(buf).hexdigest()))
        buf.clear()

    for tar in tars:
        with open(tar, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                buf += block
                while len(buf) >= PART_BYTES:
                    rest = bytes(buf[PART_BYTES:])
                    del buf[PART_BYTES:]
                    flush()
                    buf += rest
    if buf:
        flush()
    return rows


def _travelling(group: str, whl: Path) -> Path:
    """What travels for a wheel: big ones re-compressed (recompress.py), unless their group is
    a shared library's (NCCL's .so shrinks 6 %: not worth the minutes here)."""
    if whl.stat().st_size < XZ_MIN or group in GROUPS_AS_SHIPPED:
        return whl
    return recompressed(whl, BUNDLE / "xz")


def _clear_parts() -> None:
    """Removes BUNDLE/cNN, the parts of an earlier cut (_split writes them afresh)."""
    for old in BUNDLE.glob("c[0-9]*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def _pack(groups: dict[str, list[tuple[str, Path]]]) -> tuple[list[str], list[str]]:
    """{group: [(wheels|reserve, wheel path)]} -> tars back to back -> parts in BUNDLE/cNN.
    Returns the manifest's `wheel` lines and its `group` + `part` lines."""
    _clear_parts()
    lines, group_lines, tars, offset = [], [], [], 0
    for group, members in groups.items():
        lines += [f"wheel {group} {sub} {whl.stat().st_size} {_sha256(whl)} {whl.name}"
                  for sub, whl in members]
        files = [(f"{sub}/{travelling.name}", travelling) for sub, whl in members
                 for travelling in [_travelling(group, whl)]]
        sums_file = BUNDLE / f"{group}.SHA256SUMS"
        sums_file.write_text("".join(f"{_sha256(p)}  {a}\n" for a, p in sorted(files)))
        tar = BUNDLE / f"{group}.tar"
        _tar(files + [("SHA256SUMS." + group, sums_file)], tar)
        size = tar.stat().st_size
        group_lines.append(f"group {group} {offset} {size} {_sha256(tar)}")
        offset += size
        tars.append(tar)
    parts = [f"part {folder} {name} {size} {sha}" for folder, name, size, sha in _split(tars)]
    for tar in tars:
        tar.unlink()
    return lines, group_lines + parts


def build(args) -> None:
    if args.from_manifest:
        return _rebuild()
    dists = json.loads((BUNDLE / "closure.json").read_text())["distributions"]
    built = RELEASES[RELEASE][2]
    if bad := conflicts(dists, built):
        sys.exit("the closure's venv breaks its own requirements: install these pins there, then "
                 "`closure` again:\n  " + "\n  ".join(bad))
    carry, reserve, reuse = plan(dists)
    stack = [r for r in carry if canon(r[0]) in TORCH_STACK]
    if "torch" not in built:     # vLLM on the image's torch or not at all (RELEASES)
        carry = [r for r in carry if r not in stack]
        reuse += [(n, "-", f"not carried for vLLM {RELEASE}: {why}") for n, _, why in stack]
        stack = []
    shared = SHARED_LIBS if "nccl" in built else {}
    wheels = BUNDLE / "wheels"
    _download([f"{r[0]}=={r[1]}" for r in carry + reserve] +
              [f"{n}=={v}" for n, v in shared.items()], wheels)
    big = [r for r in reserve if _wheel_for(wheels, r[0], r[1]).stat().st_size > RESERVE_MAX]
    reserve = [r for r in reserve if r not in big]
    reuse += [(n, "?", f"unread, too big to hold in reserve; check on the host: {why[22:]}")
              for n, _, why, _ in big]
    groups = {"core": [("wheels", _wheel_for(wheels, r[0], r[1])) for r in carry if r not in stack] +
                      [("reserve", _wheel_for(wheels, r[0], r[1])) for r in reserve],
              "torch": [("wheels", _wheel_for(wheels, r[0], r[1])) for r in stack],
              "nccl": [("wheels", _wheel_for(wheels, n, v)) for n, v in shared.items()]}
    groups = {g: members for g, members in groups.items() if g in built}
    for f in set(wheels.glob("*.whl")) - {w for g in groups.values() for _, w in g}:
        f.unlink()
    lines, layout = _pack(groups)
    _write_manifest(carry, reserve, reuse, lines, layout, dists)


def _rebuild() -> None:
    """The committed manifest's exact wheels, fetched again and packed again: the parts must come
    out with the manifest's checksums (no closure venv needed)."""
    rows = [ln.split()[1:] for ln in MANIFEST.read_text().splitlines() if ln.startswith("wheel ")]
    wheels = BUNDLE / "wheels"
    pins = [f"{f.split('-')[0]}=={f.split('-')[1]}" for *_, f in rows]
    _download(pins, wheels)
    groups: dict[str, list[tuple[str, Path]]] = {}
    for group, sub, _, sha, fname in rows:
        if _sha256(wheels / fname) != sha:
            sys.exit(f"{fname}: checksum differs from the manifest's")
        groups.setdefault(group, []).append((sub, wheels / fname))
    _, layout = _pack(groups)
    text = MANIFEST.read_text().splitlines()
    want = [ln for ln in text if ln.startswith(("group ", "part "))]
    n_parts = sum(ln.startswith("part ") for ln in layout)
    if layout == want:
        print(f"rebuilt {n_parts} parts; all match the manifest")
        return
    # The wheels are the registry's (checked above); only their packing differs, e.g. another
    # liblzma here. The host checks parts against the manifest in the checkout copied there, so
    # the new lines are what it must read: write them, and say so.
    keep = [ln for ln in text if not ln.startswith(("group ", "part "))]
    MANIFEST.write_text("\n".join(keep + layout) + "\n")
    print(f"rebuilt {n_parts} parts from the manifest's wheels, but packed differently from the "
          f"committed parts: {MANIFEST.relative_to(REPO)} rewritten with the new group/part lines "
          f"(the host reads it from the checkout; commit it)")


def _write_manifest(carry, reserve, reuse, wheel_lines, part_lines, dists) -> None:
    size = {ln.split()[-1]: int(ln.split()[3]) for ln in wheel_lines}
    mib = lambda b: f"{b / 2**20:8.2f}"                                   # noqa: E731
    out = [f"# vLLM {RELEASE} (CUDA) for a GPU host without network: what its image (Python 3.12,",
           "# torch 2.11.0+cu130) lacks for `vllm serve` + `vllm bench serve` of a Llama model.",
           "# Made by `.venv/bin/python benchmarks/gpu/offline/bundle.py closure ... && ... build`: the",
           "# import closure from import_probe.py in a Python 3.12 venv holding vLLM's CUDA wheels",
           "# (CUDA platform forced, optional imports hidden) and a live CPU serve + bench run.",
           "# Parts again: `bundle.py build --from-manifest`. install_bundle.sh reads the lines",
           "# after '# machine-readable'. Sizes: MiB in comments, bytes in those lines.",
           "#"]
    out += _layout_comments(wheel_lines, part_lines)
    n_parts = sum(ln.startswith("part ") for ln in part_lines)
    out += ["", "# -- carried: the image lacks them or has an incompatible version"]
    out += [f"# {mib(size.get(_fname(size, n, v), 0))}  {n}=={v}  ({why})" for n, v, why in carry]
    out += [f"# {mib(size[f])}  {f}  (shared library, see SHARED_LIBS in device_image.py)"
            for f in size if f.startswith("nvidia_nccl")]
    out += ["", "# -- reserve: installed only if the host's own version fails the check"]
    out += [f"# {mib(size.get(_fname(size, n, v), 0))}  {n}=={v}  ({why})"
            for n, v, why, _ in reserve]
    out += ["", "# -- reused from the image (imported on the serve path)"]
    out += [f"#   {n} {v}  ({why})" for n, v, why in reuse]
    out += ["", "# machine-readable"]
    out += [f"closure {d['name']} {d['version']}" for d in dists.values()]
    out += [f"reserve {_fname(size, n, v)} {n} {need}" for n, v, _, need in reserve]
    out += wheel_lines + part_lines
    MANIFEST.write_text("\n".join(out) + "\n")
    print(f"wrote {MANIFEST.relative_to(REPO)}: {len(wheel_lines)} wheels, {n_parts} parts")


def _layout_comments(wheel_lines: list[str], layout: list[str]) -> list[str]:
    """The manifest's comments on its layout: each group's wheels, tar and parts, and the parts."""
    by_group: dict[str, list[int]] = {}
    for ln in wheel_lines:
        by_group.setdefault(ln.split()[1], []).append(int(ln.split()[3]))
    out = []
    for ln in layout:
        if ln.startswith("group "):
            _, g, off, n, _ = ln.split()
            first, last = int(off) // PART_BYTES + 1, (int(off) + int(n) - 1) // PART_BYTES + 1
            sizes = by_group[g]
            out.append(f"# group {g}: {len(sizes)} wheels, {sum(sizes) / 2**20:.1f} MiB of wheels, "
                       f"tar {int(n) / 2**20:.1f} MiB in parts {first}-{last}"
                       + (" (wheels as shipped" if g in GROUPS_AS_SHIPPED else
                          f" (wheels over {XZ_MIN >> 20} MiB as xz: recompress.py")
                       + (f"; {OPTIONAL_GROUPS[g]})" if g in OPTIONAL_GROUPS else ")"))
    n_parts = sum(ln.startswith("part ") for ln in layout)
    out.append(f"# {n_parts} parts of <= {PART_BYTES >> 20} MiB: {BUNDLE.name}/c01 .. "
               f"c{n_parts:02d}, a folder each")
    return out


def resplit(args) -> None:
    """The built parts cut again at PART_BYTES: the same bytes, groups and checksums, no fetching
    or packing (minutes of xz). Rewrites the manifest's part lines and its layout comments."""
    text = MANIFEST.read_text().splitlines()
    stream = BUNDLE / "stream.tmp"
    with open(stream, "wb") as out:
        for _, folder, name, size, sha in (ln.split() for ln in text if ln.startswith("part ")):
            data = (BUNDLE / folder / name).read_bytes()
            if len(data) != int(size) or hashlib.sha256(data).hexdigest() != sha:
                sys.exit(f"{folder}/{name}: not the manifest's part (build first)")
            out.write(data)
    _clear_parts()
    parts = [f"part {folder} {name} {size} {sha}" for folder, name, size, sha in _split([stream])]
    stream.unlink()
    layout = [ln for ln in text if ln.startswith("group ")] + parts
    comments = _layout_comments([ln for ln in text if ln.startswith("wheel ")], layout)
    old_comments = [i for i, ln in enumerate(text) if ln.startswith("# group ") or
                    (ln.startswith("# ") and " parts of <= " in ln)]
    keep = [ln for i, ln in enumerate(text) if i not in old_comments and not ln.startswith("part ")]
    at = old_comments[0] if old_comments else 0
    MANIFEST.write_text("\n".join(keep[:at] + comments + keep[at:] + parts) + "\n")
    print(f"{len(parts)} parts of <= {PART_BYTES >> 20} MiB; {MANIFEST.relative_to(REPO)} rewritten")


def _fname(size: dict, name: str, version: str) -> str:
    stem = f"{canon(name).replace('-', '_')}-{version}-".lower()
    return next((f for f in size if f.lower().startswith(stem)), "")


def status(args) -> None:
    lines = MANIFEST.read_text().splitlines()
    parts = [ln.split() for ln in lines if ln.startswith("part ")]
    groups = [(g[1], int(g[2]), int(g[2]) + int(g[3])) for g in map(str.split, lines)
              if g[:1] == ["group"]]
    start = 0
    for _, folder, name, nbytes, sha in parts:
        p = BUNDLE / folder / name
        ok = p.exists() and p.stat().st_size == int(nbytes) and (args.quick or _sha256(p) == sha)
        # A part is optional when every group its bytes touch is (the first optional one says why).
        touched = [g for g, lo, hi in groups if lo < start + int(nbytes) and start < hi]
        only = next((OPTIONAL_GROUPS[g] for g in touched), "") \
            if all(g in OPTIONAL_GROUPS for g in touched) else ""
        start += int(nbytes)
        print(f"part {folder[1:]}: {BUNDLE.name}/{folder}  {name}  "
              f"{int(nbytes) / 2**20:5.1f} MiB  {'ok' if ok else 'MISSING/BAD'}"
              f"{f'  ({only})' if only else ''}")
    tree, transfer = largest_transfer_bytes()
    print(f"the checkout: {tree / 2**20:.2f} MiB; with the largest part {transfer / 2**20:.2f} MiB "
          f"of {TRANSFER_BYTES >> 20} MiB"
          f"{'' if transfer < TRANSFER_BYTES else ': TOO BIG, ignore or remove untracked files'}")


def largest_transfer_bytes() -> tuple[int, int]:
    """(bytes of the checkout: tracked files and untracked ones git does not ignore, bytes of the
    transfer that carries it beside the largest part)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    tree = sum((REPO / f).stat().st_size for f in files if f and (REPO / f).is_file())
    parts = [ln.split() for ln in MANIFEST.read_text().splitlines() if ln.startswith("part ")]
    return tree, tree + max(int(p[3]) for p in parts)


def select(release: str) -> None:
    """Points MANIFEST, BUNDLE and the groups built at `release`'s bundle (RELEASES)."""
    global RELEASE, BUNDLE, MANIFEST
    RELEASE = release
    BUNDLE, MANIFEST = REPO / RELEASES[release][1], HERE / RELEASES[release][0]


def main(argv=None):
    global PART_BYTES, TRANSFER_BYTES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm", choices=RELEASES, default=RELEASE,
                   help="the vLLM release whose bundle to build or check (RELEASES)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("closure", help="find the distributions the serve path imports")
    c.add_argument("--python", required=True, help="python of a 3.12 venv holding vLLM's wheels")
    c.add_argument("--live", action="store_true", help="also record a CPU serve+bench run here")
    b = sub.add_parser("build", help="download, split into parts, write the manifest")
    b.add_argument("--from-manifest", action="store_true", help="refetch and repack the "
                   "committed manifest's wheels instead (checks the parts' checksums)")
    sub.add_parser("resplit", help="cut the built parts again at --part-mib (no fetch, no xz)")
    s = sub.add_parser("status", help="list the parts and check them")
    s.add_argument("--quick", action="store_true", help="sizes only, no checksums")
    for q in (b, s, sub.choices["resplit"]):
        q.add_argument("--part-mib", type=int, default=DEFAULT_SIZES[0] >> 20,
                       help="the largest part, MiB (a transfer limit; default %(default)s)")
        q.add_argument("--transfer-mib", type=int, default=DEFAULT_SIZES[1] >> 20,
                       help="what one transfer may carry, the checkout beside a part, MiB "
                       "(default %(default)s; status checks it)")
    args = p.parse_args(argv)
    select(args.vllm)
    if args.cmd == "closure":
        return closure(args, BUNDLE)
    PART_BYTES, TRANSFER_BYTES = args.part_mib << 20, args.transfer_mib << 20
    {"build": build, "resplit": resplit, "status": status}[args.cmd](args)


if __name__ == "__main__":
    main()
