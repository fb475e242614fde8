"""bench/token_identity.py: greedy token identity with logprob gaps, on hand-made completions."""
import math

import pytest

from vllm_chunkattn.bench.token_identity import compare


def test_identical_tokens_report_the_logprob_agreement_only():
    stock = [[5, 7, 9]]
    custom = [[5, 7, 9]]
    lp_s = [[{5: -0.10, 6: -2.0}, {7: -0.50, 1: -1.0}, {9: -0.20, 3: -3.0}]]
    lp_c = [[{5: -0.11, 6: -2.0}, {7: -0.47, 1: -1.1}, {9: -0.20, 3: -3.0}]]
    r = compare(stock, custom, lp_s, lp_c)
    assert r.mismatched == 0
    assert r.max_logprob_diff == pytest.approx(0.03)
    assert math.isnan(r.max_tie_gap)


def test_a_near_tie_divergence_has_a_small_gap_and_stops_the_agreement_there():
    # Position 1: stock prefers 7 over 8 by 0.02, CUSTOM 8 over 7 by 0.01; after that the
    # contexts differ, so position 2's logprobs (wildly apart) do not count.
    stock = [[5, 7, 1], [4, 4, 4]]
    custom = [[5, 8, 2], [4, 4, 4]]
    lp_s = [[{5: -0.1}, {7: -0.70, 8: -0.72}, {1: -0.1}], [{4: -0.3}] * 3]
    lp_c = [[{5: -0.1}, {8: -0.69, 7: -0.70}, {2: -9.0}], [{4: -0.25}] * 3]
    r = compare(stock, custom, lp_s, lp_c)
    assert r.mismatched == 1
    assert r.max_tie_gap == pytest.approx(0.02)
    assert r.max_logprob_diff == pytest.approx(0.05)          # request 2's 0.3 vs 0.25


def test_a_token_outside_the_other_top_k_is_an_infinite_gap():
    r = compare([[3]], [[4]], [[{3: -0.01, 9: -5.0}]], [[{4: -0.02, 3: -4.0}]])
    assert r.mismatched == 1 and r.max_tie_gap == math.inf


def test_unequal_requests_are_refused():
    with pytest.raises(ValueError):
        compare([[1]], [[1], [2]], [[{1: 0.0}]], [[{1: 0.0}], [{2: 0.0}]])
