"""The CUDA kernel's build and contract, checked without a GPU: the -gencode flags of setup.py and
of the JIT build (sm_80 and up), the block sizes the backend advertises on CUDA, and the host plan
check that stands in for the CUDA op's index checks (csrc/tpp_checks.h: the CPU op's messages).
The CUDA op's own shape checks run in tests/kernels/test_ops_cuda.py (GPU)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_chunkattn.ops import CUDA_BLOCK_SIZES, check_plan, jit_build
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.plan import TppPlan, build_plan
from vllm_chunkattn.plan.cache import PlanCache
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch

ROOT = Path(__file__).resolve().parents[2]
CPU_OPS = native_ops(torch.device("cpu"))
needs_native = pytest.mark.skipif(CPU_OPS is None, reason="vllm_chunkattn._C not built")


# ---- build flags

@pytest.mark.parametrize("capability,want", [((9, 0), ["9.0a"]), ((8, 0), ["8.0"]),
                                             ((8, 6), ["8.6"]), ((12, 0), ["12.0"])])
def test_jit_builds_the_local_arch(monkeypatch, capability, want):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert jit_build.arch_list() == want
    cc = want[0].replace(".", "")
    assert jit_build.gencode_flags(want) == ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]


def test_jit_arch_list_env(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    assert jit_build.gencode_flags(jit_build.arch_list()) == [
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]


@pytest.mark.parametrize("env,capability", [(None, (7, 5)), ("7.0;8.0", (9, 0))])
def test_jit_refuses_below_sm80(monkeypatch, env, capability):
    if env is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8\.0"):
        jit_build.arch_list()


def _fake_toolkit(tmp_path: Path) -> Path:
    """A toolkit with a runtime library, and on PATH only a wrapper script exec'ing its nvcc
    (the layout of this project's CPU machines), which answers --dryrun as nvcc does."""
    root = tmp_path / "cuda-13.0"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcudart.so").touch()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '#$ _HERE_={root}/bin' >&2\necho '#$ TOP={root}/bin/..' >&2\n")
    wrapper = tmp_path / "wrapper_bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    for f in (nvcc, wrapper):
        f.chmod(0o755)
    return root


@pytest.mark.parametrize("user_env", [None, "CUDA_HOME", "CUDA_PATH"])
def test_jit_finds_the_toolkit_behind_an_nvcc_wrapper(monkeypatch, tmp_path, user_env):
    root = _fake_toolkit(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrapper_bin'}:{os.environ['PATH']}")
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    if user_env:
        monkeypatch.setenv(user_env, "/opt/users/cuda")
    guess = str(tmp_path)                 # what torch guesses from `which nvcc`: no lib there
    fake_cpp_extension = type("CppExtension", (), {"CUDA_HOME": guess})
    assert jit_build.nvcc_toolkit_root() == str(root)
    jit_build.fix_cuda_home(fake_cpp_extension)
    # A user's own setting is never overridden; otherwise the toolkit nvcc names is taken.
    assert fake_cpp_extension.CUDA_HOME == (guess if user_env else str(root))


def test_jit_keeps_a_cuda_home_that_has_the_runtime(monkeypatch, tmp_path):
    root = _fake_toolkit(tmp_path)
    other = tmp_path / "other"
    (other / "lib64").mkdir(parents=True)
    (other / "lib64" / "libcudart.so").touch()
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrapper_bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    fake_cpp_extension = type("CppExtension", (), {"CUDA_HOME": str(other)})
    jit_build.fix_cuda_home(fake_cpp_extension)
    assert fake_cpp_extension.CUDA_HOME == str(other) != str(root)


def test_jit_build_dirs_are_keyed_under_the_chosen_root(monkeypatch, tmp_path):
    """Under $CHUNKATTN_BUILD_DIR too, a build is keyed by torch, CUDA, arch and sources: the
    device image's torch 2.11 and the vLLM bundle's 2.13 keep separate builds there."""
    import shutil
    src = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", src)
    monkeypatch.setenv("CHUNKATTN_BUILD_DIR", str(tmp_path / "jit"))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    first = jit_build.build_dir(src, "9.0a")
    assert first.parent == tmp_path / "jit" and jit_build.build_dir(src, "9.0a") == first
    assert jit_build.build_dir(src, "8.0") != first
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert jit_build.build_dir(src, "9.0a") != first
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    (src / "softmax_state.h").write_text((src / "softmax_state.h").read_text() + "\n")
    assert jit_build.build_dir(src, "9.0a") != first
    monkeypatch.delenv("CHUNKATTN_BUILD_DIR")
    assert jit_build.build_dir(src, "9.0a").parent == (Path.home() / ".cache" / "vllm_chunkattn"
                                                         / "jit")


def test_jit_sources_include_the_host_plan_check():
    names = [p.name for p in jit_build._sources(ROOT / "csrc")]
    assert {"torch_bindings.cpp", "tpp_checks.cpp", "tpp_decode.cpp", "tpp_decode.cu"} <= set(names)
    # Each (query dtype, KV kind)'s kernel instantiations (tpp_kernels.cuh declares them extern).
    assert {f"tpp_kernels_{q}{kv}.cu" for q in ("fp16", "bf16") for kv in ("", "_fp8kv")} <= set(names)


def test_setup_builds_sm80_and_sm90a(monkeypatch):
    from torch.utils import cpp_extension
    # A CPU torch finds no CUDA home; CUDAExtension only joins paths with it.
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME or "/usr/local/cuda")
    spec = importlib.util.spec_from_file_location("chunkattn_setup", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)                  # setup() runs only as __main__
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CHUNKATTN_BUILD_CUDA", "1")
    ext = setup_py.extension()
    nvcc = ext.extra_compile_args["nvcc"]
    pairs = {nvcc[i + 1] for i, f in enumerate(nvcc) if f == "-gencode"}
    assert {"arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a"} <= pairs
    assert "csrc/tpp_checks.cpp" in ext.sources and "csrc/cuda/tpp_decode.cu" in ext.sources
    # The C++ standard is torch's to pick: torch 2.14's headers (vLLM 0.33) need C++20, and an
    # explicit -std=c++17 failed that build (std::strong_ordering in c10/util/intrusive_ptr.h).
    flags = ext.extra_compile_args["cxx"] + nvcc
    assert not [f for f in flags if f.startswith(("-std", "--std"))], flags


