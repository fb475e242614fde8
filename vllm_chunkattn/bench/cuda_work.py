"""The CUDA TPP op's work decomposition as tests and launch probes see it: workspace rows for KV
splits, chunk CTAs that hold rows, and make_tpp_work's numbers by name (csrc/cuda/tpp_host.h)."""
from __future__ import annotations


def split_spare_slots(plan, num_seqs: int, chunk_splits: int, seq_splits: int) -> int:
    """Workspace rows beyond plan.num_partials that the CUDA op needs to run with these KV splits
    (csrc/cuda/tpp_host.h: S_c * P + num_seqs * (S_s - 1) rows in all)."""
    return (chunk_splits - 1) * plan.num_partials + num_seqs * (seq_splits - 1)


def chunk_ctas_with_rows(plan, chunk_seqs: int, chunk_head_tiles: int, num_kv_heads: int) -> int:
    """Chunk CTAs of one KV split that hold rows (the CUDA kernel's windows): node n's sharers
    sit at partial positions node_seq_indptr[n] .. [n+1], cut into windows aligned at multiples
    of chunk_seqs; the grid's other window slots exit at once."""
    ind = plan.node_seq_indptr.tolist()
    windows = sum(len({p // chunk_seqs for p in range(ind[n], ind[n + 1])})
                  for n in range(plan.num_nodes))
    return windows * chunk_head_tiles * num_kv_heads


TPP_WORK_FIELDS = ("chunk_heads", "chunk_head_tiles", "chunk_seqs", "num_windows", "seq_heads",
                   "seq_head_tiles", "chunk_splits", "seq_splits", "chunk_ctas", "device_splits")


def tpp_work(simt_ops, num_seqs: int, num_heads: int, num_kv_heads: int, block_size: int,
             num_nodes: int, num_partials: int, node_blocks: int, table_width: int, slots: int,
             resident_ctas: int, sliding_window: int = 0) -> dict:
    """The CUDA op's work decomposition (csrc/cuda/tpp_host.h, make_tpp_work) for these sizes,
    by name, from the SIMT emulation's library (torch.ops.chunkattn_simt: no GPU)."""
    return dict(zip(TPP_WORK_FIELDS, simt_ops.tpp_work(
        num_seqs, num_heads, num_kv_heads, block_size, num_nodes, num_partials, node_blocks,
        table_width, slots, resident_ctas, sliding_window)))
