"""pytest plugin: vLLM's CUDA platform as an H100's on a machine without a GPU (the stand-in of
rehearse_cuda_glue.py), for the tests that drive vLLM's scheduler, KV cache manager and config
with the chunk prefix tree on a CUDA build of vLLM: vLLM 0.33 has no CPU wheel, so this is how
its scheduler runs beside ours here. Without a driver vLLM's extensions need a stub libcuda.so.1
(import_probe re-executes the process with one when none loads).

Usage (benchmarks/gpu/rehearsal.md, "vLLM 0.33 without a GPU"):
  PYTHONPATH=$PWD/benchmarks/gpu python -m pytest -p cuda_platform_stand_in tests/plugin/test_async_scheduling.py
"""
import rehearse_cuda_glue

rehearse_cuda_glue.stand_in_h100()
