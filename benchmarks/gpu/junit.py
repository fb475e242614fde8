"""pytest's junit XML, read for run_on_device.sh (standard library only: the GPU host image's
python, before anything is installed).

    python3 junit.py counts NAME XML   "NAME: P passed, F failed, E errors, S skipped (of N)";
                                       status 1 when nothing passed (or no XML)
    python3 junit.py failed XML        the node ids that failed or errored, one per line, as
                                       pytest takes them back (tests/test_x.py::test_y[param])
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _suites(path: str) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def counts(name: str, path: str) -> int:
    try:
        suites = _suites(path)
    except (OSError, ET.ParseError) as e:
        print(f"{name}: no junit XML ({type(e).__name__})")
        return 1
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors",
                                                            "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    print(f"{name}: {passed} passed, {n['failures']} failed, {n['errors']} errors, "
          f"{n['skipped']} skipped (of {n['tests']})")
    return 0 if passed > 0 else 1


def node_id(classname: str, name: str, root: Path) -> str:
    """tests.test_x.TestY + test_z -> tests/test_x.py::TestY::test_z (the longest dotted prefix
    that is a file under root is the module; the rest are classes)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (root / module).is_file():
            return "::".join([module.as_posix(), *parts[cut:], name])
    return "::".join([Path(*parts).with_suffix(".py").as_posix(), name])


def failed(path: str, root: Path) -> list[str]:
    return [node_id(case.get("classname", ""), case.get("name", ""), root)
            for suite in _suites(path) for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


if __name__ == "__main__":
    if sys.argv[1:2] == ["counts"] and len(sys.argv) == 4:
        sys.exit(counts(sys.argv[2], sys.argv[3]))
    if sys.argv[1:2] == ["failed"] and len(sys.argv) == 3:
        print("\n".join(failed(sys.argv[2], Path.cwd())))
        sys.exit(0)
    sys.exit(__doc__)