def test_backend_advertises_the_cuda_kernels_block_sizes(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import MultipleOf

    from vllm_chunkattn.plugin import backend
    monkeypatch.setattr(backend.current_platform, "is_cpu", lambda: False)
    sizes = backend.ChunkAttnBackend.get_supported_kernel_block_sizes()
    assert sizes == list(CUDA_BLOCK_SIZES)
    assert all(s & (s - 1) == 0 and s % 16 == 0 for s in sizes)
    assert not backend.ChunkAttnBackend.supports_block_size(8)
    monkeypatch.setattr(backend.current_platform, "is_cpu", lambda: True)
    assert backend.ChunkAttnBackend.get_supported_kernel_block_sizes() == [16, MultipleOf(32)]


# ---- what a GPU must have: refused at vLLM's backend selection, not at the first decode

def _validate_on_gpu(monkeypatch, capability, head_size, smem_optin):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms.interface import DeviceCapability

    from vllm_chunkattn.plugin import backend
    monkeypatch.setattr(backend.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(shared_memory_per_block_optin=smem_optin))
    # The arguments vLLM 0.32's CudaPlatform passes (its attn_selector_config), for a Llama.
    return backend.ChunkAttnBackend.validate_configuration(
        head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(*capability),
        attn_type="decoder")


H100_SMEM, L4_SMEM = 232448, 101376   # cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_hopper_takes_every_head_size(monkeypatch, head_size):
    assert _validate_on_gpu(monkeypatch, (9, 0), head_size, H100_SMEM) == []


def test_head_256_is_refused_where_a_block_gets_99_kb(monkeypatch):
    assert _validate_on_gpu(monkeypatch, (8, 9), 128, L4_SMEM) == []
    reasons = _validate_on_gpu(monkeypatch, (8, 9), 256, L4_SMEM)
    assert reasons == ["head_size 256 needs 102400 bytes of shared memory per block in the CUDA "
                       "TPP kernel, this GPU (8.9) allows 101376"]


@pytest.mark.parametrize("kv,model,per_head,refused", [
    ("auto", torch.float32, False, None), ("bfloat16", torch.bfloat16, True, None),
    ("fp8", torch.bfloat16, False, None), ("fp8_e4m3", "float16", False, None),
    ("fp8_e5m2", torch.float16, False, None), ("fp8", torch.float32, False, "float32 model"),
    ("fp8_inc", torch.bfloat16, False, "fp8_inc KV cache"), ("fp8", torch.float16, True, "per-head")])
def test_the_fp8_caches_the_cuda_kernel_reads(kv, model, per_head, refused):
    from vllm_chunkattn.ops import cuda_fit
    reason = cuda_fit.fp8_refusal(kv, model, per_head)
    assert reason is None if refused is None else refused in reason


def test_below_sm80_is_refused_at_selection(monkeypatch):
    reasons = _validate_on_gpu(monkeypatch, (7, 5), 128, 65536)
    assert len(reasons) == 1 and "compute capability >= 8.0" in reasons[0]
    assert "7.5" in reasons[0]


# ---- the host plan check: the CPU op's plan checks and messages, on host tensors

def _replace(t: torch.Tensor, i: int, v: int) -> torch.Tensor:
    t = t.clone()
    t[i] = v
    return t


def _plan(p: TppPlan, **fields) -> TppPlan:
    return TppPlan(**{**vars(p), **fields})


# Each corruption: (plan, block_table, seq_lens, num_blocks) -> the same, broken.
CORRUPTIONS = {
    "node_seq_ids_out_of_rows": lambda p, bt, sl, nb: (
        _plan(p, node_seq_ids=_replace(p.node_seq_ids, 0, sl.numel())), bt, sl),
    "seq_partial_ids_out_of_partials": lambda p, bt, sl, nb: (
        _plan(p, seq_partial_ids=_replace(p.seq_partial_ids, -1, p.num_partials)), bt, sl),
    "node_block_indptr_end": lambda p, bt, sl, nb: (
        _plan(p, node_block_indptr=_replace(p.node_block_indptr, -1,
                                            int(p.node_block_indptr[-1]) + 1)), bt, sl),
    "node_seq_indptr_decreases": lambda p, bt, sl, nb: (
        _plan(p, node_seq_indptr=_replace(p.node_seq_indptr, 1,
                                          int(p.node_seq_indptr[2]) + 1)), bt, sl),
    "node_block_id_past_cache": lambda p, bt, sl, nb: (
        _plan(p, node_block_ids=_replace(p.node_block_ids, 0, nb)), bt, sl),
    "shared_blocks_past_seq_len": lambda p, bt, sl, nb: (
        _plan(p, seq_num_shared_blocks=_replace(p.seq_num_shared_blocks, 0, 1000)), bt, sl),
    "seq_len_past_block_table": lambda p, bt, sl, nb: (
        p, bt, _replace(sl, 0, 10 ** 6)),
    "block_table_tail_past_cache": lambda p, bt, sl, nb: (
        p, _tail_block(bt, sl, nb), sl),
    "seq_partial_ids_short": lambda p, bt, sl, nb: (
        _plan(p, seq_partial_ids=p.seq_partial_ids[:-1]), bt, sl),
    "node_seq_ids_int64": lambda p, bt, sl, nb: (
        _plan(p, node_seq_ids=p.node_seq_ids.long()), bt, sl),
}


def _tail_block(bt: torch.Tensor, sl: torch.Tensor, num_blocks: int) -> torch.Tensor:
    bt = bt.clone()
    bt[0, (int(sl[0]) - 1) // 16] = num_blocks        # row 0's last (always private) block
    return bt


def _first_line(err: pytest.ExceptionInfo) -> str:
    return str(err.value).splitlines()[0]


@needs_native
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_host_check_raises_what_the_cpu_op_raises(corruption):
    b = random_tree_batch(3, **TREE_SPECS["deep_tree"], num_heads=4, num_kv_heads=2,
                          block_size=16)
    num_blocks = b.key_cache.shape[0]
    good = build_plan(b.block_table, b.seq_lens, 16)
    assert good.num_nodes >= 2
    check_plan(good, b.block_table, b.seq_lens, 16, num_blocks)          # a good plan passes
    plan, bt, sl = CORRUPTIONS[corruption](good, b.block_table, b.seq_lens, num_blocks)
    num_seqs, num_heads, head_size = b.query.shape
    slots = max(plan.num_partials, 1)
    with pytest.raises(RuntimeError) as cpu_err:
        CPU_OPS.tpp_decode(b.query, b.key_cache, b.value_cache, bt, sl, *plan.tensors(), torch.zeros(slots, num_heads, head_size),
                           torch.zeros(slots, num_heads), torch.zeros(slots, num_heads), b.scale,
                           torch.empty_like(b.query), None)
    with pytest.raises(RuntimeError) as host_err:
        check_plan(plan, bt, sl, 16, num_blocks)
    assert _first_line(host_err) == _first_line(cpu_err)
    assert _first_line(cpu_err).startswith("tpp_decode: ")


@needs_native
def test_plan_cache_checks_the_host_plan_for_a_device():
    # A block id past the cache: PlanCache (as for CUDA) refuses it on the host, before the copy;
    # with num_blocks unknown only negative ids are refused.
    b = random_tree_batch(4, **TREE_SPECS["system_prompts"], block_size=16)
    num_blocks = b.key_cache.shape[0]
    cache = PlanCache(16, "cpu", check_on_host=True)
    cache.get(b.block_table, b.seq_lens, num_blocks)
    bt = _tail_block(b.block_table, b.seq_lens, num_blocks)
    with pytest.raises(RuntimeError, match=r"block_table row\[\d+\] = \d+ not in \[0, "):
        cache.get(bt, b.seq_lens, num_blocks)            # reused plan: the tails are checked too
    cache.get(bt, b.seq_lens)
    bt[0, 0] = -7
    with pytest.raises(RuntimeError, match="not in"):
        PlanCache(16, "cpu", check_on_host=True).get(bt, b.seq_lens)
    assert not PlanCache(16, "cpu").check_on_host          # the CPU op checks on every call


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(os.environ.get("CHUNKATTN_COMPILE_TEST") != "1",
                    reason="~2 min on 2 cores; set CHUNKATTN_COMPILE_TEST=1 (CI runs .ci/compile_cuda.sh)")
def test_cuda_sources_compile():
    r = subprocess.run(["bash", str(ROOT / ".ci" / "compile_cuda.sh"), os.sys.executable],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
