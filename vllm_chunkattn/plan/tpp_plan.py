"""TppPlan: the sharing tree of one decode batch, in CSR, built once per step from the block table
(build.py).

Rows of the block table that start with the same full blocks share those blocks' KV. Sorting the
rows lexicographically puts sharers next to each other (the DFS order of the prefix tree), and the
longest common prefix (LCP) of neighbours gives the tree: every maximal run of columns held by the
same set of >= 2 rows is one *shared node*.

    block_table (decode rows, sorted)          shared nodes           partials (one per sharer)
    row a: [7  8  9 | 3 ]                      n0: blocks [7 8]       p0 p1 p2  (rows a b c, node n0)
    row b: [7  8  9 | 5 ]                          rows  a b c
    row c: [7  8 | 4  6 ]                      n1: blocks [9]         p3 p4     (rows a b, node n1)
                                                   rows  a b
    '|' = seq_num_shared_blocks: the private tail starts there and is walked by the sequence-first
    phase, which merges the row's partials (seq_partial_*) by online softmax.

Only full blocks are shared (a row's partial last block is always private), so every sharer sees
every token of a node and the chunk-first phase needs no mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TppPlan:
    """CSR description of one decode batch. All tensors int32, on the device of the kernel.

    node_block_indptr:   [num_nodes + 1]   node n owns node_block_ids[indptr[n]:indptr[n+1]]
    node_block_ids:      [num_node_blocks] physical block ids (vLLM block ids), in token order
    node_seq_indptr:     [num_nodes + 1]   node n is seen by rows node_seq_ids[indptr[n]:indptr[n+1]];
                                           position j in node_seq_ids is partial state j
    node_seq_ids:        [num_partials]    decode row indices (rows of query / block_table)
    seq_partial_indptr:  [num_seqs + 1]    row i merges partials seq_partial_ids[indptr[i]:indptr[i+1]]
    seq_partial_ids:     [num_partials]
    seq_num_shared_blocks: [num_seqs]      first private column of block_table for row i
    node_first_block:    [num_nodes]       the block table column node n starts at, the same in
                                           every sharer (its depth in the tree): where a sliding
                                           window's edge falls inside the node
    """

    num_seqs: int
    num_nodes: int
    num_partials: int
    node_block_indptr: torch.Tensor
    node_block_ids: torch.Tensor
    node_seq_indptr: torch.Tensor
    node_seq_ids: torch.Tensor
    seq_partial_indptr: torch.Tensor
    seq_partial_ids: torch.Tensor
    seq_num_shared_blocks: torch.Tensor
    node_first_block: torch.Tensor

    # The plan's tensors in the order the op takes them (csrc/tpp_schema.h): the one place
    # Python writes that list (the op call, its host check, the staging buffer, capacity padding).
    TENSORS = ("node_block_indptr", "node_block_ids", "node_seq_indptr", "node_seq_ids",
               "seq_partial_indptr", "seq_partial_ids", "seq_num_shared_blocks",
               "node_first_block")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The eight plan tensors, in the op's argument order."""
        return tuple(getattr(self, name) for name in self.TENSORS)

    @property
    def num_shared_blocks(self) -> int:
        return int(self.node_block_ids.numel())

    def shared_kv_tokens(self, block_size: int) -> int:
        """KV tokens read once for several rows: sum over nodes of (sharers - 1) * tokens."""
        blocks = np.diff(self.node_block_indptr.cpu().numpy())
        sharers = np.diff(self.node_seq_indptr.cpu().numpy())
        return int(((sharers - 1) * blocks).sum()) * block_size

    def to(self, device: torch.device | str) -> "TppPlan":
        # non_blocking only towards a device: a non_blocking copy to the host may be read before
        # it lands.
        non_blocking = torch.device(device).type != "cpu"
        fields = {k: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)
                      else v) for k, v in self.__dict__.items()}
        return TppPlan(**fields)


def _as_int32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def empty_plan(num_seqs: int) -> TppPlan:
    """No sharing: every row is all private (plain paged decode)."""
    z1 = np.zeros(1, np.int32)
    return TppPlan(num_seqs, 0, 0, _as_int32(z1), _as_int32([]), _as_int32(z1), _as_int32([]),
                   _as_int32(np.zeros(num_seqs + 1)), _as_int32([]), _as_int32(np.zeros(num_seqs)),
                   _as_int32([]))
