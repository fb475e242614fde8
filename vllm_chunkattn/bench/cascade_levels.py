"""A decode batch's sharing tree as the levels of FlashInfer's MultiLevelCascadeAttentionWrapper.
Also a pure-torch emulation of what such a cascade computes, so the conversion can be checked
without a GPU.

A cascade of L levels runs one batch-prefill launch per level. At each level the query rows are
split into contiguous groups, and each group attends, without a mask, to the pages that the
level gives it: qo_indptr [groups + 1] over rows, kv_indptr [groups + 1] over pages,
kv_indices, and last_page_len [groups]. The per-level (out, lse) results are then merged by
online softmax. The levels come from our TppPlan, the tree that build_plan finds in the block
table:
  level k < L - 1: the k-th shared node of each row's path (root first). The group is the node's
                   sharers, the pages are the node's blocks, and every page is full;
  level L - 1:     each row alone, with its private tail (the columns after seq_num_shared_blocks,
                   the last page partial).
L = 1 + the deepest path. What the levels cannot say directly:
  * levels are positional. A row with fewer shared nodes than the deepest row still needs a
    group at every level. It gets an empty group there (0 pages, last_page_len 0, so kv_len 0).
    This is exact only when the kernel writes out = 0 and lse = -inf for kv_len = 0. FlashInfer's
    FA3 path does that (hopper/epilogue.cuh, "write 0 to output and -inf to LSE"), and every
    point is checked against the reference before it is timed anyway;
  * groups are contiguous runs of rows, so the rows must be in DFS order of the tree. We sort them
    lexicographically by their path of node ids (build_plan numbers its nodes in DFS order, parents
    first), and row_order gives that permutation;
  * only whole pages are shared. A partial block stays in the private level, as in our plan;
  * every level costs a launch over all rows plus a merge pass, even a level that only some rows
    use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.reference import empty_state, finish_state, merge_states, paged_kv, partial_attention
from ..plan import TppPlan


@dataclass
class CascadeLevels:
    row_order: np.ndarray             # the batch's rows in cascade order (every group contiguous)
    qo_indptr: list[np.ndarray]       # per level, [num_groups + 1], over rows in row_order
    kv_indptr: list[np.ndarray]       # per level, [num_groups + 1], over kv_indices
    kv_indices: list[np.ndarray]      # per level, physical block ids
    last_page_len: list[np.ndarray]   # per level, [num_groups]; 0 for an empty group
    num_empty_groups: int             # filler groups of rows with fewer shared nodes

    @property
    def num_levels(self) -> int:
        return len(self.qo_indptr)

    def is_identity_order(self) -> bool:
        return bool((self.row_order == np.arange(self.row_order.size)).all())

    def tensors(self, device) -> tuple[list[torch.Tensor], ...]:
        """The four per-level lists as int32 tensors on device, in the order plan() takes them."""
        def t(arrays):
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)
                    for a in arrays]
        return t(self.qo_indptr), t(self.kv_indptr), t(self.kv_indices), t(self.last_page_len)


def row_paths(plan: TppPlan) -> list[list[int]]:
    """Per row, the ids of the shared nodes it reads. Sorted ascending, this is root first: the
    nodes are numbered in DFS order, parents before children."""
    node_of_partial = np.repeat(np.arange(plan.num_nodes),
                                np.diff(plan.node_seq_indptr.cpu().numpy()))
    sp = plan.seq_partial_indptr.cpu().numpy()
    ids = plan.seq_partial_ids.cpu().numpy()
    return [sorted(int(node_of_partial[p]) for p in ids[sp[r]:sp[r + 1]])
            for r in range(plan.num_seqs)]


def cascade_levels(plan: TppPlan, block_table, seq_lens, block_size: int) -> CascadeLevels:
    table = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
    lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
    nb = plan.node_block_indptr.cpu().numpy()
    node_blocks = plan.node_block_ids.cpu().numpy()
    shared_cols = plan.seq_num_shared_blocks.cpu().numpy()
    paths = row_paths(plan)
    for r, path in enumerate(paths):      # the path must be exactly the row's shared columns
        blocks = [b for n in path for b in node_blocks[nb[n]:nb[n + 1]]]
        if blocks != table[r, :shared_cols[r]].tolist():
            raise ValueError(f"row {r}: its plan nodes {path} are not its first "
                             f"{shared_cols[r]} blocks")
    order = np.array(sorted(range(len(paths)), key=lambda r: paths[r]), dtype=np.int64)
    num_levels = 1 + max((len(p) for p in paths), default=0)
    qo, kv, idx, last = [], [], [], []
    empty = 0
    for level in range(num_levels - 1):
        qo_l, kv_l, idx_l, last_l = [0], [0], [], []
        prev = None
        for pos, r in enumerate(order):
            node = paths[r][level] if level < len(paths[r]) else None
            if node is not None and node == prev:
                qo_l[-1] = pos + 1            # the row joins the open group of its node
                continue
            if node is None:
                empty += 1
                last_l.append(0)
            else:
                idx_l.extend(node_blocks[nb[node]:nb[node + 1]].tolist())
                last_l.append(block_size)
            qo_l.append(pos + 1)
            kv_l.append(len(idx_l))
            prev = node
        _append_level(qo, kv, idx, last, qo_l, kv_l, idx_l, last_l)
    kv_l, idx_l, last_l = [0], [], []
    for r in order:                       # the private level: each row alone
        private = int(lens[r]) - int(shared_cols[r]) * block_size
        pages = -(-private // block_size)
        idx_l.extend(table[r, shared_cols[r]:shared_cols[r] + pages].tolist())
        kv_l.append(len(idx_l))
        last_l.append(private - (pages - 1) * block_size if pages else 0)
        if pages == 0:                    # the row's blocks are all shared (it ends on a block)
            empty += 1
    _append_level(qo, kv, idx, last, range(len(order) + 1), kv_l, idx_l, last_l)
    levels = CascadeLevels(order, qo, kv, idx, last, empty)
    check_contiguous(levels, paths)
    return levels


def _append_level(qo, kv, idx, last, qo_l, kv_l, idx_l, last_l) -> None:
    qo.append(np.array(qo_l, dtype=np.int64))
    kv.append(np.array(kv_l, dtype=np.int64))
    idx.append(np.array(idx_l, dtype=np.int64))
    last.append(np.array(last_l, dtype=np.int64))


def check_contiguous(levels: CascadeLevels, paths: list[list[int]]) -> None:
    """Every node's sharers form exactly one group at its level: no node split in two."""
    for level in range(levels.num_levels - 1):
        seen = set()
        qo = levels.qo_indptr[level]
        for g in range(len(qo) - 1):
            rows = levels.row_order[qo[g]:qo[g + 1]]
            nodes = {paths[r][level] if level < len(paths[r]) else None for r in rows}
            node = nodes.pop()
            if nodes or (node is not None and node in seen):
                raise ValueError(f"level {level}: group {g} is not one contiguous node")
            seen.add(node)


