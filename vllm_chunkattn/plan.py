"""TppPlan: the sharing tree of one decode batch, built once per step from the block table.

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

import heapq
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
                   _as_int32(np.zeros(num_seqs + 1)), _as_int32([]), _as_int32(np.zeros(num_seqs)))


def first_blocks_shared(block_table: np.ndarray, full: np.ndarray, min_sharers: int = 2) -> bool:
    """Whether min_sharers rows hold the same first full block (`full`: each row's full blocks):
    a plan has a node only then. O(num_seqs log num_seqs), against the plan's sort of every
    block of every row."""
    num_seqs = full.shape[0]
    if num_seqs < min_sharers or not num_seqs or int(full.max()) == 0:
        return False
    first = np.where(full > 0, block_table[:, 0].astype(np.int64), -1 - np.arange(num_seqs))
    first.sort()
    k = min_sharers - 1
    return k < 1 or bool((first[k:] == first[:-k]).any())


def lexicographic_order(rows: np.ndarray) -> np.ndarray:
    """np.lexsort(rows.T[::-1]) (stable, lexicographic by column 0, then 1, ...) in one sort of
    byte strings instead of one sort per column: int32 with its sign bit flipped, big-endian, so
    that bytewise (memcmp) order is numeric order. rows: [n, width] int32, C-contiguous."""
    keys = (rows.view(np.uint32) ^ np.uint32(1 << 31)).astype(">u4")
    return np.argsort(keys.view(np.dtype((np.void, 4 * rows.shape[1]))).ravel(), kind="stable")


def full_blocks(block_table: np.ndarray, full: np.ndarray, width: int) -> np.ndarray:
    """[num_seqs, width] int32: each row's full blocks, then an id of the row's own (negative,
    one per row) so that no block past a row's full prefix matches another row's in its column.
    Block ids are int32, as the kernel's."""
    return np.where(np.arange(width)[None, :] < full[:, None],
                    block_table[:, :width].astype(np.int32),
                    -1 - np.arange(full.shape[0], dtype=np.int32)[:, None])


@dataclass
class SortedRows:
    """A decode batch's rows in lexicographic order of their full blocks: sharers are neighbours."""
    rows: np.ndarray      # [num_seqs, width] full_blocks of the batch, in row order
    order: np.ndarray     # [num_seqs] the row at each sorted position
    sorted: np.ndarray    # rows[order]
    lcp: np.ndarray       # [num_seqs - 1] full blocks sorted rows k and k+1 have in common

    @classmethod
    def of(cls, block_table: np.ndarray, full: np.ndarray) -> "SortedRows":
        width = int(full.max())
        rows = full_blocks(block_table, full, width)
        order = lexicographic_order(rows)
        srt = rows[order]
        neq = srt[1:] != srt[:-1]
        lcp = np.where(neq.any(axis=1), neq.argmax(axis=1), width).astype(np.int64)
        return cls(rows, order, srt, lcp)

    def depths(self) -> np.ndarray:
        """Per row, in row order: the most leading full blocks it has in common with another row
        (with min_sharers 2: its plan's seq_num_shared_blocks, unless pruned to a capacity)."""
        edges = np.concatenate([[0], self.lcp, [0]])
        depth = np.empty(self.order.shape[0], np.int64)
        depth[self.order] = np.maximum(edges[:-1], edges[1:])
        return depth


def build_plan(block_table, seq_lens, block_size: int, min_sharers: int = 2,
               max_partials: int | None = None, max_node_blocks: int | None = None) -> TppPlan:
    """Build the plan of a decode batch.

    block_table: [num_seqs, max_blocks] int (numpy or CPU tensor); row i is valid up to
                 ceil(seq_lens[i] / block_size)
    seq_lens:    [num_seqs] int, tokens of KV each row attends to (new token included)
    max_partials, max_node_blocks: bounds for a plan that must fit fixed buffers (CUDA graphs,
                 plan_capacity.py); the tree's deepest nodes are left private until it fits.
    Cost: O(num_seqs * max_blocks) to sort (none when no first block is shared) plus
    O(num_seqs) for the tree.
    """
    full = _host(seq_lens).astype(np.int64) // block_size      # only full blocks are shared
    return _build(_host(block_table), full, min_sharers, max_partials, max_node_blocks)[0]


def _host(a) -> np.ndarray:
    return np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a)


def _build(bt: np.ndarray, full: np.ndarray, min_sharers: int = 2,
           max_partials: int | None = None, max_node_blocks: int | None = None
           ) -> tuple[TppPlan, SortedRows | None]:
    """build_plan, and the sorted rows it came from (None: the empty plan, without a sort)."""
    num_seqs = int(full.shape[0])
    if not first_blocks_shared(bt, full, min_sharers):
        return empty_plan(num_seqs), None
    rows = SortedRows.of(bt, full)
    return _plan_from_lcp(rows.order, rows.sorted, rows.lcp, num_seqs, min_sharers, max_partials,
                          max_node_blocks), rows


