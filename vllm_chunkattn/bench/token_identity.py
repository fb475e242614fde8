"""Greedy token identity of two systems' completions, with logprob gaps (in bf16,
report the requests whose tokens differ and how close each divergence came to a tie).

Per request, both systems saw the same context up to the first position where their tokens
differ. Before it, the sampled token's logprob in each system gives their numeric agreement
(`max_logprob_diff`). At it, stock chose a and CUSTOM chose b: the tie gap is how much each
preferred its own token, stock lp(a) - lp(b) and CUSTOM lp(b) - lp(a); a divergence from
rounding is a near-tie (a gap near 0), a wrong kernel is not. b missing from stock's top-k (or a
from CUSTOM's) gives an infinite gap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

TOP_K = 5   # logprobs asked per position: the tie gap is known when the other token is in it


def position_logprobs(completion) -> list[dict[int, float]]:
    """Per position of a vLLM CompletionOutput generated with logprobs=k: {token id: logprob}
    of the top k and the sampled token."""
    return [{int(t): float(lp.logprob) for t, lp in pos.items()}
            for pos in (completion.logprobs or [])]


@dataclass
class TokenIdentity:
    mismatched: int           # requests whose token ids differ
    max_logprob_diff: float   # |lp_stock - lp_custom| of the sampled token, shared context only
    max_tie_gap: float        # over mismatched requests and both systems; nan when none differ


def compare(stock_tokens: list[list[int]], custom_tokens: list[list[int]],
            stock_logprobs: list[list[dict[int, float]]],
            custom_logprobs: list[list[dict[int, float]]]) -> TokenIdentity:
    if not (len(stock_tokens) == len(custom_tokens) == len(stock_logprobs)
            == len(custom_logprobs)):
        raise ValueError("both systems must answer the same requests, with logprobs")
    max_diff, gaps = 0.0, []
    for ts, tc, ls, lc in zip(stock_tokens, custom_tokens, stock_logprobs, custom_logprobs):
        k = next((i for i, (a, b) in enumerate(zip(ts, tc)) if a != b), None)
        if k is None and len(ts) != len(tc):
            k = min(len(ts), len(tc))            # one stopped early: diverged there
        shared = len(ts) if k is None else k
        for i in range(shared):
            max_diff = max(max_diff, abs(ls[i][ts[i]] - lc[i][tc[i]]))
        if k is None:
            continue
        if k < len(ts) and k < len(tc):
            a, b = ts[k], tc[k]
            gaps.append(max(ls[k][a] - ls[k].get(b, -math.inf), lc[k][b] - lc[k].get(a, -math.inf)))
        else:
            gaps.append(math.inf)
    return TokenIdentity(len(gaps), max_diff, max(gaps) if gaps else math.nan)
