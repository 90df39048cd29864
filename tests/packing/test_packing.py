"""Packing algorithms: validity, agreement with simple reference implementations, padding helpers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.packing import (
    ALGORITHMS,
    FP8_BLOCK,
    pack_lengths,
    pad_multiple_for,
    packing_summary,
    padded_lengths,
    truncation_length,
)


def reference_first_fit(lengths, order, capacity):
    """O(N*B) first fit: the definition, in plain Python."""
    loads, bin_of = [], [-1] * len(lengths)
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                loads[b] += lengths[i]
                bin_of[i] = b
                break
        else:
            loads.append(lengths[i])
            bin_of[i] = len(loads) - 1
    return np.array(bin_of)


def reference_ffd(lengths, capacity):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return reference_first_fit(lengths, order, capacity)


def reference_bfd_bin_count(lengths, capacity):
    """Best fit decreasing by definition. Bins with equal room are interchangeable, so the
    bin count does not depend on how ties are broken."""
    rooms = []
    for size in sorted(lengths, reverse=True):
        fits = [r for r in rooms if r >= size]
        if fits:
            rooms.remove(min(fits))
            rooms.append(min(fits) - size)
        else:
            rooms.append(capacity - size)
    return len(rooms)


def assert_valid(a, lengths, capacity):
    lengths = np.asarray(lengths)
    assert a.bin_of.shape == lengths.shape and a.bin_of.dtype == np.int32
    assert (a.bin_of >= 0).all() and (a.bin_of < a.n_bins).all()
    # every sequence exactly once in the CSR grouping, ascending inside a bin
    assert np.array_equal(np.sort(a.items), np.arange(lengths.size))
    for b in range(a.n_bins):
        m = a.members(b)
        assert m.size > 0 and (np.diff(m) > 0).all() and (a.bin_of[m] == b).all()
    loads = np.bincount(a.bin_of, weights=lengths, minlength=a.n_bins).astype(np.int64)
    assert np.array_equal(loads, a.loads)
    assert (a.loads <= capacity).all()
    assert a.n_bins >= math.ceil(lengths.sum() / capacity)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_places_each_sequence_once_within_capacity(algorithm):
    rng = np.random.default_rng(7)
    for capacity, high in ((64, 64), (4096, 2048), (4096, 4096), (100, 7)):
        lengths = rng.integers(1, high + 1, 3000)
        a = pack_lengths(lengths, capacity, algorithm, seed=3)
        assert_valid(a, lengths, capacity)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=120), st.integers(50, 80))
def test_ffd_equals_reference_assignment(lengths, capacity):
    a = pack_lengths(np.array(lengths, dtype=np.int64), capacity, "first_fit_decreasing")
    assert np.array_equal(a.bin_of, reference_ffd(lengths, capacity))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=120), st.integers(50, 80))
def test_first_fit_equals_reference_in_input_order(lengths, capacity):
    a = pack_lengths(np.array(lengths), capacity, "first_fit")
    assert np.array_equal(a.bin_of, reference_first_fit(lengths, range(len(lengths)), capacity))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=150), st.integers(60, 90))
def test_best_fit_and_mffd_are_valid(lengths, capacity):
    for algorithm in ("best_fit_decreasing", "modified_first_fit_decreasing"):
        assert_valid(pack_lengths(np.array(lengths), capacity, algorithm), lengths, capacity)
    bfd = pack_lengths(np.array(lengths), capacity, "best_fit_decreasing")
    assert bfd.n_bins == reference_bfd_bin_count(lengths, capacity)


def test_best_fit_picks_tightest_bin():
    # FFD puts 3 into bin 0 (room 5); BFD into bin 1 (room 3), leaving room for the 5
    lengths = [5, 7, 3, 5]
    ffd = pack_lengths(lengths, 10, "first_fit_decreasing")
    bfd = pack_lengths(lengths, 10, "best_fit_decreasing")
    assert_valid(bfd, lengths, 10)
    assert bfd.bin_of[2] == bfd.bin_of[1]  # 3 joins the 7
    assert bfd.n_bins <= ffd.n_bins


def test_mffd_pairs_medium_items_with_large_ones():
    # large 60,55 ; medium 40,35 ; capacity 100 -> two bins: 60+40, 55+35
    a = pack_lengths([35, 60, 40, 55], 100, "modified_first_fit_decreasing")
    assert a.n_bins == 2
    assert a.bin_of[1] == a.bin_of[2] and a.bin_of[3] == a.bin_of[0]


def test_shuffle_is_seeded():
    lengths = np.random.default_rng(0).integers(1, 500, 2000)
    a = pack_lengths(lengths, 1000, "first_fit_shuffle", seed=1)
    b = pack_lengths(lengths, 1000, "first_fit_shuffle", seed=1)
    c = pack_lengths(lengths, 1000, "first_fit_shuffle", seed=2)
    assert np.array_equal(a.bin_of, b.bin_of)
    assert not np.array_equal(a.bin_of, c.bin_of)


def test_decreasing_algorithms_pack_efficiently():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.zipf(1.6, 20000) * 40, 1, 4096)
    for algorithm in ("first_fit_decreasing", "best_fit_decreasing", "modified_first_fit_decreasing"):
        s = packing_summary(pack_lengths(lengths, 4096, algorithm), lengths)
        assert s["sequences"] == lengths.size
        assert s["bins_over_lower_bound"] < 1.02, (algorithm, s)
    ff = packing_summary(pack_lengths(lengths, 4096, "first_fit"), lengths)
    assert ff["efficiency"] <= s["efficiency"] + 1e-9


def test_empty_input_gives_no_bins():
    a = pack_lengths(np.empty(0, dtype=np.int64), 10)
    assert a.n_bins == 0 and a.items.size == 0


@pytest.mark.parametrize("bad", [[0, 3], [11], [-1]])
def test_lengths_outside_capacity_are_refused(bad):
    with pytest.raises(ShardError, match="outside \\[1, 10\\]"):
        pack_lengths(bad, 10)


def test_unknown_algorithm_is_refused():
    with pytest.raises(ShardError, match="unknown packing algorithm"):
        pack_lengths([1], 10, "next_fit")


@pytest.mark.parametrize("cp,tp,sp,expected", [
    (1, 1, False, 1), (2, 1, False, 4), (4, 8, False, 8), (2, 4, True, 8), (4, 2, True, 8),
    (3, 4, True, 12), (1, 4, True, 4), (2, 3, True, 12),
])
def test_pad_multiple_for_parallelism(cp, tp, sp, expected):
    assert pad_multiple_for(cp, tp, sp) == expected


def nemo_rl_packed_row_multiple(cp, tp, sp, recipe):
    """NeMo-RL's packed-row divisor (nemo_rl/models/megatron/data.py at 7ea279ab,
    ``_get_pack_sequence_parameters_for_megatron``), restated in its own order of steps."""
    divisor = {"blockwise": 128, "mxfp8": 32}.get(recipe, 16)
    out = divisor
    if cp > 1:
        out *= cp * 2
    if tp > 1 and sp:
        out *= tp
    return out


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("cp,tp,sp", [(1, 1, False), (2, 1, False), (1, 4, True), (2, 4, True), (4, 2, False),
                                      (3, 3, True), (1, 2, False)])
def test_pad_multiple_for_fp8_is_nemo_rls_row_rule_per_sequence(cp, tp, sp, recipe):
    mult = pad_multiple_for(cp, tp, sp, recipe)
    row = nemo_rl_packed_row_multiple(cp, tp, sp, recipe)
    assert mult % pad_multiple_for(cp, tp, sp) == 0   # the CP/TP rule still holds
    assert mult == row   # each sequence a multiple of it: so is every pack's sum of sequences
    lengths = padded_lengths(np.random.default_rng(cp * 10 + tp).integers(1, 3000, 50), mult)
    share = lengths.sum() // (cp * (tp if sp else 1))   # one rank's tokens once CP and SP split the row
    assert lengths.sum() % (cp * (tp if sp else 1)) == 0 and share % FP8_BLOCK[recipe] == 0


def test_pad_multiple_for_fp8_values_and_refusal():
    assert pad_multiple_for(fp8="mxfp8") == 32 and pad_multiple_for(fp8="tensorwise") == 16
    assert pad_multiple_for(2, 4, True, "mxfp8") == 512 and pad_multiple_for(2, 1, False, "blockwise") == 512
    with pytest.raises(ShardError, match="unknown FP8 recipe") as info:
        pad_multiple_for(2, 1, False, "nvfp4")
    assert info.value.field == "fp8"


def test_pad_helpers():
    assert padded_lengths([1, 4, 5, 8], 4).tolist() == [4, 4, 8, 8]
    assert truncation_length(4097, 8) == 4096
    with pytest.raises(ShardError):
        pad_multiple_for(0, 1)


# ---------------------------------------------------------------- the lean kernels vs the old ones

from support.legacy.packing_126c196 import legacy_pack  # noqa: E402

#: The algorithms the old kernels had (megatron_lm_mffd is checked against Megatron-LM #5017's own
#: bins instead: tests/packing/test_megatron_lm_packing.py).
LEGACY_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "megatron_lm_mffd")


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=0, max_size=400), st.integers(200, 260), st.integers(0, 5),
       st.sampled_from(LEGACY_ALGORITHMS), st.sampled_from([np.int32, np.int64]))
def test_every_algorithm_places_every_sequence_where_the_previous_kernels_did(lengths, capacity, seed,
                                                                              algorithm, dtype):
    arr = np.array(lengths, dtype=dtype)
    a = pack_lengths(arr, capacity, algorithm, seed=seed)
    bin_of, offsets, items, loads = legacy_pack(arr, capacity, algorithm, seed)
    assert np.array_equal(a.bin_of, bin_of) and np.array_equal(a.offsets, offsets)
    assert np.array_equal(a.items, items) and np.array_equal(a.loads, loads)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", LEGACY_ALGORITHMS)
def test_many_bins_grow_the_trees_and_still_match(algorithm):
    # > 1024 bins (the initial tree and per-bin arrays) and a heavy tail of large items
    rng = np.random.default_rng(4)
    lengths = np.concatenate([rng.integers(600, 1001, 3000), rng.integers(1, 400, 5000)]).astype(np.int32)
    rng.shuffle(lengths)
    a = pack_lengths(lengths, 1000, algorithm, seed=9)
    bin_of, offsets, items, loads = legacy_pack(lengths, 1000, algorithm, 9)
    assert a.n_bins > 3000 and np.array_equal(a.bin_of, bin_of) and np.array_equal(a.items, items)
    assert a.items.dtype == np.int32