def emulate_cascade(levels: CascadeLevels, query, key_cache, value_cache, block_size: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a cascade computes from these levels, in fp32: each group's queries attend to its
    pages, and a row's states from all levels merge by online softmax. An empty group adds the
    empty state. Returns (out, lse natural log) in the batch's own row order."""
    num_rows, num_heads, head_size = query.shape
    dev = query.device
    states = [empty_state(num_heads, head_size, dev) for _ in range(num_rows)]
    for level in range(levels.num_levels):
        qo, kv = levels.qo_indptr[level], levels.kv_indptr[level]
        idx, last = levels.kv_indices[level], levels.last_page_len[level]
        for g in range(len(qo) - 1):
            pages = torch.from_numpy(idx[kv[g]:kv[g + 1]])
            if pages.numel() == 0:
                continue                      # kv_len 0: the empty state, nothing to merge
            kv_len = (pages.numel() - 1) * block_size + int(last[g])
            k, v = paged_kv(key_cache, value_cache, pages, kv_len)
            rows = levels.row_order[qo[g]:qo[g + 1]]
            o, m, l = partial_attention(query[torch.from_numpy(rows).to(dev)], k, v, scale)
            for j, r in enumerate(rows):
                states[r] = merge_states(states[r], (o[j], m[j], l[j]))
    done = [finish_state(*s) for s in states]
    return torch.stack([o for o, _ in done]), torch.stack([lse for _, lse in done])
