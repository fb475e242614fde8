"""benchmarks/gpu/junit.py: run_on_device.sh's reader of pytest's junit XML, on XML that pytest
itself wrote here (a tiny suite with a pass, a failure, an error, a skip, a class)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JUNIT = ROOT / "benchmarks" / "gpu" / "junit.py"

SUITE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_ok():
    pass

@pytest.mark.parametrize("x", [pytest.param(1, id="overlap_on"), pytest.param(2, id="b c")])
def test_param(x):
    assert x == 2

def test_error(broken):
    pass

@pytest.mark.skip(reason="no GPU")
def test_skipped():
    pass

class TestGroup:
    def test_in_class(self):
        assert False
'''


def test_counts_and_failed_node_ids_pytest_takes_back(tmp_path):
    pkg = tmp_path / "tests"
    pkg.mkdir()
    (pkg / "test_tiny.py").write_text(SUITE)
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "tests/test_tiny.py"], cwd=tmp_path, capture_output=True)
    counts = subprocess.run([sys.executable, str(JUNIT), "counts", "gpu-tests", str(xml)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert counts.returncode == 0
    assert counts.stdout.strip() == ("gpu-tests: 2 passed, 2 failed, 1 errors, 1 skipped (of 6)")
    failed = subprocess.run([sys.executable, str(JUNIT), "failed", str(xml)], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert sorted(failed) == ["tests/test_tiny.py::TestGroup::test_in_class",
                              "tests/test_tiny.py::test_error",
                              "tests/test_tiny.py::test_param[overlap_on]"]
    # pytest takes them back: rerunning exactly those runs 3 tests, all failing again
    again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *failed], cwd=tmp_path, capture_output=True, text=True)
    assert again.stdout.strip().splitlines()[-1].startswith("2 failed, 1 error"), again.stdout


def test_no_xml_counts_as_nothing_passed(tmp_path):
    r = subprocess.run([sys.executable, str(JUNIT), "counts", "host-tests",
                        str(tmp_path / "missing.xml")], capture_output=True, text=True)
    assert r.returncode == 1 and "host-tests: no junit XML (FileNotFoundError)" in r.stdout
