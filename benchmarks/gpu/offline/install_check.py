"""install_bundle.sh's check, on the GPU host after the install (PYTHONPATH from `install_bundle.sh
env`): torch sees the GPU, NCCL works, vLLM and its CUDA extensions load and compute right on this
torch (the image's 2.11 unless the torch group was carried: TORCH_CARRIED), our kernel builds,
the plugin's entry point is there, every distribution of the closure is installed. Prints
`CHECK OK` / `CHECK FAILED` and exits 0 / 1. Usage: python install_check.py MANIFEST"""
import importlib, importlib.metadata as md, os, sys
from packaging.requirements import Requirement
ok = True
import torch
print("torch", torch.__version__, torch.__file__, "CUDA", torch.version.cuda)
cuda = torch.cuda.is_available()
print("torch.cuda.is_available():", cuda, torch.cuda.get_device_name() if cuda else "")
import ctypes
runtime = ctypes.c_int()        # torch.cuda.nccl.version() is the version torch was built with
try:                            # the libnccl.so.2 torch loaded (found by its soname)
    ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(runtime))
except OSError as e:
    print("NCCL: not loaded -", e)
print("NCCL loaded:", runtime.value, "| LD_PRELOAD:", os.environ.get("LD_PRELOAD", "-"))
if cuda:
    print("cudnn", torch.backends.cudnn.version(), "| torch built with NCCL",
          torch.cuda.nccl.version())
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    print("matmul ok:", bool(torch.isfinite(x @ x).all()))
    import tempfile, torch.distributed as dist
    try:                        # a real NCCL communicator of this torch over the loaded NCCL
        dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        t = torch.full((1024,), 2.0, device="cuda")
        dist.all_reduce(t)
        good = bool((t == 2.0).all())
        dist.destroy_process_group()
        print("NCCL all_reduce (1 rank):", "ok" if good else "WRONG SUM")
        ok &= good
    except Exception as e:  # noqa: BLE001
        print("NCCL all_reduce (1 rank) FAILED -", repr(e)[-800:])
        if os.environ.get("TORCH_CARRIED") == "1":      # the nccl group serves torch 2.13 only
            print("  -> carry the nccl group's remaining parts (collect), then install again")
        ok = False
import triton, vllm
print("triton", triton.__version__, "| vllm", vllm.__version__, vllm.__file__)
for ext in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
    try:
        importlib.import_module(ext)
        print("loaded", ext)
    except ImportError as e:
        print("cannot load", ext, "-", e)
        ok &= ext != "vllm._C_stable_libtorch"     # 0.32's vllm._C (CUDA) goes by this name
if cuda:
    # vLLM's own CUDA ops on this torch against references: on the image's torch 2.11 they run
    # through torch's stable C ABI only (device_image.py TORCH_STACK); wrong or failing means carry
    # torch 2.13 after all.
    try:
        x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w, 1e-6)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        good = torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)   # bf16 rounding
        err = (out.float() - ref).abs().max().item()
        print(f"vllm._C rms_norm: {'ok' if good else 'WRONG'} (max |err| {err:.3g})")
        ok &= good
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        q, k, v = (torch.randn(128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bounds = [(0, 48), (48, 128)]           # two sequences, causal, as a prefill runs them
        cu = torch.tensor([0, 48, 128], device="cuda", dtype=torch.int32)
        fa = get_flash_attn_version(head_size=128) or 2
        o = flash_attn_varlen_func(q, k, v, max_seqlen_q=80, cu_seqlens_q=cu, max_seqlen_k=80,
                                   cu_seqlens_k=cu, causal=True, fa_version=fa)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ref = torch.cat([sdpa(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                              is_causal=True).transpose(0, 1) for a, b in bounds])
        good = torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
        err = (o.float() - ref.float()).abs().max().item()
        print(f"flash-attn {fa} varlen: {'ok' if good else 'WRONG'} (max |err| {err:.3g})")
        ok &= good
    except Exception as e:  # noqa: BLE001
        print("vLLM's CUDA ops FAILED on this torch -", repr(e)[-1500:])
        ok = False
    try:                    # informational: which FlashAttention the FLASH_ATTN backend gets
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        print("platform", type(current_platform).__name__,
              current_platform.get_device_capability(),
              "flash-attn version", get_flash_attn_version(head_size=128))
    except Exception as e:  # noqa: BLE001
        print("flash-attn version: unknown -", repr(e))
    try:                    # the V2 runner's sampler choice must not import FlashInfer (absent)
        from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported
        print("FlashInfer sampler:", "on" if flashinfer_sampler_supported() else "off",
              "| VLLM_USE_FLASHINFER_SAMPLER =", os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"))
    except Exception as e:  # noqa: BLE001
        print("FlashInfer sampler check FAILED (the engine would die loading its sampler) -",
              repr(e)[-400:])
        ok = False
    # Our CUDA kernel for this torch, built here (~1 min) rather than inside the CUSTOM server's
    # start, which runs under serve_ab.sh's time limit; the build is cached by torch version.
    import time
    t = time.time()
    try:
        from vllm_chunkattn.ops.native import kernel_name
        kernel = kernel_name("cuda")
        print(f"chunkattn kernel: {kernel} in {time.time() - t:.0f} s (JIT build cached in "
              f"{os.environ['CHUNKATTN_BUILD_DIR']})")
        ok &= kernel == "native-cuda"
    except Exception as e:  # noqa: BLE001
        print("chunkattn kernel: build FAILED -", str(e)[-3000:])
        ok = False
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins:", eps)
ok &= "vllm_chunkattn.plugin:register" in eps
names = [l.split()[1] for l in open(sys.argv[1]) if l.startswith("closure ")]
env = {"extra": ""}
for name in names:      # warn only: a version that fails a pin may still import fine
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print("MISSING", name); ok = False; continue
    for r in map(Requirement, dist.requires or []):
        if r.marker and not r.marker.evaluate(env):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            continue    # not on the serve path (the closure decides what must be there)
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            why = (" (the image's CUDA libraries, reused on purpose: bundle.py)"
                   if r.name.startswith(("nvidia-", "cuda-toolkit")) else "")
            print(f"version warning: {name} wants {r.name}{r.specifier}, found {have}{why}")
if cuda or os.environ.get("ALLOW_NO_GPU") == "1":
    print("CHECK", "OK" if ok else "FAILED")
    if not ok and os.environ.get("TORCH_CARRIED") == "0":
        print("  -> on the image's torch: carry the torch group's parts (collect; bundle.py "
              "status marks them), then install again: torch 2.13 and triton 3.7.1 then")
else:
    print("CHECK FAILED: no CUDA device"); ok = False
sys.exit(0 if ok else 1)
