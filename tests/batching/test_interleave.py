"""The interleaved order of a mixture's packs (batching/interleave.py): a permutation of the
packs whose windows of steps hold the target shares far better than the adapters' shuffle."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_sft_idx.batching.interleave import interleave
from megatron_sft_idx.batching.layout import base_permutation
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.mixreport import window_deviation


def mixed_packs(rng, packs=4000, sources=3):
    """Packs of mixed sources, each mostly one source (as global packing of skewed lengths makes)."""
    main = rng.integers(0, sources, packs)
    m = rng.integers(0, 200, (packs, sources))
    m[np.arange(packs), main] += rng.integers(500, 4000, packs)
    return m


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 6), st.integers(0, 2**31))
def test_every_epoch_is_a_permutation_and_a_function_of_its_arguments(packs, sources, seed):
    rng = np.random.default_rng(seed)
    m = rng.integers(0, 100, (packs, sources))
    t = rng.random(sources) + 0.01
    a = interleave(m, t, seed=seed, epoch=0)
    assert np.array_equal(np.sort(a), np.arange(packs))
    assert np.array_equal(a, interleave(m, t, seed=seed, epoch=0))


def test_windows_hold_the_shares_far_better_than_the_shuffle():
    rng = np.random.default_rng(3)
    m = mixed_packs(rng)
    target = m.sum(axis=0) / m.sum()
    gbs, k = 32, 4
    mine = np.concatenate([interleave(m, target, seed=1, epoch=e) for e in range(2)])
    shuffled = np.concatenate([base_permutation(len(m), 1, e) for e in range(2)])
    a = window_deviation(mine, m, target, k, gbs)
    b = window_deviation(shuffled, m, target, k, gbs)
    assert a["windows"] == b["windows"] == 2 * 4000 // gbs - k + 1
    assert a["max"] < b["max"] / 4 and a["mean"] < b["mean"] / 4, (a, b)
    assert interleave(m, target, seed=1, epoch=1).tolist() != mine[:4000].tolist()   # epochs differ


def test_a_skewed_target_is_kept_with_more_sources_than_candidates():
    rng = np.random.default_rng(5)
    m = mixed_packs(rng, packs=3000, sources=24)   # more sources than the queues weighed per position
    target = m.sum(axis=0) / m.sum()
    order = interleave(m, target, seed=0)
    assert np.array_equal(np.sort(order), np.arange(3000))
    a = window_deviation(order, m, target, 8, 32)
    b = window_deviation(base_permutation(3000, 0, 0), m, target, 8, 32)
    assert a["max"] < b["max"]


def test_bad_measures_are_refused():
    with pytest.raises(ShardError):
        interleave(np.ones((3, 2)), [0.5], seed=0)
    with pytest.raises(ShardError):
        interleave(-np.ones((3, 2)), [0.5, 0.5], seed=0)
    assert interleave(np.zeros((0, 2)), [0.5, 0.5], seed=0).size == 0
