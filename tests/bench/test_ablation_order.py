"""bench ablation's round order: ABBA, and with three or more variants every variant in every
position equally often."""
from collections import Counter

from vllm_chunkattn.bench.ablation import round_order


def test_two_variants_alternate_abba():
    assert [round_order(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"]] * 2


def test_every_variant_runs_in_every_position_equally_often():
    variants = ["stock", "custom", "custom@old"]
    rounds = [round_order(variants, r) for r in range(2 * len(variants))]
    assert all(sorted(o) == sorted(variants) for o in rounds)
    for position in range(len(variants)):
        assert Counter(o[position] for o in rounds) == Counter({v: 2 for v in variants})
    assert rounds[1] == rounds[0][::-1]                       # each pair still ABBA
