"""The family test models (models.py) are fit for token-identity checks: stock vLLM serves each
one exactly as HF transformers' eager attention computes it (so vLLM honours its windows, sinks
and soft-caps), and each family's attention feature decides greedy tokens: perturbed (a smaller
window, zeroed sinks, a looser soft-cap, head size 128's scale on a 96 head) the tokens change."""
from functools import lru_cache

import pytest

from families.models import FAMILIES, hf_greedy, load_hf, token_prompts, vllm_job
from vllm_runs import assert_not_custom, run_llm

LENGTHS = (200, 150, 110)        # every prompt longer than every window (16-48)
MAX_TOKENS = 24


@lru_cache(maxsize=None)
def hf_tokens(name: str, perturb: str | None, prompt: tuple[int, ...], max_tokens: int):
    return hf_greedy(load_hf(name, perturb), list(prompt), max_tokens)


@pytest.mark.vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_stock_vllm_serves_family_as_hf_computes_it(name, tmp_path):
    prompts = token_prompts(1, LENGTHS)
    window = FAMILIES[name]["window"]
    assert window is None or min(LENGTHS) > 2 * window
    out = run_llm(vllm_job(name, [{"prompts": prompts, "sampling": dict(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)}]), tmp_path)
    assert_not_custom(out["log"])
    for prompt, (completion,) in zip(prompts, out["groups"][0]):
        tokens = completion["token_ids"]
        assert len(set(tokens)) >= MAX_TOKENS // 2, f"greedy output collapsed: {tokens}"
        assert tokens == hf_tokens(name, None, tuple(prompt), MAX_TOKENS), \
            "stock vLLM and HF eager attention disagree"


PERTURBATIONS = [(name, p) for name, spec in FAMILIES.items() for p in spec["perturb"]]


@pytest.mark.parametrize("name,perturb", PERTURBATIONS)
def test_perturbed_attention_feature_changes_greedy_tokens(name, perturb):
    for prompt in token_prompts(2, (150,)):
        base = hf_tokens(name, None, tuple(prompt), 16)
        assert len(set(base)) >= 8, f"greedy output collapsed: {base}"
        assert hf_tokens(name, perturb, tuple(prompt), 16) != base, \
            f"{name}: tokens do not depend on {perturb}"


WINDOW_PERTURBATIONS = [(n, p) for n, p in PERTURBATIONS if p == "window"]


@pytest.mark.parametrize("name,perturb", WINDOW_PERTURBATIONS)
def test_window_perturbation_is_inert_inside_the_window(name, perturb):
    """Control: while every key is inside both windows, changing the window changes nothing (the
    difference above is the window's, not a side effect of the override)."""
    window = FAMILIES[name]["perturb"][perturb]["config"]["sliding_window"]
    (prompt,) = token_prompts(3, (window // 2,))
    assert hf_tokens(name, perturb, tuple(prompt), window // 2) == \
        hf_tokens(name, None, tuple(prompt), window // 2)
