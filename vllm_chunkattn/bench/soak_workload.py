"""The soak's requests: tree-shaped prompts, sampling, disconnects and bad input, with arrivals.

Prompts are token-id lists (the completions API takes them), so the tree's shape is exact:
a few system prompts (not block-aligned) × nested few-shot examples (a prompt holds the first k
shots of its system prompt's list) × a question. Every request says what a correct server does
with it: `complete` (greedy ones are later compared token by token with stock vLLM), `abort`
(the client disconnects mid-stream) or `4xx` (bad input that must be refused, not crash).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from .server_client import SERVED_NAME
# Share of each kind in the mix (the bad-input kinds split their share in turn).
MIX = {"greedy": 0.45, "greedy-stream": 0.15, "sampled-n": 0.12, "disconnect": 0.15,
       "overlong": 0.04, "bad-input": 0.09}
BAD_INPUTS = ("bad-json", "negative-max-tokens", "unknown-model", "empty-prompt")
FIRST_TOKEN = 3                 # the tiny model's 0..2 are pad / bos / eos


@dataclass
class SoakRequest:
    index: int
    kind: str
    arrival_s: float
    expect: str                             # "complete" | "abort" | "4xx"
    body: dict | None = None
    raw: bytes | None = None                # sent as is instead of `body` (malformed JSON)
    disconnect_after: int = 0               # stream chunks read before hanging up
    result: dict = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    @property
    def greedy(self) -> bool:
        return self.expect == "complete" and self.body.get("temperature") == 0


class PromptTree:
    """System prompts × nested few-shot examples × questions, as token ids."""

    def __init__(self, rng: random.Random, vocab_size: int, block_size: int,
                 num_systems: int = 4, shots: int = 4):
        self.rng, self.vocab_size = rng, vocab_size
        self.systems = [self.tokens(rng.choice((2, 3, 4, 6)) * block_size + rng.randrange(1, 20))
                        for _ in range(num_systems)]
        self.examples = [[self.tokens(rng.randrange(40, 90)) for _ in range(shots)]
                         for _ in self.systems]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_TOKEN, self.vocab_size) for _ in range(n)]

    def prompt(self) -> list[int]:
        s = self.rng.randrange(len(self.systems))
        k = self.rng.randrange(len(self.examples[s]) + 1)
        shots = [t for example in self.examples[s][:k] for t in example]
        return self.systems[s] + shots + self.tokens(self.rng.randrange(8, 80))


def make_requests(num_requests: int, rate: float, seed: int, vocab_size: int, block_size: int,
                  max_model_len: int, sampled: bool = True) -> list[SoakRequest]:
    """`num_requests` requests with Poisson arrivals at `rate` per second; sampled=False: no
    random-sampling requests (their share goes to greedy ones)."""
    rng = random.Random(seed)
    tree = PromptTree(rng, vocab_size, block_size)
    mix = MIX if sampled else {k: v for k, v in MIX.items() if k != "sampled-n"}
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=num_requests)
    t, bad, out = 0.0, 0, []
    for i, kind in enumerate(kinds):
        t += rng.expovariate(rate)
        base = {"model": SERVED_NAME, "prompt": tree.prompt(), "ignore_eos": True,
                "return_token_ids": True}
        if kind in ("greedy", "greedy-stream"):
            body = {**base, "max_tokens": rng.randrange(4, 48), "temperature": 0,
                    "stream": kind == "greedy-stream"}
            out.append(SoakRequest(i, kind, t, "complete", body))
        elif kind == "sampled-n":           # parallel sampling, no seed
            body = {**base, "max_tokens": rng.randrange(4, 32), "temperature": 1.0,
                    "n": rng.randrange(2, 5)}
            out.append(SoakRequest(i, kind, t, "complete", body))
        elif kind == "disconnect":
            body = {**base, "max_tokens": 200, "temperature": 0, "stream": True}
            out.append(SoakRequest(i, kind, t, "abort", body,
                                   disconnect_after=rng.randrange(0, 6)))
        elif kind == "overlong":
            body = {**base, "prompt": tree.tokens(max_model_len + rng.randrange(1, 200)),
                    "max_tokens": 8}
            out.append(SoakRequest(i, kind, t, "4xx", body))
        else:
            sub = BAD_INPUTS[bad % len(BAD_INPUTS)]
            bad += 1
            out.append(bad_request(i, sub, t, base))
    return out


def bad_request(index: int, kind: str, t: float, base: dict) -> SoakRequest:
    if kind == "bad-json":
        return SoakRequest(index, kind, t, "4xx",
                           raw=json.dumps({**base, "max_tokens": 8}).encode()[:-7])
    body = {"negative-max-tokens": {**base, "max_tokens": -5},
            "unknown-model": {**base, "model": "no-such-model", "max_tokens": 8},
            "empty-prompt": {**base, "prompt": "", "max_tokens": 8}}[kind]
    return SoakRequest(index, kind, t, "4xx", body)
