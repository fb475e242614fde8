"""Rows of several query tokens (speculative decoding's verify rows) as one decode row per token.

A row of seq_len L whose last q tokens are queries is causal within them: its j-th query token
(0-based) sees the first L - q + 1 + j tokens. Each such token becomes a *query row* of its own,
holding the row's block table and that length. Query rows come in token order, so query row i is
query token i of the batch: the kernel's query and output need no gather.

The plan of the query rows comes from the plan of the request rows (query_row_plan): the request
rows are planned on their first query token's full blocks, the blocks every one of its query
tokens sees whole, so that plan does not depend on how many draft tokens a row verifies and the
plan cache keeps it while the drafts come and go. Each node's sharers become their requests'
query rows, and a request's full blocks past its shared prefix become a node of its own query
rows: every full block is read once for all query tokens that see it. Each query row walks the
blocks after those on its own, masked by its own length.
"""
from __future__ import annotations

import numpy as np

from .build import _concat_ranges
from .tpp_plan import TppPlan, _as_int32


def query_rows(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray,
                                                                            np.ndarray]:
    """query_start_loc: [num_rows + 1] int, row r's query tokens are [qsl[r], qsl[r + 1]);
    seq_lens: [num_rows] int, row r's tokens of KV, its query tokens included.
    Returns (row_of_token, token_seq_lens): [num_tokens] int64 each, the row each query token
    belongs to and the tokens of KV it attends to (its own included)."""
    starts = np.asarray(query_start_loc, np.int64)
    query_lens = np.diff(starts)
    row_of_token = np.repeat(np.arange(query_lens.shape[0]), query_lens)
    position_in_row = np.arange(starts[-1] - starts[0]) - (starts[row_of_token] - starts[0])
    lens = np.asarray(seq_lens, np.int64)
    token_seq_lens = lens[row_of_token] - query_lens[row_of_token] + 1 + position_in_row
    return row_of_token, token_seq_lens


def first_query_lens(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """[num_rows] int64: the tokens of KV each row's first query token attends to (0 for a row
    without query tokens: graph padding). The request rows' plan is built on these."""
    query_lens = np.diff(np.asarray(query_start_loc, np.int64))
    return np.where(query_lens > 0, np.asarray(seq_lens, np.int64) - query_lens + 1, 0)


def query_row_plan(plan: TppPlan, block_table: np.ndarray, first_full: np.ndarray,
                   query_start_loc: np.ndarray) -> TppPlan:
    """The plan of the query rows (query_rows' order) from `plan`, the host plan of the request
    rows built on first_full ([num_rows] full blocks of each row's first query token,
    first_query_lens // block_size); block_table: [num_rows, width] the request rows' blocks."""
    starts = np.asarray(query_start_loc, np.int64)
    query_lens = np.diff(starts)
    first_token = starts[:-1] - starts[0]
    num_tokens = int(query_lens.sum())
    node_block_indptr = plan.node_block_indptr.numpy().astype(np.int64)
    node_seq_indptr = plan.node_seq_indptr.numpy().astype(np.int64)
    sharer = plan.node_seq_ids.numpy().astype(np.int64)
    shared = plan.seq_num_shared_blocks.numpy().astype(np.int64)
    # Each sharer's partial becomes one per query token of its row.
    per_sharer = query_lens[sharer]
    sharer_end = np.cumsum(per_sharer)
    tokens_of_sharers = _concat_ranges(first_token[sharer],
                                       np.concatenate([[0], sharer_end]))
    node_token_indptr = np.concatenate([[0], sharer_end])[node_seq_indptr]
    # A row of >= 2 query tokens: its full blocks past the shared prefix, a node of its tokens.
    own = np.flatnonzero((query_lens >= 2) & (first_full > shared))
    own_first = shared[own]
    own_blocks_end = np.cumsum(first_full[own] - own_first)
    own_tokens_end = np.cumsum(query_lens[own])
    width = block_table.shape[1]
    own_block_ids = block_table.ravel()[_concat_ranges(
        own * width + own_first, np.concatenate([[0], own_blocks_end]))]
    own_tokens = _concat_ranges(first_token[own], np.concatenate([[0], own_tokens_end]))
    node_seq_ids = np.concatenate([tokens_of_sharers, own_tokens])
    row_shared = shared.copy()
    row_shared[own] = first_full[own]
    # A token's partials in node order (the request plan's nodes, then its row's own).
    seq_partial_ids = np.argsort(node_seq_ids, kind="stable")
    seq_partial_indptr = np.concatenate([[0], np.cumsum(np.bincount(node_seq_ids,
                                                                    minlength=num_tokens))])
    return TppPlan(
        num_tokens, plan.num_nodes + len(own), len(node_seq_ids),
        _as_int32(np.concatenate([node_block_indptr, node_block_indptr[-1] + own_blocks_end])),
        _as_int32(np.concatenate([plan.node_block_ids.numpy(), own_block_ids])),
        _as_int32(np.concatenate([node_token_indptr, node_token_indptr[-1] + own_tokens_end])),
        _as_int32(node_seq_ids), _as_int32(seq_partial_indptr), _as_int32(seq_partial_ids),
        _as_int32(np.repeat(row_shared, query_lens)),
        _as_int32(np.concatenate([plan.node_first_block.numpy(), own_first])))
