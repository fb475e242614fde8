"""build_plan: a decode batch's TppPlan from its block table (tpp_plan.py draws the layout).

Rows are sorted lexicographically by their full blocks, so sharers are neighbours; the longest
common prefix of neighbours gives the shared nodes (a compressed trie from the LCP array).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from .tpp_plan import TppPlan, _as_int32, empty_plan


def first_blocks_shared(block_table: np.ndarray, full: np.ndarray, min_sharers: int = 2) -> bool:
    """Whether min_sharers rows hold the same first full block (`full`: each row's full blocks):
    a plan has a node only then. O(num_seqs log num_seqs), against the plan's sort of every
    block of every row."""
    num_seqs = full.shape[0]
    if num_seqs < min_sharers or not num_seqs or int(full.max()) == 0:
        return False
    first = first_full_blocks(block_table, full)
    first.sort()
    k = min_sharers - 1
    return k < 1 or bool((first[k:] == first[:-k]).any())


def first_full_blocks(block_table: np.ndarray, full: np.ndarray) -> np.ndarray:
    """[num_seqs] int64: each row's first block where it has a full one, else an id of the
    row's own (negative, one per row), so rows without a full block match nothing."""
    own = -1 - np.arange(full.shape[0])
    if not block_table.shape[1]:
        return own
    return np.where(full > 0, block_table[:, 0].astype(np.int64), own)


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
                 capacity.py); the tree's deepest nodes are left private until it fits.
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
                   _as_int32(seq_partial_indptr), _as_int32(seq_partial_ids), _as_int32(shared),
                   _as_int32(lo))


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
