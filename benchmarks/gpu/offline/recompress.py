"""Big wheels re-compressed for the trip to a GPU host without network, and back to wheels there.

A wheel is a deflated zip. LZMA over the same bytes stored takes about 30 % more off (vllm
0.32.0: 311 -> 215 MiB), and every 50 MiB saved is one part fewer to copy. Here (bundle.py):
the members are re-written into a zip that stores them (same names, times, modes; pip
installs it like the original, its RECORD still matches), cut into 32 MiB blocks that are
compressed on every core, each an xz stream of its own, back to back in NAME.whl.xz. There
(install_bundle.sh): `python3 recompress.py inflate DIR` turns each *.whl.xz back into the
stored .whl, the files in parallel; xz's CRC64 per stream catches a damaged byte.
The output depends only on the wheel (fixed block size, preset and member order), so a
rebuild gives the manifest's checksums again.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import sys
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

BLOCK = 32 << 20
PRESET = 6


def stored_zip(whl: Path) -> bytes:
    """The wheel's members, in order, stored instead of deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.external_attr = info.external_attr
            copy.create_system = info.create_system
            dst.writestr(copy, src.read(info))
    return out.getvalue()


def _xz(block: bytes) -> bytes:
    return lzma.compress(block, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=PRESET)


def recompressed(whl: Path, cache: Path) -> Path:
    """cache/<wheel name>.xz for this wheel, made once per wheel checksum (minutes for torch)."""
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()[:16]
    out = cache / f"{whl.name}.xz"
    stamp = cache / f"{whl.name}.xz.from"
    if out.exists() and stamp.exists() and stamp.read_text() == digest:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    data = stored_zip(whl)
    blocks = [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]
    with ProcessPoolExecutor(os.cpu_count()) as pool, open(out, "wb") as f:
        for streams in pool.map(_xz, blocks):
            f.write(streams)
    stamp.write_text(digest)
    print(f"  {whl.name}: {whl.stat().st_size / 2**20:.1f} MiB as shipped, "
          f"{len(data) / 2**20:.1f} stored, {out.stat().st_size / 2**20:.1f} as xz", flush=True)
    return out


def _inflate(path: str) -> str:
    src = Path(path)
    with lzma.open(src) as xz, open(src.with_suffix(""), "wb") as whl:   # every stream in turn
        shutil.copyfileobj(xz, whl, 16 << 20)
    src.unlink()
    return src.with_suffix("").name


def inflate(folder: Path) -> list[str]:
    """Every *.whl.xz under folder back to its stored .whl, in parallel; the .xz are removed."""
    paths = sorted(str(p) for p in folder.rglob("*.whl.xz"))
    with ProcessPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(_inflate, paths))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "inflate":
        sys.exit("usage: recompress.py inflate DIR")
    for name in inflate(Path(sys.argv[2])):
        print(f"inflated {name}")
