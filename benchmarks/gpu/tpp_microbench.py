"""CUDA TPP kernel timings on shared-prefix shapes: the tree plan vs the same kernel with no
sharing (empty plan), with KV bytes and the bandwidth they imply. Needs a CUDA GPU.
The two plans are timed side by side (ABBA rounds) after their outputs were checked equal. Calls
replay back to back from one graph with no L2 flush: a shape whose KV fits in L2 is timed
warm, and its GB/s can exceed HBM's (the row says so: "<label>_l2_resident"). bench kernel's
grids flush L2 before every repeat.
Usage: python benchmarks/gpu/tpp_microbench.py [--out results.json]"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from vllm_chunkattn.bench.timing import Timer
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.plan import build_plan, empty_plan

# (name, batch, shared prefix tokens, private tail tokens, groups): groups > 1 = that many
# distinct prefixes (system prompts), each shared by batch / groups rows.
SHAPES = [
    ("anchor_b128_p4096_s128", 128, 4096, 128, 1),
    ("grpo_b64_p2048_s512", 64, 2048, 512, 1),
    ("sysprompts_b128_p1024_s256_x8", 128, 1024, 256, 8),
    ("small_b16_p512_s64", 16, 512, 64, 1),
    ("long_tail_b4_p256_s8192", 4, 256, 8192, 1),
]
ITERS = 50          # calls per graph
REPLAYS, ROUNDS = 30, 6    # replays of each graph, in rounds tpp, no_sharing | no_sharing, tpp | ...


def make(batch, prefix, tail, groups, num_heads, num_kv_heads, head_size, block_size, dtype):
    pb, tb = prefix // block_size, -(-tail // block_size)
    num_blocks = 1 + groups * pb + batch * tb
    kv = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype, device="cuda")
    rows = []
    for i in range(batch):
        g = i % groups
        shared = list(range(1 + g * pb, 1 + (g + 1) * pb))
        own = list(range(1 + groups * pb + i * tb, 1 + groups * pb + (i + 1) * tb))
        rows.append(shared + own)
    bt = torch.tensor(rows, dtype=torch.int32)
    seq_lens = torch.full((batch,), prefix + tail, dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_size, dtype=dtype, device="cuda")
    return q, kv[..., :head_size], kv[..., head_size:], bt, seq_lens


def graph_of(fn, iters=ITERS) -> torch.cuda.CUDAGraph:
    """fn captured iters times in one graph: replayed, it is launched as vLLM's graphs launch it.
    The graph holds fn (its plan, workspace and output, read by address at every replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    g.captured_fn = fn   # kept: freed, its tensors' blocks would go to the next plan while
                         # the graph still reads them
    return g


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args(argv)
    ops = native_ops(torch.device("cuda"))
    assert ops is not None, "CUDA kernel not built"
    dtype = getattr(torch, a.dtype)
    hq, hkv = map(int, a.heads.split(","))
    elem = torch.finfo(dtype).bits // 8
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for name, batch, prefix, tail, groups in SHAPES:
        q, k, v, bt, sl = make(batch, prefix, tail, groups, hq, hkv, a.head_size, a.block_size, dtype)
        row = dict(shape=name, batch=batch, prefix=prefix, tail=tail, groups=groups,
                   heads=a.heads, head_size=a.head_size, block_size=a.block_size, dtype=a.dtype)
        tok_bytes = 2 * hkv * a.head_size * elem              # K + V per token per layer
        btc, slc = bt.cuda(), sl.cuda()
        graphs, outs = {}, {}
        for label, plan in (("tpp", build_plan(bt, sl, a.block_size)), ("no_sharing", empty_plan(batch))):
            plan = plan.to("cuda")
            spare = 16 * plan.num_partials + 16 * batch     # room for split-KV slots
            ws = [torch.empty(plan.num_partials + spare, hq, a.head_size, device="cuda"),
                  torch.empty(plan.num_partials + spare, hq, device="cuda"),
                  torch.empty(plan.num_partials + spare, hq, device="cuda")]
            out = outs[label] = torch.empty_like(q)

            def call(plan=plan, ws=ws, out=out):
                ops.tpp_decode(q, k, v, btc, slc, *plan.tensors(), *ws,
                               a.head_size ** -0.5, out, None)
            graphs[label] = graph_of(call)
        # the same attention either way (tree vs none): a plan that computes something else
        # must not be timed as a speed-up
        torch.testing.assert_close(outs["tpp"].float(), outs["no_sharing"].float(), atol=2e-2,
                                   rtol=2e-2)
        # ms per replay of ITERS calls, the two plans side by side (ABBA rounds)
        timed = Timer(torch.device("cuda"), flush_l2=False).side_by_side(
            {label: g.replay for label, g in graphs.items()}, reps=REPLAYS, rounds=ROUNDS)
        for label, ms in timed.items():
            us = ms * 1e3 / ITERS
            tokens = (groups * prefix + batch * tail) if label == "tpp" else batch * (prefix + tail)
            row[f"{label}_us"] = round(us, 2)
            row[f"{label}_kv_MiB"] = round(tokens * tok_bytes / 2**20, 2)
            row[f"{label}_GBps"] = round(tokens * tok_bytes / us / 1e3, 1)
            row[f"{label}_l2_resident"] = tokens * tok_bytes <= l2_bytes
        row["speedup"] = round(row["no_sharing_us"] / row["tpp_us"], 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
