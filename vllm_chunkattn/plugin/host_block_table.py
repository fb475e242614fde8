"""Host copies of the block table rows a decode step plans from, found without a device sync.

vLLM 0.32 gives the builder host copies of the lengths (CommonAttentionMetadata.query_start_loc_cpu,
seq_lens_cpu_upper_bound) but the block table only on the device. FlashInfer, the in-tree backend
that plans on the host, needs only the lengths: it gathers page ids on the device
(_copy_page_indices_kernel). A TPP plan needs the ids themselves. Both model runners hold them on
the host before they reach the device:
  V1 (v1/worker/block_table.py): BlockTable.block_table is a CpuGpuBuffer whose pinned .cpu rows
     are copied to .gpu each step; cm.block_table_tensor is .gpu[:num_reqs_padded] (batch order).
  V2 (v1/worker/gpu/block_table.py): BlockTables stages each request's new ids to the device
     (append_block_ids) and gathers rows by request index there; a numpy mirror fed from
     append_block_ids, indexed by cm.req_idx, holds the same rows.
install() wraps those constructors (and append_block_ids) once per process, before any model
runner exists (plugin.register). host_block_table() then finds the host rows of
cm.block_table_tensor by its data pointer, or returns None where it cannot (kernel-block
splitting, context parallelism, another runner).
On CPU the table handed to the builder lives on the host too: the builder plans from the runner's
host rows there as well, and with CHUNKATTN_CHECK_HOST_ROWS=1 compares them with that table every
step, raising on a difference (tests/serving/test_v2_model_runner.py runs V2 that way).
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

from . import logger

_V1: dict[int, weakref.ref] = {}                  # .gpu data_ptr -> BlockTable
_V2: dict[int, tuple[weakref.ref, int]] = {}      # input_block_tables[g] data_ptr -> (BlockTables, g)
_checked: set[str] = set()                        # runners whose host rows were checked (logged once)


def install() -> None:
    """Idempotent. A runner module that does not import (other platforms) is left alone."""
    try:
        from vllm.v1.worker.block_table import BlockTable
        _wrap(BlockTable, "__init__", _after_v1_init)
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu.block_table import BlockTables
        _wrap(BlockTables, "__init__", _after_v2_init)
        _wrap(BlockTables, "append_block_ids", _after_v2_append)
    except ImportError:
        pass


def host_block_table(cm, num_rows: int, block_size: int, check: bool = False
                     ) -> np.ndarray | None:
    """[num_rows, width] int32 host rows equal to cm.block_table_tensor[:num_rows] in every
    block a row's seq_len reaches (past it either may hold stale ids), or None. check: compare
    them with the CPU runner's table (CHUNKATTN_CHECK_HOST_ROWS, read once by the caller)."""
    found = _runner_host_rows(cm, num_rows)
    bt = cm.block_table_tensor
    if bt.device.type != "cpu":
        return None if found is None else found[1]
    table = bt[:num_rows].numpy()                  # CPU runner: the "device" table is the host's
    if found is None:
        return table
    if check:
        live = -(-cm.seq_lens[:num_rows].numpy() // block_size)
        _check(found, table, np.arange(table.shape[1])[None, :] < live[:, None])
    return found[1]


def host_seq_lens(cm, num_rows: int, upper_bound_exact: bool, check: bool = False):
    """The rows' seq_lens on the host, or None. The runners' seq_lens_cpu_upper_bound is exact
    without speculative decoding (FlashInfer relies on the same). check: as host_block_table."""
    bound = cm.seq_lens_cpu_upper_bound if upper_bound_exact else None
    if cm.seq_lens.device.type != "cpu":
        return bound
    if bound is not None and check:
        truth = cm.seq_lens[:num_rows].numpy()
        _check(("seq_lens_cpu_upper_bound", bound[:num_rows].numpy()), truth,
               np.ones(truth.shape, bool))
    return cm.seq_lens


def _runner_host_rows(cm, num_rows: int) -> tuple[str, np.ndarray] | None:
    """(source, rows) from the runner's host copy of cm.block_table_tensor, or None."""
    bt = cm.block_table_tensor
    ptr = bt.data_ptr()
    v1 = _V1.get(ptr)
    if v1 is not None and (table := v1()) is not None:
        buf = table.block_table
        if buf.gpu.data_ptr() == ptr and buf.cpu.shape[1] == bt.shape[1]:
            return "V1 block table", buf.np[:num_rows]
    v2 = _V2.get(ptr)
    if v2 is not None and (tables := v2[0]()) is not None and cm.req_idx is not None:
        host = tables._chunkattn_host[v2[1]]
        if host.shape[1] == bt.shape[1]:
            rows = host[np.asarray(cm.req_idx[:num_rows])]
            # A FULL-graph step pads the batch past its requests (req_idx holds the real ones
            # only); the device gather zeroes the padding rows, whose seq_lens are 0.
            pad = num_rows - rows.shape[0]
            return "V2 block table", np.pad(rows, ((0, pad), (0, 0))) if pad > 0 else rows
    return None


def _check(found: tuple[str, np.ndarray], truth: np.ndarray, used: np.ndarray) -> None:
    """found = (source, host copy); truth: what the CPU runner hands the builder; used: the
    entries that must agree."""
    source, rows = found
    differ = (rows != truth) & used
    if differ.any():
        bad = np.flatnonzero(differ.reshape(len(truth), -1).any(axis=1))
        raise RuntimeError(f"vllm-chunkattn: host copy ({source}) differs from the runner's "
                           f"tensor at rows {bad[:8].tolist()}: {rows[bad[0]].tolist()} vs "
                           f"{truth[bad[0]].tolist()}")
    if source not in _checked:
        _checked.add(source)
        logger.info("vllm-chunkattn: host copy (%s) checked against the runner's tensor, every "
                    "step", source)


def _wrap(cls, name: str, after) -> None:
    original = getattr(cls, name)
    if getattr(original, "_chunkattn_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        after(self, *args, **kwargs)
        return result
    wrapper._chunkattn_wrapped = True
    setattr(cls, name, wrapper)


def _after_v1_init(table, *args, **kwargs) -> None:
    _V1[table.block_table.gpu.data_ptr()] = weakref.ref(table)


def _after_v2_init(tables, *args, **kwargs) -> None:
    tables._chunkattn_host = [np.zeros(tuple(t.gpu.shape), np.int32) for t in tables.block_tables]
    for g, t in enumerate(tables.input_block_tables):
        _V2[t.data_ptr()] = (weakref.ref(tables), g)


def _after_v2_append(tables, req_index: int, new_block_ids, overwrite: bool) -> None:
    # append_block_ids has advanced num_blocks to the row's new end: the ids end there.
    for g, ids in enumerate(new_block_ids):
        end = int(tables.num_blocks.np[g, req_index])
        row = tables._chunkattn_host[g][req_index]
        row[end - len(ids):end] = 0 if tables.redirect_writes_to_null_block else ids