def _plan_from_lcp(order, srt, lcp, num_seqs: int, min_sharers: int,
                   max_partials: int | None = None, max_node_blocks: int | None = None) -> TppPlan:
    # Compressed-trie intervals from the LCP array (stack algorithm): an interval
    # [begin, end) of sorted rows with depth d shares blocks [parent_depth, d).
    nodes = []                                        # (depth_lo, depth_hi, begin, end)
    stack = [(0, 0)]                                  # (depth, begin)
    for k, cur in enumerate(lcp.tolist() + [0]):
        begin = k
        while stack[-1][0] > cur:
            depth, begin = stack.pop()
            parent = max(stack[-1][0], cur)
            if k + 1 - begin >= min_sharers:
                nodes.append((parent, depth, begin, k + 1))
        if stack[-1][0] < cur:
            stack.append((cur, begin))
    nodes.sort(key=lambda n: (n[2], n[0]))            # DFS order: parents before children
    if max_partials is not None or max_node_blocks is not None:
        nodes = _prune_to_fit(nodes, max_partials, max_node_blocks)
    if not nodes:
        return empty_plan(num_seqs)
    lo, hi, begin, end = np.array(nodes, np.int64).T
    node_block_indptr = np.concatenate([[0], np.cumsum(hi - lo)])
    node_seq_indptr = np.concatenate([[0], np.cumsum(end - begin)])
    # Node n's blocks: srt[begin[n], lo[n]:hi[n]]; its rows: order[begin[n]:end[n]].
    node_block_ids = srt.ravel()[_concat_ranges(begin * srt.shape[1] + lo, node_block_indptr)]
    node_seq_ids = order[_concat_ranges(begin, node_seq_indptr)]
    shared = np.zeros(num_seqs, np.int64)             # a row's deepest node ends its prefix
    np.maximum.at(shared, node_seq_ids, np.repeat(hi, end - begin))
    # A row's partials in node (DFS) order: a stable sort of the partials by row.
    seq_partial_ids = np.argsort(node_seq_ids, kind="stable")
    seq_partial_indptr = np.concatenate([[0], np.cumsum(np.bincount(node_seq_ids,
                                                                    minlength=num_seqs))])
    return TppPlan(num_seqs, len(nodes), len(node_seq_ids),
                   _as_int32(node_block_indptr), _as_int32(node_block_ids),
                   _as_int32(node_seq_indptr), _as_int32(node_seq_ids),
                   _as_int32(seq_partial_indptr), _as_int32(seq_partial_ids), _as_int32(shared))


def _concat_ranges(starts: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """The ranges [starts[n], starts[n] + indptr[n+1] - indptr[n]) one after another."""
    return np.repeat(starts - indptr[:-1], np.diff(indptr)) + np.arange(indptr[-1])


def _prune_to_fit(nodes: list[tuple[int, int, int, int]], max_partials: int | None,
                  max_node_blocks: int | None) -> list[tuple[int, int, int, int]]:
    """Drops leaf nodes of the node tree, the one that saves fewest KV reads first, until the
    plan's partials and node blocks fit. Still exact: a dropped node's blocks become the head of
    its rows' private tails (seq_num_shared_blocks falls back to the parent's depth), and only a
    leaf can go, so every row keeps a shared prefix covered by nodes. nodes: in DFS order."""
    def over(partials, blocks):
        return ((max_partials is not None and partials > max_partials)
                or (max_node_blocks is not None and blocks > max_node_blocks))
    partials = sum(e - b for _, _, b, e in nodes)
    blocks = sum(hi - lo for lo, hi, _, _ in nodes)
    if not over(partials, blocks):
        return nodes
    parent, children, stack = [-1] * len(nodes), [0] * len(nodes), []
    for k, (_, _, b, e) in enumerate(nodes):          # a node's parent encloses its rows
        while stack and not (nodes[stack[-1]][2] <= b and e <= nodes[stack[-1]][3]):
            stack.pop()
        if stack:
            parent[k] = stack[-1]
            children[stack[-1]] += 1
        stack.append(k)

    def saving(k):                                    # KV blocks read once instead of per row
        lo, hi, b, e = nodes[k]
        return ((e - b - 1) * (hi - lo), k)
    leaves = [saving(k) for k in range(len(nodes)) if children[k] == 0]
    heapq.heapify(leaves)
    dropped = set()
    while over(partials, blocks):
        _, k = heapq.heappop(leaves)
        lo, hi, b, e = nodes[k]
        dropped.add(k)
        partials -= e - b
        blocks -= hi - lo
        if parent[k] >= 0:
            children[parent[k]] -= 1
            if children[parent[k]] == 0:
                heapq.heappush(leaves, saving(parent[k]))
    return [n for k, n in enumerate(nodes) if k not in dropped]
