"""PlanCache: a decode step's TppPlan, rebuilt only when the sharing structure can have changed
(the paper's lazy context copy), and sent to the kernel's device without a host sync."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import envs
from .build import SortedRows, _build, _host, first_blocks_shared, first_full_blocks
from .capacity import pad_plan
from .query_rows import first_query_lens, query_row_plan, query_rows
from .staging import PlanStaging
from .tpp_plan import TppPlan


@dataclass
class PlanKey:
    """What a plan was built from: the rows' full-block counts, and where something was shared
    their full blocks (plan.full_blocks: its padded rows, and which entries are blocks) and
    sharing depths (SortedRows.depths, before any pruning to a capacity)."""
    full: np.ndarray
    rows: np.ndarray | None = None        # None: nothing shared, the empty plan
    is_block: np.ndarray | None = None
    depths: np.ndarray | None = None
    first: np.ndarray | None = None       # empty plan: build.first_full_blocks of its rows

    @classmethod
    def of(cls, full: np.ndarray, rows: SortedRows | None,
           block_table: np.ndarray | None = None) -> "PlanKey":
        if rows is None:
            return cls(full, first=first_full_blocks(block_table, full))
        is_block = np.arange(rows.rows.shape[1])[None, :] < full[:, None]
        return cls(full, rows.rows, is_block, rows.depths())

    def holds(self, block_table: np.ndarray, full: np.ndarray) -> bool:
        """Whether build_plan gives these rows the plan built for the key's (up to the order of
        a node's rows). So it does for the same rows when every full block the key saw is still
        there, and a row's new full blocks come after one that is private already (depth < its
        old full count): its prefix differs from every other row's before them, so no new block
        can join a node. With nothing shared: the empty plan while no first block is shared,
        whatever the blocks."""
        if full.shape != self.full.shape:
            return False
        if self.rows is None:      # the same first blocks as when none was shared: still none
            return (np.array_equal(self.first, first_full_blocks(block_table, full))
                    or not first_blocks_shared(block_table, full))
        grown = full != self.full
        if (full < self.full).any() or (self.depths[grown] >= self.full[grown]).any():
            return False
        width = self.rows.shape[1]
        return (block_table.shape[1] >= width and np.array_equal(
            np.where(self.is_block, block_table[:, :width], self.rows), self.rows))


class PlanCache:
    """The plan of each decode step, reused while PlanKey.holds: rows that only grow (inside
    their private tail blocks, or by full blocks past a private one) keep it.
    CHUNKATTN_PLAN_CACHE=0 rebuilds every step (for `bench ablation`).

    The CPU op checks the plan's indices on every call; a device op checks only shapes (reading
    a device plan would sync every layer), so for a device the host plan is checked here, every
    step, before it is copied (ops.check_plan: the CPU op's checks and messages). On CUDA a new
    plan goes to persistent device buffers through pinned staging (staging.py): no sync."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 check_on_host: bool | None = None, capacity=None):
        """capacity: a capacity.PlanCapacity for CUDA graphs: every plan is pruned to fit
        it and padded to it, in one device buffer that never moves (None: exact plans)."""
        self.enabled = envs.PLAN_CACHE
        self.block_size = block_size
        self.device = torch.device(device)
        self.check_on_host = self.device.type != "cpu" if check_on_host is None else check_on_host
        self.capacity = capacity
        self._key: PlanKey | None = None
        self._host_plan: TppPlan | None = None
        self._plan: TppPlan | None = None
        self._staging = self._query_staging = None
        if self.device.type == "cuda" or capacity is not None:
            self._staging = (PlanStaging(self.device) if capacity is None
                             else PlanStaging(self.device, capacity=capacity.num_ints))
        self.num_builds = 0
        self.num_reuses = 0
        self.shared_kv_tokens = 0     # of the plan get returned last
        self._rows_shared_kv_tokens = 0

    def get(self, block_table, seq_lens, num_blocks: int | None = None,
            query_start_loc=None) -> TppPlan:
        """block_table, seq_lens: host arrays/tensors of the decode rows (see build_plan);
        num_blocks: of the KV cache, for the host check (None: unknown); query_start_loc:
        [num_rows + 1] where rows have several query tokens (verify rows): then the plan is that
        of the query rows (query_rows.py), from the rows' plan on their first query tokens,
        which stays while the number of draft tokens changes."""
        bt, sl = _host(block_table), _host(seq_lens)
        if query_start_loc is not None:
            return self._query_row_plan(bt, sl, _host(query_start_loc), num_blocks)
        host_plan = self._rows_plan(bt, sl.astype(np.int64) // self.block_size)
        if self._plan is None:
            cap = self.capacity
            self._plan = self._upload(self._staging,
                                      host_plan if cap is None else pad_plan(host_plan, cap))
        self.shared_kv_tokens = self._rows_shared_kv_tokens
        self._check(host_plan, bt, sl, num_blocks)   # (on reuse: the private tails have new blocks)
        return self._plan

    def _rows_plan(self, bt: np.ndarray, full: np.ndarray) -> TppPlan:
        """The host plan of these rows: the cached one while its key holds, else a new one
        (its device copy made when a step asks for it)."""
        if self.enabled and self._key is not None and self._key.holds(bt, full):
            self.num_reuses += 1
            return self._host_plan
        cap = self.capacity
        plan, rows = _build(bt, full) if cap is None else _build(
            bt, full, max_partials=cap.num_partials, max_node_blocks=cap.num_node_blocks)
        self._rows_shared_kv_tokens = plan.shared_kv_tokens(self.block_size)   # host-side, once
        self._host_plan, self._plan = plan, None
        self._key = PlanKey.of(full, rows, bt)
        self.num_builds += 1
        return plan

    def _query_row_plan(self, bt: np.ndarray, sl: np.ndarray, query_start_loc: np.ndarray,
                        num_blocks: int | None) -> TppPlan:
        if self.capacity is not None:
            raise ValueError("PlanCache: plans of fixed capacity are for one-token decode rows")
        full = first_query_lens(query_start_loc, sl) // self.block_size
        plan = query_row_plan(self._rows_plan(bt, full), bt, full, query_start_loc)
        self.shared_kv_tokens = plan.shared_kv_tokens(self.block_size)
        if self.check_on_host:
            row_of_token, token_lens = query_rows(query_start_loc, sl)
            self._check(plan, bt[row_of_token], token_lens, num_blocks)
        if self._staging is not None and self._query_staging is None:
            self._query_staging = PlanStaging(self.device)  # not the rows' plan's buffer
        return self._upload(self._query_staging, plan)

    def _upload(self, staging: PlanStaging | None, plan: TppPlan) -> TppPlan:
        return plan.to(self.device) if staging is None else staging.upload(plan)

    def _check(self, host_plan: TppPlan, bt: np.ndarray, sl: np.ndarray,
               num_blocks: int | None) -> None:
        if self.check_on_host:
            from ..ops.native import check_plan        # (loads the native library)
            check_plan(host_plan, bt, sl, self.block_size, num_blocks)
