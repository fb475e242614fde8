"""A measurement run in a child process of its own (a fresh vLLM engine each): the child prints
its result as one JSON line, the parent runs it and reads that line back."""
from __future__ import annotations

import json
import subprocess

MARK = "CHILD_RESULT "


def report(result: dict) -> None:
    """In the child: hand `result` to the parent."""
    print(MARK + json.dumps(result), flush=True)


def run(argv: list[str], env: dict, timeout: float, what: str) -> dict:
    """In the parent: run the child, return its result; a child that printed none ends the
    benchmark with the tail of its output (`what` names the run)."""
    proc = subprocess.run(argv, env=env, text=True, capture_output=True, timeout=timeout)
    line = next((l for l in proc.stdout.splitlines() if l.startswith(MARK)), None)
    if line is None:
        raise SystemExit(f"{what} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(line[len(MARK):])
