"""Dynamic batching: the planner reproduces NeMo-RL's algorithm micro-batch for micro-batch.

The reference below restates, in plain Python and one step at a time, what NeMo-RL's
``BatchedDataDict.shard_by_batch_size(shards, batch_size, dynamic_batching_args=...)`` does
(nemo_rl/distributed/batched_data_dict.py): sort a chunk's indices by length (Python's stable
``sorted``), stride them over the shards, then walk the shard index, growing a micro-batch while
``rows * max(rounded length) <= max_tokens_per_microbatch``.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_sft_idx.batching.dynamic import plan_dynamic
from megatron_sft_idx.batching.layout import base_permutation
from megatron_sft_idx.errors import ShardError


def nemo_rl_reference(order, lengths, gbs, dp, budget, rnd, width_mult=1):
    """(served ids, [per step: [(start, end, width), ...]]) as NeMo-RL forms them."""
    served, steps = [], []
    shard = gbs // dp
    for s in range(len(order) // gbs):
        chunk = [int(i) for i in order[s * gbs:(s + 1) * gbs]]
        lens = [int(lengths[i]) for i in chunk]
        width = -(-max(lens) // width_mult) * width_mult
        ranked = sorted(range(gbs), key=lambda i: lens[i])
        per_rank = [ranked[r::dp] for r in range(dp)]
        for r in range(dp):
            served.extend(chunk[i] for i in per_rank[r])
        mbs = [[0, 0]]
        widths = [0]
        current = 0
        for k in range(shard):
            longest = max(lens[per_rank[r][k]] for r in range(dp))
            w = min(-(-longest // rnd) * rnd, width)
            assert w <= budget
            current = max(current, w)
            if (mbs[-1][1] - mbs[-1][0] + 1) * current <= budget:
                mbs[-1][1] += 1
                widths[-1] = current
            else:
                mbs.append([k, k + 1])
                current = w
                widths.append(w)
        steps.append([(a, b, w) for (a, b), w in zip(mbs, widths)])
    return served, steps


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 400), st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 8, 64]),
       st.sampled_from([1, 16]), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_plan_matches_the_reference(n, dp, per_rank, rnd, width_mult, epoch, seed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5, 1.2, n), 1, 3000).astype(np.int64)
    budget = 4096
    gbs = dp * per_rank
    plan = plan_dynamic(lengths, global_batch_size=gbs, data_parallel_size=dp, max_tokens_per_microbatch=budget,
                        sequence_length_round=rnd, seed=seed, epoch=epoch, batch_width_multiple=width_mult)
    served, steps = nemo_rl_reference(base_permutation(n, seed, epoch), lengths, gbs, dp, budget, rnd, width_mult)
    assert plan.served.tolist() == served
    assert plan.steps == len(steps) == n // gbs
    for s, expected in enumerate(steps):
        lo, hi = plan.mb_offsets[s], plan.mb_offsets[s + 1]
        got = [(int(a), int(b), int(w)) for (a, b), w in zip(plan.mb_bounds[lo:hi], plan.mb_widths[lo:hi])]
        assert got == expected
        for rank in range(dp):
            batches = plan.rank_microbatches(s, rank)
            ids = np.concatenate([b for b, _ in batches])
            assert ids.tolist() == served[s * gbs + rank * per_rank:s * gbs + (rank + 1) * per_rank]
            for b, w in batches:
                assert len(b) * w <= budget and lengths[b].max() <= w


def test_the_seed_documents_worked_example():
    # lengths 2, 4, 7, 6, 3, 4 and 16 tokens per micro-batch, one rank (the seed doc's figure);
    # NeMo-RL's code sorts ascending: [2, 3, 4, 4] at width 4 (16 tokens), then [6, 7] at width 7.
    lengths = np.array([2, 4, 7, 6, 3, 4])
    plan = plan_dynamic(lengths, global_batch_size=6, data_parallel_size=1, max_tokens_per_microbatch=16,
                        order=np.arange(6))
    assert [(ids.tolist(), w) for ids, w in plan.rank_microbatches(0, 0)] == [([0, 4, 1, 5], 4), ([3, 2], 7)]
    stats = plan.stats()
    assert stats["tokens"] == 26 and stats["padded_tokens"] == 16 + 14
    assert stats["padding_share"] == pytest.approx(1 - 26 / 30)


def test_ranks_share_boundaries_and_get_strided_lengths():
    lengths = np.arange(1, 17)  # one step of 16 sequences over 4 ranks
    plan = plan_dynamic(lengths, global_batch_size=16, data_parallel_size=4, max_tokens_per_microbatch=32,
                        order=np.arange(16))
    got = [plan.rank_microbatches(0, r) for r in range(4)]
    # rank r holds lengths r+1, r+5, r+9, r+13; row k is as wide as rank 3's k-th (4, 8, 12, 16)
    assert [np.concatenate([ids for ids, _ in g]).tolist() for g in got] == [[r, r + 4, r + 8, r + 12]
                                                                             for r in range(4)]
    # rows 4 + 8 fit (2 x 8 = 16), a third at 12 would not (3 x 12 = 36 > 32); 12 + 16 fit (2 x 16 = 32)
    assert all([w for _, w in g] == [8, 16] for g in got)
    assert all([len(ids) for ids, _ in g] == [2, 2] for g in got)


def test_resume_continues_at_the_consumed_step():
    lengths = np.random.default_rng(4).integers(1, 500, 300)
    plan = plan_dynamic(lengths, global_batch_size=20, data_parallel_size=2, max_tokens_per_microbatch=1024, seed=3)
    full = list(plan.iter_rank(1))
    start = plan.step_of(100)
    assert start == 5
    resumed = list(plan.iter_rank(1, start))
    assert [(s, ids.tolist(), w) for s, ids, w in resumed] == [(s, ids.tolist(), w) for s, ids, w in full
                                                             if s >= 5]
    again = plan_dynamic(lengths, global_batch_size=20, data_parallel_size=2, max_tokens_per_microbatch=1024, seed=3)
    np.testing.assert_array_equal(again.served, plan.served)
    with pytest.raises(ShardError, match="not a step boundary"):
        plan.step_of(30)
    assert plan.step_of(300 + 40, epoch_offset=300) == 2


def test_a_sequence_over_the_budget_is_named():
    lengths = np.array([10, 20, 4000, 30])
    with pytest.raises(ShardError, match="1 of the 4 sequences served does not fit.* sequence 2 \\(4,000 tokens") \
            as err:
        plan_dynamic(lengths, global_batch_size=4, data_parallel_size=1, max_tokens_per_microbatch=2048,
                     order=np.arange(4))
    assert "raise max_tokens_per_microbatch (--max-tokens-per-microbatch) to 4000" in str(err.value)
    # rounding alone can push a sequence over the budget
    with pytest.raises(ShardError, match="sequence 0"):
        plan_dynamic(np.array([1000, 5]), global_batch_size=2, data_parallel_size=1, max_tokens_per_microbatch=1000,
                     sequence_length_round=64, batch_width_multiple=64, order=np.arange(2))


def test_every_sequence_over_the_budget_is_counted_in_one_error():
    """Issue 44 item 4: the count, the longest (not the first met) and a budget that fits them all."""
    lengths = np.array([10, 3000, 20, 5000, 4100, 30, 2500, 40])
    with pytest.raises(ShardError) as err:
        plan_dynamic(lengths, global_batch_size=4, data_parallel_size=1, max_tokens_per_microbatch=2048,
                     order=np.arange(8))
    text = str(err.value)
    assert "4 of the 8 sequences served do not fit one micro-batch of 2,048 tokens" in text
    assert "the longest is sequence 3 (5,000 tokens)" in text and "to 5000 or more" in text
    assert "\n" not in text and err.value.expected == ">= 5,000 (fits every sequence)"
    plan_dynamic(lengths, global_batch_size=4, data_parallel_size=1, max_tokens_per_microbatch=5000,
                 order=np.arange(8))   # the budget it names fits
    with pytest.raises(ShardError, match="1 of the 2 sequences .*does not fit.* a multiple of 64.* to 1024 or"):
        plan_dynamic(np.array([1000, 5]), global_batch_size=2, data_parallel_size=1, max_tokens_per_microbatch=1000,
                     sequence_length_round=64, batch_width_multiple=64, order=np.arange(2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_batch_size=6, data_parallel_size=4), "multiple of data_parallel_size"),
    (dict(global_batch_size=0, data_parallel_size=1), "global_batch_size must be"),
    (dict(global_batch_size=4, data_parallel_size=1, sequence_length_round=0), "sequence_length_round"),
    (dict(global_batch_size=4, data_parallel_size=1, order=np.array([0, 1, 9, 2])), "order must hold"),
])
def test_bad_settings_are_refused(kwargs, match):
    kwargs.setdefault("max_tokens_per_microbatch", 100)
    with pytest.raises(ShardError, match=match):
        plan_dynamic(np.array([5, 6, 7, 8]), **kwargs)


def test_zero_length_sequences_are_refused():
    with pytest.raises(ShardError, match="integers >= 1"):
        plan_dynamic(np.array([5, 0]), global_batch_size=2, data_parallel_size=1, max_tokens_per_microbatch=100)


def test_the_epochs_last_partial_step_is_left_out():
    plan = plan_dynamic(np.full(25, 7), global_batch_size=10, data_parallel_size=2, max_tokens_per_microbatch=100)
    assert plan.steps == 2 and plan.served.size == 20
    with pytest.raises(ShardError, match="step 2 is outside"):
        plan.microbatches(2)
