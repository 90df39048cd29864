"""Balanced per-epoch orders: step membership is the adapters' shuffle, ranks are balanced, and the
layout is Megatron's sampler's. The multi-rank proof through the real sampler is
tests/compat/test_batching_torchrun.py."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_sft_idx.batching.balance import balanced_permutation, plan_order
from megatron_sft_idx.batching.cost import CostModel
from megatron_sft_idx.batching.layout import Topology, base_permutation, position_of, where
from megatron_sft_idx.batching.report import step_costs, straggler_report
from megatron_sft_idx.errors import ShardError

MODEL = CostModel(1.0, 0.0)


def long_tailed_costs(rng, n):
    """Pack costs as Σ L² of packs that hold one long sequence or many short ones (heavy tail)."""
    long = rng.random(n) < 0.3
    return np.where(long, rng.uniform(0.3, 1.0, n) ** 2 * 1e6, rng.uniform(0.02, 0.05, n) * 1e6)


def groups(n, epoch, topo, window):
    """Epoch-position ranges of the exchange groups (steps, with window 1) inside one epoch."""
    span = window * topo.global_batch_size
    g0, lo, out = epoch * n, 0, []
    while lo < n:
        hi = min(n, lo + span - (g0 + lo) % span)
        out.append((lo, hi))
        lo = hi
    return out


# ------------------------------------------------------------------ the shuffle and the layout


def test_base_permutation_is_the_bridge_adapters_samples_mapping():
    from megatron_sft_idx.training.bridge import build_samples_mapping

    n, seed = 97, 1234
    mapping = np.asarray(build_samples_mapping(n, 3 * n, seed))
    for e in range(3):
        np.testing.assert_array_equal(mapping[e * n:(e + 1) * n], base_permutation(n, seed, e))


def test_base_permutation_is_the_megatron_adapters_sample_index(tmp_path):
    mc_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from support.shardgen import random_packs, write_shard

    from megatron_sft_idx.training import megatron as M

    prefix = str(tmp_path / "s")
    write_shard(prefix, random_packs(np.random.default_rng(3), 60, pack_size=64))
    config = M.SFTIndexedDatasetConfig(random_seed=77, sequence_length=64, blend=([prefix], None), split="1,0,0")
    train = mc_builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [150, 0, 0], lambda: True, config).build()[0]
    expected = np.concatenate([base_permutation(60, 77, e) for e in range(3)])[:150]
    np.testing.assert_array_equal(np.asarray(train.sample_index), expected)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.integers(0, 10_000))
def test_where_and_position_of_are_inverse(dp, mbs, micro, g):
    topo = Topology(dp, mbs, dp * mbs * micro)
    step, m, r, j = where(g, topo)
    assert 0 <= m < micro and 0 <= r < dp and 0 <= j < mbs
    assert position_of(step, m, r, j, topo) == g


def test_where_is_megatrons_slicing_of_each_micro_batch_group():
    # groups of mbs * dp = 6 consecutive indices; rank r takes [r*mbs, (r+1)*mbs) of each
    topo = Topology(3, 2, 12)
    step, m, rank, slot = where(np.arange(24), topo)
    assert rank.tolist() == [0, 0, 1, 1, 2, 2] * 4
    assert m.tolist() == [0] * 6 + [1] * 6 + [0] * 6 + [1] * 6
    assert step.tolist() == [0] * 12 + [1] * 12 and slot.tolist() == [0, 1] * 12


@pytest.mark.parametrize("kwargs", [dict(data_parallel_size=0, micro_batch_size=1, global_batch_size=4),
                                    dict(data_parallel_size=2, micro_batch_size=2, global_batch_size=6),
                                    dict(data_parallel_size=2, micro_batch_size=True, global_batch_size=4)])
def test_topology_refuses_impossible_batches(kwargs):
    with pytest.raises(ShardError):
        Topology(**kwargs)


# ------------------------------------------------------------------ properties of the balanced order


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 260), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 3), st.sampled_from(["lpt", "kk"]), st.integers(0, 2**31 - 1))
def test_balanced_order_keeps_group_membership(n, dp, mbs, micro, epoch, window, algorithm, seed):
    topo = Topology(dp, mbs, dp * mbs * micro)
    costs = long_tailed_costs(np.random.default_rng(seed), n)
    base = base_permutation(n, seed, epoch)
    out = balanced_permutation(costs, topo, seed=seed, epoch=epoch, algorithm=algorithm, exchange_window=window)
    assert sorted(out.tolist()) == list(range(n))
    for lo, hi in groups(n, epoch, topo, window):
        assert sorted(out[lo:hi].tolist()) == sorted(base[lo:hi].tolist())
    again = balanced_permutation(costs, topo, seed=seed, epoch=epoch, algorithm=algorithm, exchange_window=window)
    np.testing.assert_array_equal(out, again)


def _optimum(costs, dp):
    """The least possible costliest rank for equal counts (brute force, tiny inputs)."""
    k = len(costs) // dp
    best = float("inf")
    items = list(range(len(costs)))

    def deal(rest, peak):
        nonlocal best
        if not rest:
            best = min(best, peak)
            return
        first = rest[0]
        for others in itertools.combinations(rest[1:], k - 1):
            group = (first, *others)
            left = [i for i in rest if i not in group]
            deal(left, max(peak, sum(costs[i] for i in group)))

    deal(items, 0.0)
    return best


@pytest.mark.parametrize("algorithm", ["lpt", "kk"])
@pytest.mark.parametrize("seed", range(8))
def test_each_step_is_within_a_few_percent_of_the_optimum(algorithm, seed):
    rng = np.random.default_rng(seed)
    dp, per_rank = 3, 3
    topo = Topology(dp, 1, dp * per_rank)
    costs = np.round(long_tailed_costs(rng, topo.global_batch_size * 4))
    out = balanced_permutation(costs, topo, seed=seed, epoch=0, algorithm=algorithm)
    per_step = step_costs(out, costs, topo)
    for s in range(4):
        opt = _optimum(costs[out[s * 9:(s + 1) * 9]], dp)
        assert per_step[s].max() <= 1.05 * opt


@pytest.mark.parametrize("algorithm", ["lpt", "kk"])
def test_hand_case_reaches_the_perfect_split(algorithm):
    costs = np.array([8, 7, 6, 5, 4, 3, 2, 1], dtype=float)
    topo = Topology(2, 1, 8)
    out = balanced_permutation(costs, topo, seed=0, epoch=0, algorithm=algorithm)
    assert step_costs(out, costs, topo).tolist() == [[18.0, 18.0]]


def test_inside_a_rank_the_costliest_micro_batch_and_pack_come_first():
    rng = np.random.default_rng(5)
    topo = Topology(2, 2, 16)  # 4 micro-batches of 2 packs per rank
    costs = rng.uniform(1, 100, 64)
    out = balanced_permutation(costs, topo, seed=1, epoch=0)
    step, m, rank, slot = where(np.arange(64), topo)
    for s in range(4):
        for r in range(2):
            mine = (step == s) & (rank == r)
            per_micro = [costs[out[mine & (m == k)]] for k in range(4)]
            sums = [c.sum() for c in per_micro]
            assert sums == sorted(sums, reverse=True)
            assert all(list(c) == sorted(c, reverse=True) for c in per_micro)


def test_balance_lowers_the_overhead_of_long_tailed_packs():
    rng = np.random.default_rng(11)
    costs = long_tailed_costs(rng, 4096)
    topo = Topology(8, 1, 128)
    order = plan_order(costs, topo, MODEL, seed=3, epochs=2)
    shuffle, balanced = order.stats["shuffle"], order.stats["balanced"]
    assert shuffle["mean"] > 0.05  # the shuffle leaves ranks waiting...
    assert balanced["mean"] < 0.1 * shuffle["mean"]  # ...the balanced order hardly
    assert balanced["steps"] == shuffle["steps"] == (2 * 4096) // 128


def test_exchange_window_evens_out_steps_with_one_pack_per_rank():
    rng = np.random.default_rng(2)
    costs = long_tailed_costs(rng, 1024)
    topo = Topology(4, 1, 4)  # one pack per rank: re-dealing inside a step changes nothing
    base = base_permutation(1024, 9, 0)
    same = balanced_permutation(costs, topo, seed=9, epoch=0)
    moved = balanced_permutation(costs, topo, seed=9, epoch=0, exchange_window=8)
    before = straggler_report(base, costs, topo).summary["mean"]
    assert straggler_report(same, costs, topo).summary["mean"] == pytest.approx(before)
    assert straggler_report(moved, costs, topo).summary["mean"] < 0.5 * before


def test_shuffle_algorithm_is_the_base_order():
    costs = np.arange(50, dtype=float)
    np.testing.assert_array_equal(balanced_permutation(costs, Topology(2, 1, 4), seed=4, epoch=2,
                                                       algorithm="shuffle"), base_permutation(50, 4, 2))


def test_epochs_that_straddle_steps_stay_permutations():
    n, topo = 1000, Topology(4, 2, 24)  # 1000 % 24 = 16: every epoch boundary cuts a step
    costs = long_tailed_costs(np.random.default_rng(1), n)
    order = plan_order(costs, topo, MODEL, seed=5, epochs=3)
    stream = order.sample_index(3 * n)
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n))
        base = base_permutation(n, 5, e)
        for lo, hi in groups(n, e, topo, 1):
            assert sorted(order.permutation(e)[lo:hi].tolist()) == sorted(base[lo:hi].tolist())


@pytest.mark.parametrize("kwargs, match", [
    (dict(algorithm="greedy"), "unknown balancing algorithm"),
    (dict(exchange_window=0), "exchange_window must be"),
    (dict(base=np.zeros(10, dtype=np.int64)), "base must be a permutation"),
])
def test_balanced_permutation_refuses_bad_settings(kwargs, match):
    with pytest.raises(ShardError, match=match):
        balanced_permutation(np.ones(10), Topology(2, 1, 2), seed=0, epoch=0, **kwargs)


@pytest.mark.parametrize("costs, match", [([1.0, -1.0], "pack 1 has cost"), ([1.0, float("inf")], "pack 1"),
                                          ([[1.0]], "one-dimensional")])
def test_bad_costs_are_refused_naming_the_pack(costs, match):
    with pytest.raises(ShardError, match=match):
        balanced_permutation(np.array(costs), Topology(1, 1, 1), seed=0, epoch=0)


def test_plan_order_refuses_zero_epochs():
    with pytest.raises(ShardError, match="epochs must be"):
        plan_order(np.ones(4), Topology(1, 1, 2), MODEL, seed=0, epochs=0)
