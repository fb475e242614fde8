"""Tree-shaped decode batches of the GPU kernel grid, as block tables over one KV pool.

A point is a list of decode rows. Each row reads a path of shared nodes (root first) and then a
private tail. Rows that name the same node get the same physical blocks, so the sharing is
exactly what the tree says and nothing else. Shared nodes are whole blocks: vLLM shares only
full blocks, and so does build_plan. A prompt that does not end on a block boundary leaves a
partial block, and that block is private to each sample. The generators here therefore draw
prompt lengths in whole blocks.

The grids:
  paper    the paper's Table 3: b = 32, 32/32 heads, d 128, fp16, chunk 64, n_p in {1K, 2K, 4K},
           n_s in {0, n_p/2, 3n_p/4, n_p}; every row holds n_p prompt tokens + the new one;
  llama8b  Llama-3-8B decode: 32/8 heads, d 128, bf16, block 16, b in {32, 128, 256}, one shared
           prefix of 1K/2K/4K + 128 or 1K private tokens, plus a nothing-shared point per b;
  rl       RL rollouts: G prompts x n samples (G in {4, 16}, n in {8, 16}); each prompt is shared
           by its n samples, and each sample has a private tail of generated tokens + the new one;
  fewshot  nested few-shot trees of depth 3: system prompt (all rows) -> few-shot block (a subset)
           -> question (its samples) -> private answers; the "uneven" point adds zero-shot
           questions directly under the system prompt, so its rows have 2 or 3 shared nodes;
  smoke    tiny points of every kind (CPU tests, a quick sanity run on a GPU).
Rows come out in DFS order of the tree: the samples of one prompt are adjacent, as vLLM's
n-sampling puts them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttnShape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str              # torch dtype name

    def __str__(self) -> str:
        return (f"{self.num_heads}/{self.num_kv_heads} heads, d {self.head_size}, {self.dtype}, "
                f"block {self.block_size}")


PAPER = AttnShape(32, 32, 128, 64, "float16")        # ChunkAttention's Table 3
LLAMA3_8B = AttnShape(32, 8, 128, 16, "bfloat16")    # vLLM's default block size
# Tiny, but with d 128 and bf16, so that on a device it needs no FlashInfer JIT module the
# llama8b / rl / fewshot grids do not also need.
SMOKE = AttnShape(8, 2, 128, 16, "bfloat16")


@dataclass
class TreePoint:
    grid: str
    label: str
    shape: AttnShape
    node_tokens: dict[str, int]         # shared node -> its tokens (whole blocks)
    paths: list[tuple[str, ...]]        # per row: the shared nodes it reads, root first
    private_tokens: list[int]           # per row: tokens after its path, the new one included
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        bs = self.shape.block_size
        if len(self.paths) != len(self.private_tokens):
            raise ValueError(f"{self.label}: {len(self.paths)} paths, "
                             f"{len(self.private_tokens)} private tails")
        for node, tokens in self.node_tokens.items():
            if tokens <= 0 or tokens % bs:
                raise ValueError(f"{self.label}: node {node} has {tokens} tokens, not whole "
                                 f"blocks of {bs}")
        if min(self.private_tokens) < 1:
            raise ValueError(f"{self.label}: every row needs its new token in the private tail")
        ancestors: dict[str, tuple[str, ...]] = {}
        for path in self.paths:           # a tree: a node has the same ancestors in every row
            for depth, node in enumerate(path):
                if node not in self.node_tokens:
                    raise ValueError(f"{self.label}: row path names unknown node {node}")
                if ancestors.setdefault(node, path[:depth]) != path[:depth]:
                    raise ValueError(f"{self.label}: node {node} under two different parents")

    @property
    def num_rows(self) -> int:
        return len(self.paths)

    def seq_lens(self) -> list[int]:
        return [sum(self.node_tokens[n] for n in path) + private
                for path, private in zip(self.paths, self.private_tokens)]

    def blocks_needed(self) -> int:
        bs = self.shape.block_size
        return (sum(t // bs for t in self.node_tokens.values())
                + sum(-(-p // bs) for p in self.private_tokens))

    def depth(self) -> int:
        return max(len(p) for p in self.paths)


def tree_block_table(point: TreePoint, num_pool_blocks: int, generator: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table [rows, width] int32, 0-padded; seq_lens [rows] int32) with the point's blocks
    drawn at random from pool blocks 1 .. num_pool_blocks - 1 (block 0 stays the null block)."""
    bs = point.shape.block_size
    need = point.blocks_needed()
    if need > num_pool_blocks - 1:
        raise ValueError(f"{point.label}: needs {need} blocks, the pool has {num_pool_blocks - 1}")
    ids = (torch.randperm(num_pool_blocks - 1, generator=generator)[:need] + 1).tolist()
    node_ids = {}
    for node, tokens in point.node_tokens.items():
        node_ids[node], ids = ids[:tokens // bs], ids[tokens // bs:]
    rows = []
    for path, private in zip(point.paths, point.private_tokens):
        own, ids = ids[:-(-private // bs)], ids[-(-private // bs):]
        rows.append([b for node in path for b in node_ids[node]] + own)
    table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return table, torch.tensor(point.seq_lens(), dtype=torch.int32)


# ---- generators

def single_prefix(grid: str, label: str, shape: AttnShape, rows: int, shared: int,
                  private: int) -> TreePoint:
    """One prefix of `shared` tokens read by all rows (none if 0), then `private` tokens a row."""
    nodes = {"prefix": shared} if shared else {}
    path = ("prefix",) if shared else ()
    return TreePoint(grid, label, shape, nodes, [path] * rows, [private] * rows)


def _whole_blocks(tokens: int, block_size: int) -> int:
    return max(block_size, tokens // block_size * block_size)


def rollouts(grid: str, label: str, shape: AttnShape, groups: int, samples: int,
             prompt: tuple[int, int], generated: tuple[int, int], seed: int) -> TreePoint:
    """G prompts x n samples. Each prompt's length is drawn uniformly in [prompt] and rounded
    down to whole blocks; each sample has drawn-in-[generated] tokens + the new one."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))
    nodes = {f"p{i}": _whole_blocks(draw(*prompt), shape.block_size) for i in range(groups)}
    paths = [(f"p{i}",) for i in range(groups) for _ in range(samples)]
    private = [draw(*generated) + 1 for _ in paths]
    return TreePoint(grid, label, shape, nodes, paths, private)


def few_shot(grid: str, label: str, shape: AttnShape, *, system: int, shots: int,
             shot_tokens: int, questions: int, question_tokens: int, samples: int,
             generated: tuple[int, int], zero_shot_questions: int = 0, seed: int = 0
             ) -> TreePoint:
    """system prompt -> `shots` few-shot blocks -> `questions` questions under each block ->
    `samples` rows per question, each with drawn-in-[generated] tokens + the new one.
    zero_shot_questions more questions hang directly under the system prompt (uneven depth)."""
    g = torch.Generator().manual_seed(seed)
    nodes = {"sys": system}
    leaves: list[tuple[str, ...]] = []
    for j in range(shots):
        nodes[f"sys/shot{j}"] = shot_tokens
        for k in range(questions):
            nodes[f"sys/shot{j}/q{k}"] = question_tokens
            leaves.append(("sys", f"sys/shot{j}", f"sys/shot{j}/q{k}"))
    for k in range(zero_shot_questions):
        nodes[f"sys/q{k}"] = question_tokens
        leaves.append(("sys", f"sys/q{k}"))
    paths = [leaf for leaf in leaves for _ in range(samples)]
    lo, hi = generated
    private = [int(torch.randint(lo, hi + 1, (1,), generator=g)) + 1 for _ in paths]
    return TreePoint(grid, label, shape, nodes, paths, private)


# ---- the grids

def paper_grid() -> list[TreePoint]:
    points = []
    for n_p in (1024, 2048, 4096):
        for n_s in (0, n_p // 2, 3 * n_p // 4, n_p):
            points.append(single_prefix("paper", f"n_p={n_p} n_s={n_s}", PAPER, 32, n_s,
                                        n_p - n_s + 1))
    return points


def llama8b_grid() -> list[TreePoint]:
    points = []
    for b in (32, 128, 256):
        points.append(single_prefix("llama8b", f"b={b} nothing shared, S=1024", LLAMA3_8B, b, 0,
                                    1024))
        for shared in (1024, 2048, 4096):
            for private in (128, 1024):
                points.append(single_prefix("llama8b", f"b={b} P={shared} S={private}",
                                            LLAMA3_8B, b, shared, private))
    return points


def rl_grid() -> list[TreePoint]:
    regimes = [("prompt 4K, gen 0", (4096, 4096), (0, 0)),
               ("prompt 1K, gen 2K", (1024, 1024), (2048, 2048)),
               ("prompt 1-4K, gen 0-2K", (1024, 4096), (0, 2048))]
    points = []
    for groups in (4, 16):
        for samples in (8, 16):
            for i, (name, prompt, generated) in enumerate(regimes):
                points.append(rollouts("rl", f"G={groups} n={samples} {name}", LLAMA3_8B, groups,
                                       samples, prompt, generated, seed=100 * groups + samples + i))
    return points


def fewshot_grid() -> list[TreePoint]:
    base = dict(system=1024, shots=4, shot_tokens=1024, questions=4, question_tokens=256,
                samples=4, generated=(0, 512))
    return [
        few_shot("fewshot", "sys 1K > 4 shots x 1K > 4 q x 256 > 4 samples", LLAMA3_8B, **base,
                 seed=1),
        few_shot("fewshot", "sys 2K > 4 shots x 2K > 4 q x 512 > 8 samples", LLAMA3_8B,
                 system=2048, shots=4, shot_tokens=2048, questions=4, question_tokens=512,
                 samples=8, generated=(0, 1024), seed=2),
        few_shot("fewshot", "uneven: as the first + 4 zero-shot q under sys", LLAMA3_8B, **base,
                 zero_shot_questions=4, seed=3),
    ]


def smoke_grid() -> list[TreePoint]:
    return [
        single_prefix("smoke", "b=4 nothing shared", SMOKE, 4, 0, 40),
        single_prefix("smoke", "b=4 P=64 S=20", SMOKE, 4, 64, 20),
        rollouts("smoke", "G=2 n=3", SMOKE, 2, 3, (32, 64), (0, 40), seed=7),
        few_shot("smoke", "uneven few-shot", SMOKE, system=32, shots=2, shot_tokens=32,
                 questions=2, question_tokens=16, samples=2, generated=(0, 20),
                 zero_shot_questions=1, seed=8),
    ]


GRIDS = {"paper": paper_grid, "llama8b": llama8b_grid, "rl": rl_grid, "fewshot": fewshot_grid,
         "smoke": smoke_grid}
ALL_GPU = ("paper", "llama8b", "rl", "fewshot")        # --grid gpu


def grid_points(name: str) -> list[TreePoint]:
    return [p for g in (ALL_GPU if name == "gpu" else (name,)) for p in GRIDS[g]()]


def pool_blocks(points: list[TreePoint]) -> int:
    """Pool size (null block included) that holds any one of the points."""
    return 1 + max(p.blocks_needed() for p in points)


def describe(point: TreePoint) -> str:
    """e.g. '64 rows, 21 shared nodes, depth 3' for the tables."""
    return (f"{point.num_rows} rows, {len(point.node_tokens)} shared nodes, depth {point.depth()}"
            f", {math.fsum(point.seq_lens()) / point.num_rows:.0f} tokens/row")
