"""Capacity mode: TppPlans padded to sizes fixed per batch size, so one CUDA graph replays any tree.

A captured graph keeps the kernel's pointers and grid sizes. The CUDA op sizes its grids from the
plan tensors' shapes only (csrc/cuda/tpp_decode.cu), so a plan padded to fixed capacities, written
each step into the same device buffer, is one the graph can replay: extra nodes are empty
(node_*_indptr repeat their last value), extra partial ids are never referenced, and rows vLLM pads
the batch with have seq_len 0 and no partials (they come out as 0). A padded plan has
num_seqs - 1 nodes: by that the op knows its shapes are capacities, and its CTAs choose the
chunk-first KV splits from the real tree (csrc/cuda/tpp_params.cuh, chunk_splits_of).

Capacities of a batch of B rows:
  nodes:       B - 1, the most a tree of B leaves has (every node has >= 2 rows; see tpp_plan.py);
  partials:    PARTIALS_PER_ROW * B, a tree of that depth; a deeper tree is pruned to fit
               (build.build_plan's max_partials: its deepest nodes are read privately, still exact);
  node blocks: every node has >= 2 rows, so at most B // 2 table rows of blocks, capped at
               MAX_NODE_BLOCKS (a bigger shared set is pruned the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tpp_plan import TppPlan, _as_int32

PARTIALS_PER_ROW = 4
MAX_NODE_BLOCKS = 1 << 15


@dataclass(frozen=True)
class PlanCapacity:
    num_seqs: int
    num_nodes: int
    num_partials: int
    num_node_blocks: int

    @classmethod
    def for_batch(cls, num_seqs: int, table_width: int) -> "PlanCapacity":
        """num_seqs: rows of the (padded) batch; table_width: block table columns."""
        return cls(num_seqs, max(num_seqs - 1, 0), PARTIALS_PER_ROW * num_seqs,
                   min(num_seqs // 2 * table_width, MAX_NODE_BLOCKS))

    @property
    def num_ints(self) -> int:
        """int32 elements of a padded plan's eight arrays together."""
        return (2 * (self.num_nodes + 1) + self.num_node_blocks + 2 * self.num_partials
                + 2 * self.num_seqs + 1 + self.num_nodes)


def pad_plan(plan: TppPlan, cap: PlanCapacity) -> TppPlan:
    """plan (host, built with the capacity's max_partials / max_node_blocks) padded to cap."""
    if (plan.num_seqs != cap.num_seqs or plan.num_nodes > cap.num_nodes
            or plan.num_partials > cap.num_partials
            or plan.num_shared_blocks > cap.num_node_blocks):
        raise ValueError(f"plan of {plan.num_seqs} rows, {plan.num_nodes} nodes, "
                         f"{plan.num_partials} partials, {plan.num_shared_blocks} node blocks "
                         f"does not fit {cap}")

    def pad(t, n: int, fill: int | None = None) -> np.ndarray:
        a = t.numpy()
        tail = np.full(n - a.size, a[-1] if fill is None else fill, np.int32)
        return np.concatenate([a, tail])
    return TppPlan(cap.num_seqs, cap.num_nodes, cap.num_partials,
                   _as_int32(pad(plan.node_block_indptr, cap.num_nodes + 1)),
                   _as_int32(pad(plan.node_block_ids, cap.num_node_blocks, 0)),
                   _as_int32(pad(plan.node_seq_indptr, cap.num_nodes + 1)),
                   _as_int32(pad(plan.node_seq_ids, cap.num_partials, 0)),
                   plan.seq_partial_indptr,
                   _as_int32(pad(plan.seq_partial_ids, cap.num_partials, 0)),
                   plan.seq_num_shared_blocks,
                   _as_int32(pad(plan.node_first_block, cap.num_nodes, 0)))
