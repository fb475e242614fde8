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
import os
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
    bt = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
    sl = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens, np.int64)
    num_seqs = int(sl.shape[0])
    full = sl // block_size                           # only full blocks may be shared
    if not first_blocks_shared(bt, full, min_sharers):
        return empty_plan(num_seqs)                   # without the sort below (one per column)
    width = int(full.max())
    # Blocks past a row's full prefix get an id of their own (negative, one per row) so they
    # never match another row's block in the same column. Block ids are int32, as the kernel's.
    cols = np.where(np.arange(width)[None, :] < full[:, None], bt[:, :width].astype(np.int32),
                    -1 - np.arange(num_seqs, dtype=np.int32)[:, None])
    order = lexicographic_order(cols)                 # sharers become neighbours
    srt = cols[order]
    # lcp[k] = common full-block prefix of sorted rows k and k+1.
    neq = srt[1:] != srt[:-1]
    lcp = np.where(neq.any(axis=1), neq.argmax(axis=1), width).astype(np.int64)
    return _plan_from_lcp(order, srt, lcp, num_seqs, min_sharers, max_partials, max_node_blocks)


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


class PlanCache:
    """Rebuilds the plan only when the sharing structure can have changed (the paper's lazy
    context copy): the block ids of every row's full blocks and the number of full blocks. While
    rows only grow inside their private tail blocks the plan is reused as is.
    CHUNKATTN_PLAN_CACHE=0 rebuilds every step (for `bench ablation`).

    The CPU op checks the plan's indices on every call; a device op checks only shapes (reading
    a device plan would sync every layer), so for a device the host plan is checked here, every
    step, before it is copied (ops.check_plan: the CPU op's checks and messages). On CUDA a new
    plan goes to persistent device buffers through pinned staging (plan_staging.py): no sync."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 check_on_host: bool | None = None, capacity=None):
        """capacity: a plan_capacity.PlanCapacity for CUDA graphs: every plan is pruned to fit
        it and padded to it, in one device buffer that never moves (None: exact plans)."""
        self.enabled = os.environ.get("CHUNKATTN_PLAN_CACHE", "1") != "0"
        self.block_size = block_size
        self.device = torch.device(device)
        self.check_on_host = self.device.type != "cpu" if check_on_host is None else check_on_host
        self.capacity = capacity
        self._key: tuple[np.ndarray, ...] | None = None
        self._host_plan: TppPlan | None = None
        self._plan: TppPlan | None = None
        self._staging = None
        if self.device.type == "cuda" or capacity is not None:
            from .plan_staging import PlanStaging      # (it imports this module)
            self._staging = (PlanStaging(self.device) if capacity is None
                             else PlanStaging(self.device, capacity=capacity.num_ints))
        self.num_builds = 0
        self.num_reuses = 0
        self.shared_kv_tokens = 0     # of the current plan

    def get(self, block_table, seq_lens, num_blocks: int | None = None) -> TppPlan:
        """block_table, seq_lens: host arrays/tensors of the decode rows (see build_plan);
        num_blocks: of the KV cache, for the host check (None: unknown)."""
        bt = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
        sl = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
        full = sl // self.block_size
        if first_blocks_shared(bt, full):
            width = int(full.max())
            key = (full, np.where(np.arange(width)[None, :] < full[:, None], bt[:, :width], -1))
        else:                     # nothing shared: the empty plan, of as many rows
            key = (np.asarray(full.shape),)
        if (self.enabled and self._key is not None and self._plan is not None
                and len(self._key) == len(key)
                and all(np.array_equal(a, b) for a, b in zip(self._key, key))):
            self.num_reuses += 1
            self._check(bt, sl, num_blocks)   # the private tails have new blocks
            return self._plan
        cap = self.capacity
        plan = build_plan(bt, sl, self.block_size) if cap is None else build_plan(
            bt, sl, self.block_size, max_partials=cap.num_partials,
            max_node_blocks=cap.num_node_blocks)
        self.shared_kv_tokens = plan.shared_kv_tokens(self.block_size)   # host-side, once
        self._host_plan = plan
        self._check(bt, sl, num_blocks)
        if cap is not None:
            from .plan_capacity import pad_plan            # (it imports this module)
            plan = pad_plan(plan, cap)
        self._plan = plan.to(self.device) if self._staging is None else self._staging.upload(plan)
        self._key = key
        self.num_builds += 1
        return self._plan

    def _check(self, bt: np.ndarray, sl: np.ndarray, num_blocks: int | None) -> None:
        if self.check_on_host:
            from .ops.native import check_plan        # (ops imports this module)
            check_plan(self._host_plan, bt, sl, self.block_size, num_blocks)
