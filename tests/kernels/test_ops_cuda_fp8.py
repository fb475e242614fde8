"""The CUDA TPP kernel over fp8 KV caches (float8_e4m3fn / float8_e5m2, per-tensor k/v scales) on
a GPU, against the fp64 dense oracle: the cases test_cuda_fp8_emulation.py runs through the SIMT
emulation at every head size, forced splits and compact stages, a CUDA graph replaying a padded
plan, and the kernel's own fp8 conversion (tpp_ptx.cuh) of every byte, on the GPU's fp8 cvt
(sm_89+) and on the sm_80 path. Skipped without a CUDA GPU."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_chunkattn.bench.cuda_work import split_spare_slots
from vllm_chunkattn.plan import build_plan

from test_cuda_fp8_emulation import FP8, SCALES, check, fp8_batch, oracle
from test_cuda_variants_emulation import LONG, SHARED, sinks_for
from test_ops_cuda import ops, replay_padded_plan, run  # noqa: F401  (ops: a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def plan_of(b):
    return build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size)


def variant(num_heads, window=40, soft_cap=4.0, seed=0):
    return dict(sliding_window=window, soft_cap=soft_cap,
                sinks=sinks_for(num_heads, seed).cuda())


@pytest.mark.parametrize("with_variant", [False, True], ids=["plain", "window_cap_sinks"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("fp8", FP8)
def test_trees(ops, fp8, head_size, dtype, with_variant):
    v = variant(8) if with_variant else {}
    b, expect = fp8_batch(3, fp8, dtype, tree=SHARED, head_size=head_size, variant=v,
                          poison=True, device="cuda")
    check(b, *run(ops, b, plan_of(b).to("cuda"), **v, **SCALES), expect)


@pytest.mark.parametrize("stage", ["64", "32"])
@pytest.mark.parametrize("forced", [(1, 1), (3, 2), (16, 4)])
@pytest.mark.parametrize("fp8", FP8)
def test_splits_and_stages(ops, splits, monkeypatch, fp8, forced, stage):
    monkeypatch.setenv("CHUNKATTN_PARTIAL_STAGE_TOKENS", stage)
    monkeypatch.setenv("CHUNKATTN_FINAL_STAGE_TOKENS", stage)
    v = variant(16, window=150, soft_cap=10.0, seed=1)
    b, expect = fp8_batch(4, fp8, torch.bfloat16, tree=LONG, heads=(16, 2), head_size=128,
                          variant=v, poison=True, device="cuda")
    plan = plan_of(b)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    check(b, *run(ops, b, plan.to("cuda"), spare_slots=spare, **v, **SCALES), expect)


@pytest.mark.parametrize("fp8", FP8)
def test_cuda_graph_replays_a_padded_plan(ops, fp8):
    b, _ = fp8_batch(7, fp8, torch.float16, tree=dict(fanouts=[3, 4], max_node_blocks=3,
                                                      max_private_blocks=2),
                     heads=(16, 4), head_size=128, max_seqs=10, device="cuda")
    n = b.query.shape[0]
    v = variant(16, window=50, soft_cap=0.0, seed=4)
    out, lse = replay_padded_plan(ops, b, 12, **v, **SCALES)
    check(b, out, lse, oracle(b, **v, **SCALES))
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


# tpp_ptx.cuh's fp8x8_to_smem on the 256 codes, 32 threads x 8, into the query dtypes.
PROBE = r"""
#include "cuda/tpp_ptx.cuh"
template <typename T, bool E5M2>
__global__ void probe(const uint8_t* in, T* out) {
  __shared__ __align__(16) uint8_t raw[256];
  __shared__ __align__(16) T converted[256];
  const int t = threadIdx.x;
  for (int i = 0; i < 8; ++i) raw[t * 8 + i] = in[t * 8 + i];
  __syncthreads();
  chunkattn::fp8x8_to_smem<T, E5M2>(converted + t * 8, raw + t * 8);
  __syncthreads();
  for (int i = 0; i < 8; ++i) out[t * 8 + i] = converted[t * 8 + i];
}
extern "C" int convert(const uint8_t* in, void* out, int half, int e5m2) {
  if (half && e5m2) probe<__half, true><<<1, 32>>>(in, static_cast<__half*>(out));
  if (half && !e5m2) probe<__half, false><<<1, 32>>>(in, static_cast<__half*>(out));
  if (!half && e5m2) probe<__nv_bfloat16, true><<<1, 32>>>(in, static_cast<__nv_bfloat16*>(out));
  if (!half && !e5m2) probe<__nv_bfloat16, false><<<1, 32>>>(in, static_cast<__nv_bfloat16*>(out));
  return int(cudaDeviceSynchronize());
}
"""


@pytest.fixture(scope="module")
def conversion_probes(tmp_path_factory):
    """{"native": this GPU's code, "sm80": compute_80 PTX, JIT-compiled for this GPU by the
    driver (so __CUDA_ARCH__ is 800: the path without an fp8 cvt)}: ctypes libraries."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    major, minor = torch.cuda.get_device_capability()
    tmp = tmp_path_factory.mktemp("fp8_probe")
    (tmp / "probe.cu").write_text(PROBE)
    libs = {}
    for name, gencode in (("native", f"arch=compute_{major}{minor},code=sm_{major}{minor}"),
                          ("sm80", "arch=compute_80,code=compute_80")):
        so = tmp / f"{name}.so"
        subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3", "-gencode", gencode,
                        f"-I{ROOT / 'csrc'}", str(tmp / "probe.cu"), "-o", str(so)], check=True)
        libs[name] = ctypes.CDLL(str(so))
    return libs


@pytest.mark.parametrize("path", ["native", "sm80"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_every_code_converts_exactly(conversion_probes, fp8, dtype, path):
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(fp8).to(dtype)             # exact: every fp8 value is an fp16 and a bf16
    src = codes.cuda()
    got = torch.full((256,), float("nan"), dtype=dtype, device="cuda")
    rc = conversion_probes[path].convert(ctypes.c_void_p(src.data_ptr()),
                                         ctypes.c_void_p(got.data_ptr()),
                                         int(dtype == torch.float16), int(fp8 == torch.float8_e5m2))
    assert rc == 0
    got = got.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))   # -0 too
