"""A few small trees through the CUDA TPP op, for compute-sanitizer (run_on_device.sh runs it
under memcheck and racecheck, instrumenting only our kernels): tree shapes with several nodes,
GQA head tiles, split-KV scratch slots, every head size, a capacity-padded plan, the attention
variants (sliding window, soft cap, sinks) and fp8 KV caches (e4m3 / e5m2). Each result
is also checked against the reference, so the run fails on a wrong answer as well.
Usage: [compute-sanitizer --kernel-name kns=tpp_ ...] python benchmarks/gpu/sanitize_tpp.py"""
from __future__ import annotations

import os
import sys

import torch

from vllm_chunkattn.plan import TppWorkspace
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import tpp_decode_reference
from vllm_chunkattn.plan import TppPlan, build_plan
from vllm_chunkattn.plan.capacity import PlanCapacity, pad_plan
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, fp8_kv_batch, random_tree_batch

# (spec, num_heads, num_kv_heads, head_size, block_size, dtype, (chunk splits, seq splits), pad,
# (partial stage, final stage)): pad True: empty nodes added; "capacity": padded as for a CUDA
# graph (plan/capacity.py) with the splits left to the op (0, 0), so a padded plan's CTAs choose
# them (tpp_params.cuh), in the workspace the backend gives graphs. Stages: partial 32 is its
# compact stage (CHUNKATTN_PARTIAL_STAGE_TOKENS), final 64 the final launch in the default stage
# (CHUNKATTN_FINAL_STAGE_TOKENS); 0: each launch's default (64 and the compact 32 at head 128).
# A last dict, where given: the op's sliding_window / soft_cap / sinks (sinks: True for one per head),
# and "fp8": the KV cache stored as that fp8 dtype with FP8_SCALES.
CASES = [
    ("deep_tree", 8, 2, 64, 16, torch.float16, (1, 1), False, (0, 0)),
    ("system_prompts", 16, 4, 128, 32, torch.bfloat16, (2, 3), False, (0, 0)),
    ("batch_17", 9, 3, 256, 16, torch.float16, (1, 2), True, (0, 0)),
    ("system_prompts", 32, 8, 128, 16, torch.bfloat16, (0, 0), "capacity", (0, 0)),
    ("deep_tree", 16, 4, 128, 16, torch.float16, (2, 3), False, (0, 64)),
    ("system_prompts", 32, 8, 128, 16, torch.bfloat16, (0, 0), "capacity", (32, 0)),
    ("system_prompts", 8, 2, 96, 16, torch.float16, (2, 2), False, (0, 0),
     dict(sliding_window=24, soft_cap=10.0, sinks=True)),
    ("deep_tree", 16, 4, 128, 16, torch.bfloat16, (3, 2), False, (32, 0), dict(sliding_window=5)),
    ("system_prompts", 32, 8, 128, 16, torch.bfloat16, (0, 0), "capacity", (0, 0),
     dict(sliding_window=40, sinks=True)),
    ("deep_tree", 16, 4, 128, 16, torch.float16, (2, 3), False, (0, 0),
     dict(fp8=torch.float8_e4m3fn)),
    ("system_prompts", 8, 2, 96, 16, torch.bfloat16, (2, 2), False, (32, 64),
     dict(sliding_window=24, soft_cap=10.0, sinks=True, fp8=torch.float8_e5m2)),
    ("system_prompts", 32, 8, 128, 16, torch.bfloat16, (0, 0), "capacity", (0, 0),
     dict(fp8=torch.float8_e4m3fn)),
]
FP8_SCALES = dict(k_scale=0.37, v_scale=1.9)


def pad(plan: TppPlan, extra_nodes: int, extra_partials: int) -> TppPlan:
    """Capacity mode: empty nodes (indptrs repeat), partial ids padded to a fixed capacity."""
    def rep(t):
        return torch.cat([t, t[-1:].repeat(extra_nodes)])

    def ids(t):
        return torch.cat([t, torch.zeros(extra_partials, dtype=t.dtype)])
    return TppPlan(plan.num_seqs, plan.num_nodes + extra_nodes, plan.num_partials + extra_partials,
                   rep(plan.node_block_indptr), plan.node_block_ids, rep(plan.node_seq_indptr),
                   ids(plan.node_seq_ids), plan.seq_partial_indptr, ids(plan.seq_partial_ids),
                   plan.seq_num_shared_blocks,
                   torch.cat([plan.node_first_block, torch.zeros(extra_nodes, dtype=torch.int32)]))


def main() -> int:
    ops = native_ops(torch.device("cuda"))
    assert ops is not None, "the CUDA kernel is not built"
    failures = 0
    for i, (spec, hq, hkv, d, bs, dtype, splits, padded, (partial, final), *rest) in enumerate(CASES):
        variant = dict(rest[0]) if rest else {}
        fp8 = variant.pop("fp8", None)
        if variant.get("sinks"):
            variant["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(i)).cuda()
        os.environ["CHUNKATTN_CHUNK_SPLITS"], os.environ["CHUNKATTN_SEQ_SPLITS"] = map(str, splits)
        os.environ["CHUNKATTN_PARTIAL_STAGE_TOKENS"] = str(partial)
        os.environ["CHUNKATTN_FINAL_STAGE_TOKENS"] = str(final)
        b = random_tree_batch(i, **TREE_SPECS[spec], num_heads=hq, num_kv_heads=hkv,
                              head_size=d, block_size=bs, dtype=dtype, device="cuda")
        if fp8 is not None:
            b = fp8_kv_batch(b, fp8, **FP8_SCALES)
            variant.update(FP8_SCALES)
        plan = build_plan(b.block_table.cpu(), b.seq_lens.cpu(), bs)
        num_seqs = b.query.shape[0]
        if padded == "capacity":
            cap = PlanCapacity.for_batch(num_seqs, b.block_table.shape[1])
            run_plan = pad_plan(build_plan(b.block_table.cpu(), b.seq_lens.cpu(), bs,
                                           max_partials=cap.num_partials,
                                           max_node_blocks=cap.num_node_blocks), cap).to("cuda")
            slots = TppWorkspace(spare_rows_per_partial=0).rows(cap.num_partials, num_seqs, "cuda")
        else:
            run_plan = (pad(plan, 3, 5) if padded else plan).to("cuda")
            # Exactly the slots the forced splits need: a read or write past them is an error.
            slots = max(splits[0] * run_plan.num_partials + num_seqs * (splits[1] - 1), 1)
        ws = (torch.full((slots, hq, d), float("nan"), device="cuda"),
              torch.full((slots, hq), float("nan"), device="cuda"),
              torch.full((slots, hq), float("nan"), device="cuda"))
        out = torch.full_like(b.query, float("nan"))
        lse = torch.full((num_seqs, hq), float("nan"), device="cuda")
        ops.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                       *run_plan.tensors(), *ws, b.scale, out, lse, **variant)
        torch.cuda.synchronize()
        ref = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                   b.seq_lens, plan.to("cuda"), b.scale, **variant)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        ok = not out.isnan().any().item() and err < 2e-2
        label = ("capacity " if padded == "capacity" else "padded " if padded else "") + (
            f"partial stage {partial} " if partial else "") + (f"final stage {final} " if final else "") + (
            f"{', '.join(sorted(variant))} " if variant else "") + (
            f"{str(fp8)[6:]} KV " if fp8 else "")
        failures += not ok
        print(f"{spec:15s} heads {hq}/{hkv} d {d} block {bs} {str(dtype)[6:]:8s} splits {splits} "
              f"{label}nodes {plan.num_nodes} partials {plan.num_partials}: "
              f"rel err {err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
