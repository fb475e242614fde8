"""The readable spec of TPP decode, and the naive oracle it is checked against.

Softmax states are (o, m, l) in fp32: o = sum_t exp(s_t - m) v_t (unnormalised), m = max_t s_t,
l = sum_t exp(s_t - m). lse = m + ln(l) is always the natural log. An empty state has m = -inf,
l = 0, o = 0; merging two empty states must stay empty, never NaN.

A layer's attention variant (csrc/tpp_schema.h): a score is s = scale * q.k, soft-capped to
soft_cap * tanh(s / soft_cap) when soft_cap > 0; with sliding_window > 0 a row of seq_len L sees
keys [L - sliding_window, L) only; a sink is one more logit per head in the denominator, merged
into the row's final state as a token with no value. An fp8 cache (float8_e4m3fn / float8_e5m2)
holds K / k_scale and V / v_scale: K and V are its values times the layer's scales.
"""
from __future__ import annotations

import torch

from ..kv_layout import logical_cache
from ..plan.tpp_plan import TppPlan


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor,
             num_tokens: int, k_scale: float = 1.0, v_scale: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather [num_tokens, num_kv_heads, head_size] K and V from blocks, in token order; an fp8
    cache's values come back in fp32 times their scale.

    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_size], any strides.
    """
    ids = block_ids.long().to(key_cache.device)

    def gather(cache, cache_scale):
        if cache.dtype not in FP8_DTYPES:
            return cache[ids].flatten(0, 1)[:num_tokens]
        raw = cache.view(torch.uint8)[ids].flatten(0, 1)[:num_tokens]    # fp8 has no indexing
        return raw.view(cache.dtype).float() * cache_scale
    return gather(key_cache, k_scale), gather(value_cache, v_scale)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      soft_cap: float = 0.0, first_key: torch.Tensor | None = None):
    """Attention of many query rows against one KV run, as a softmax state.

    q: [num_rows, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].
    GQA: the q heads of one kv group are extra rows of the same matrix product.
    first_key: [num_rows] int, row r sees only keys >= first_key[r] of the run (a window's edge).
    Returns o [num_rows, num_heads, head_size], m and l [num_rows, num_heads], all fp32.
    """
    num_rows, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.float().view(num_rows, num_kv_heads, group, head_size).permute(1, 0, 2, 3)
    qg = qg.reshape(num_kv_heads, num_rows * group, head_size)
    s = torch.bmm(qg, k.float().permute(1, 2, 0)) * scale          # [Hkv, rows*g, T]
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    if first_key is not None:
        hidden = torch.arange(k.shape[0], device=s.device)[None, :] < first_key.to(s.device)[:, None]
        s = s.masked_fill(hidden.repeat_interleave(group, dim=0)[None], float("-inf"))
    m = s.amax(dim=-1)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # a row that sees no key: empty
    p = torch.exp(s - safe.unsqueeze(-1))
    o = torch.bmm(p, v.float().permute(1, 0, 2))                    # [Hkv, rows*g, D]
    l = p.sum(dim=-1)

    def rows_first(x):
        return x.view(num_kv_heads, num_rows, group, *x.shape[2:]).transpose(0, 1).reshape(
            num_rows, num_heads, *x.shape[2:])
    return rows_first(o), rows_first(m), rows_first(l)


def empty_state(num_heads: int, head_size: int, device) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(num_heads, head_size, device=device),
            torch.full((num_heads,), float("-inf"), device=device),
            torch.zeros(num_heads, device=device))


def merge_states(a, b):
    """Online-softmax merge of two (o, m, l) states; associative and commutative."""
    (oa, ma, la), (ob, mb, lb) = a, b
    m = torch.maximum(ma, mb)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # both empty: keep -inf, no NaN
    wa, wb = torch.exp(ma - safe), torch.exp(mb - safe)
    return oa * wa.unsqueeze(-1) + ob * wb.unsqueeze(-1), m, la * wa + lb * wb


def finish_state(o, m, l, sinks: torch.Tensor | None = None):
    """Normalise a state: returns (out, lse) with lse = m + ln(l) (natural log). sinks: one
    logit per head merged first, as a key whose value is zero."""
    if sinks is not None:
        o, m, l = merge_states((o, m, l), (torch.zeros_like(o), sinks.float(), torch.ones_like(l)))
    return o / l.clamp_min(1e-30).unsqueeze(-1), m + torch.log(l)


def window_start(seq_lens: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """[num_seqs]: each row's first visible key (0 without a window)."""
    if sliding_window <= 0:
        return torch.zeros_like(seq_lens)
    return (seq_lens - sliding_window).clamp_min(0)


def tpp_decode_reference(query, key_cache, value_cache, block_table, seq_lens, plan: TppPlan,
                         scale: float, out: torch.Tensor | None = None, return_lse: bool = False,
                         sliding_window: int = 0, soft_cap: float = 0.0,
                         sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0):
    """Two-phase partition decode, written for reading.

    query: [num_seqs, num_heads, head_size]; one new token per row
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], any strides (or
    kv_layout's 6-D views of CPU_ATTN's AMX layout)
    block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new token included)
    out: [num_seqs, num_heads, head_size], written in place if given. lse: [num_seqs, num_heads].
    sliding_window, soft_cap, sinks: the layer's attention variant; k_scale, v_scale: an fp8
    cache's scales (module docstring).
    """
    num_seqs, num_heads, head_size = query.shape
    lo = window_start(seq_lens.long().cpu(), sliding_window)         # each row's first key
    key_cache, value_cache = logical_cache(key_cache), logical_cache(value_cache)
    block_size = key_cache.shape[1]
    dev = query.device
    p_o = torch.zeros(plan.num_partials, num_heads, head_size, device=dev)
    p_m = torch.zeros(plan.num_partials, num_heads, device=dev)
    p_l = torch.zeros(plan.num_partials, num_heads, device=dev)
    nb, nbi = plan.node_block_indptr.tolist(), plan.node_block_ids
    ns, nsi = plan.node_seq_indptr.tolist(), plan.node_seq_ids.long().to(dev)
    node_first = plan.node_first_block.tolist()
    # Phase 1, chunk-first: each shared node's KV is read once for all its sharers' queries
    # (with a window, each sharer masks the node's keys before its window's edge).
    for n in range(plan.num_nodes):
        if ns[n] == ns[n + 1]:
            continue                  # an empty node: capacity padding (plan/capacity.py)
        blocks = nbi[nb[n]:nb[n + 1]]
        k, v = paged_kv(key_cache, value_cache, blocks, len(blocks) * block_size, k_scale, v_scale)
        rows = nsi[ns[n]:ns[n + 1]]
        edge = lo[rows.cpu()] - node_first[n] * block_size
        p_o[ns[n]:ns[n + 1]], p_m[ns[n]:ns[n + 1]], p_l[ns[n]:ns[n + 1]] = partial_attention(
            query[rows], k, v, scale, soft_cap, edge if sliding_window > 0 else None)
    # Phase 2, sequence-first: each row's private tail, merged with its partials.
    sp, spi = plan.seq_partial_indptr.tolist(), plan.seq_partial_ids.tolist()
    first_private = plan.seq_num_shared_blocks.tolist()
    lens = seq_lens.tolist()
    result = torch.empty(num_seqs, num_heads, head_size, device=dev)
    lse = torch.empty(num_seqs, num_heads, device=dev)
    for i in range(num_seqs):
        state = empty_state(num_heads, head_size, dev)
        for p in spi[sp[i]:sp[i + 1]]:
            state = merge_states(state, (p_o[p], p_m[p], p_l[p]))
        start = first_private[i]
        num_private = lens[i] - start * block_size
        if num_private > 0:
            nblk = -(-lens[i] // block_size)
            k, v = paged_kv(key_cache, value_cache, block_table[i, start:nblk], num_private,
                            k_scale, v_scale)
            edge = lo[i:i + 1] - start * block_size
            o, m, l = partial_attention(query[i:i + 1], k, v, scale, soft_cap,
                                        edge if sliding_window > 0 else None)
            state = merge_states(state, (o[0], m[0], l[0]))
        result[i], lse[i] = finish_state(*state, sinks)
    if out is not None:
        out.copy_(result.to(out.dtype))
    else:
        out = result.to(query.dtype)
    return (out, lse) if return_lse else out


def dense_decode_oracle(query, key_cache, value_cache, block_table, seq_lens, scale: float,
                        sliding_window: int = 0, soft_cap: float = 0.0,
                        sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0):
    """Per-sequence attention over the gathered context in fp64: knows nothing of plans.
    The variant as vLLM's CPU_ATTN test reference writes it: cap, window mask, then the sink as
    an extra logit column whose probability is dropped.

    Returns (out [num_seqs, num_heads, head_size] fp64, lse [num_seqs, num_heads] fp64).
    """
    num_seqs, num_heads, head_size = query.shape
    key_cache, value_cache = logical_cache(key_cache), logical_cache(value_cache)
    block_size = key_cache.shape[1]
    outs, lses = [], []
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_table[i, :-(-n // block_size)]
        k, v = paged_kv(key_cache, value_cache, blocks, n, k_scale, v_scale)
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)            # [n, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", query[i].double(), k) * scale
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        if sliding_window > 0:
            s[:, :max(0, n - sliding_window)] = float("-inf")
        if sinks is not None:
            s = torch.cat([sinks.double().to(s.device)[:, None], s], dim=1)
        lses.append(torch.logsumexp(s, dim=-1))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", p[:, 1:] if sinks is not None else p, v))
    return torch.stack(outs), torch.stack(lses)
