"""vLLM's own sources at a given version, fetched from its sdist on the package registry by
tests/external/fetch_vllm_tests.sh into .cache/vllm-src/VERSION (git-ignored, never vendored)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FETCH = ROOT / "tests" / "external" / "fetch_vllm_tests.sh"


def vllm_sources(version: str) -> Path:
    """The source tree (tests/ and pkg/vllm/), fetched now if not cached. Skips the calling test
    when it cannot be fetched (no network), unless CHUNKATTN_REQUIRE_VLLM_SOURCES=1 (CI)."""
    dest = ROOT / ".cache" / "vllm-src" / version
    if not (dest / ".complete").exists():
        fetch = subprocess.run(["bash", str(FETCH), version], capture_output=True, text=True,
                               timeout=600)
        if fetch.returncode != 0:
            why = f"vLLM {version} sources could not be fetched: {fetch.stderr.strip()[-300:]}"
            if os.environ.get("CHUNKATTN_REQUIRE_VLLM_SOURCES") == "1":
                pytest.fail(why)
            pytest.skip(why)
    return dest
