"""The share arithmetic of a mixture (preprocess/mixing.py), as properties: each source's realised
amount is within one sequence of its target, whatever the measures, weights and epochs."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_sft_idx.errors import InfeasibleMixtureError, ShardError
from megatron_sft_idx.preprocess.mixing import (Caps, derived_seed, realise, remainder_count, source_caps,
                                                split_epochs)

measures = st.lists(st.integers(1, 5000), min_size=1, max_size=300).map(lambda v: np.asarray(v, dtype=np.float64))


@settings(max_examples=300, deadline=None)
@given(measures, st.floats(0, 7.5), st.integers(0, 2**32))
def test_realised_amount_is_within_one_sequence_of_the_target(m, epochs, seed):
    got = realise(m, epochs, seed)
    amount = got.whole * m.sum() + m[got.extra].sum()
    assert abs(amount - epochs * m.sum()) <= m.max() / 2 + 1e-6 * m.sum()
    assert got.extra.size < m.size and np.all(np.diff(got.extra) > 0)   # each remainder sequence once
    assert got.whole == math.floor(epochs + 1e-12) or (got.whole == math.floor(epochs) + 1 and got.extra.size == 0)
    again = realise(m, epochs, seed)
    assert again.whole == got.whole and np.array_equal(again.extra, got.extra)   # seeded: the same draw


@settings(max_examples=200, deadline=None)
@given(st.lists(measures, min_size=1, max_size=6), st.data())
def test_split_shares_are_the_weights_within_one_sequence_per_source(sources, data):
    weights = data.draw(st.lists(st.floats(0.01, 100), min_size=len(sources), max_size=len(sources)))
    amounts = np.array([m.sum() for m in sources])
    caps = source_caps([None] * len(sources), [None] * len(sources), [int(a) for a in amounts], repeats=False)
    e = split_epochs("trained_tokens", weights, [f"s{k}" for k in range(len(sources))], amounts, caps, None, "train")
    assert np.all(e <= 1 + 1e-9) and np.isclose(e.max(), 1.0)   # the largest mixture that repeats nothing
    realised = []
    for k, m in enumerate(sources):
        got = realise(m, float(e[k]), k)
        realised.append(got.whole * m.sum() + m[got.extra].sum())
    target = np.asarray(weights) / sum(weights) * (e * amounts).sum()
    for k, m in enumerate(sources):
        assert abs(realised[k] - target[k]) <= m.max() / 2 + 1e-6 * amounts.sum()


def test_a_total_sets_each_sources_epochs_and_a_cap_is_refused_saying_what_is_achievable():
    amounts = np.array([1000.0, 100.0])
    caps = [Caps(math.inf), Caps(2.0)]
    e = split_epochs("tokens", [1, 1], ["a", "b"], amounts, caps, 400.0, "train")
    assert e.tolist() == [0.2, 2.0]
    with pytest.raises(InfeasibleMixtureError) as err:
        split_epochs("tokens", [1, 1], ["a", "b"], amounts, caps, 401.0, "train", path="/m.json")
    msg = str(err.value)
    assert "'b' would need 2.005 epochs" in msg and "largest total the caps allow there is 400 tokens" in msg
    assert err.value.path == "/m.json" and err.value.field == "total"


def test_without_a_total_nothing_repeats_unless_max_epochs_says_so():
    amounts = np.array([1000.0, 100.0])
    caps = source_caps([None, 3], [None, None], [1000, 100], repeats=False)
    e = split_epochs("trained_tokens", [1, 1], ["a", "b"], amounts, caps, None, "train")
    assert e.tolist() == [0.3, 3.0]
    caps = source_caps([None, None], [None, 150], [1000, 100], repeats=False)   # max_tokens: 1.5 epochs
    assert split_epochs("trained_tokens", [1, 1], ["a", "b"], amounts, caps, None, "t").tolist() == [0.1, 1.0]


def test_epochs_unit_takes_the_weights_as_epochs_and_a_token_cap_bounds_them():
    amounts = np.array([10.0, 20.0])
    caps = source_caps([None, None], [None, 100], [50, 40], repeats=True)
    assert split_epochs("epochs", [2, 1.5], ["a", "b"], amounts, caps, None, "t").tolist() == [2.0, 1.5]
    with pytest.raises(InfeasibleMixtureError, match="'b' is asked for 3 epochs, but its max_tokens allows 2.5"):
        split_epochs("epochs", [2, 3], ["a", "b"], amounts, caps, None, "t")


def test_a_source_with_nothing_in_a_split_is_refused_naming_it():
    with pytest.raises(InfeasibleMixtureError, match="source 'b' has no sequence in split 'valid'"):
        split_epochs("sequences", [1, 1], ["a", "b"], np.array([5.0, 0.0]), [Caps(1), Caps(1)], None, "valid")


@given(st.lists(st.integers(1, 100), min_size=0, max_size=50), st.floats(0, 6000))
def test_remainder_count_is_the_closest_prefix(values, target):
    cum = np.concatenate([[0.0], np.cumsum(values)]) if values else np.zeros(1)
    j = remainder_count(cum, target)
    best = min(range(cum.size), key=lambda i: (abs(cum[i] - target), i))
    assert abs(cum[j] - target) == abs(cum[best] - target) and j <= best


def test_derived_seeds_depend_on_the_store_not_the_position():
    a, b = "0123456789abcdef" * 2, "fedcba9876543210" * 2
    assert derived_seed(1, a, 0) == derived_seed(1, a, 0) != derived_seed(1, b, 0)
    assert derived_seed(1, a, 0) != derived_seed(2, a, 0) != derived_seed(1, a, 1)
    assert derived_seed(-5, a) == derived_seed(-5, a)   # any seed the CLI takes


def test_realise_refuses_bad_epochs():
    with pytest.raises(ShardError, match="finite"):
        realise(np.ones(3), float("nan"), 0)
