"""Rows of several query tokens (speculative decoding's verify rows) as one decode row per token.

A row of seq_len L whose last q tokens are queries is causal within them: its j-th query token
(0-based) sees the first L - q + 1 + j tokens. Each such token becomes a *query row* of its own,
holding the row's block table and that length. The plan then sees the q query rows of a request
as sharers of its full chunks (read once for all of its query tokens), while each query row walks
the partial tail block on its own, masked by its own length. Query rows come in token order, so
query row i is query token i of the batch: the kernel's query and output need no gather.
"""
from __future__ import annotations

import numpy as np


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
