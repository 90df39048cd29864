"""``megatron_lm_mffd`` against the bins Megatron-LM #5017's own ``pack_samples`` returned.

The bins are data (tests/golden/megatron_lm_5017/arrays.npz, written by
tests/compat/make_megatron_lm_5017_golden.py from #5017's code at ``97b2c55e``): 3000 lengths drawn
from few values, so that ties, every size class and every phase occur. tests/compat/
test_megatron_lm_5017.py compares the packs of real conversations as well.
"""

import os

import numpy as np
import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.packing import pack_lengths
from megatron_sft_idx.packing.megatron_lm import megatron_lm_bins

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "megatron_lm_5017",
                      "arrays.npz")
CAPACITY = 1000   # make_megatron_lm_5017_golden.SYNTHETIC_CAPACITY


@pytest.fixture(scope="module")
def reference():
    arrays = np.load(GOLDEN)
    bins = np.split(arrays["synthetic_bins_flat"], np.cumsum(arrays["synthetic_bins_sizes"])[:-1])
    return arrays["synthetic_lengths"], [b.tolist() for b in bins]


def test_bins_equal_its_pack_samples(reference):
    lengths, bins = reference
    assert megatron_lm_bins(lengths, CAPACITY) == bins   # members, their order, the bins' order


def test_the_algorithm_behind_the_flag_groups_the_same_bins(reference):
    lengths, bins = reference
    a = pack_lengths(lengths, CAPACITY, "megatron_lm_mffd")
    assert a.n_bins == len(bins)
    for b, members in enumerate(bins):
        assert a.members(b).tolist() == sorted(members)   # ours: ascending inside a pack
        assert a.loads[b] == lengths[members].sum() <= CAPACITY


def test_its_last_phase_is_least_full_not_first_fit():
    """5, 5, 5, 2 at capacity 12 (no large item: all go to the last phase): 5 and 5 fill one bin
    to 10, the third 5 opens another; the 2 is tried in the least-full bin only (5, not 10), so
    the bins are [5, 5] and [5, 2], listed by load ascending. First fit puts the 2 beside 10."""
    assert megatron_lm_bins(np.array([5, 5, 5, 2]), 12) == [[2, 3], [0, 1]]
    first_fit = pack_lengths([5, 5, 5, 2], 12, "first_fit_decreasing")
    assert [first_fit.members(b).tolist() for b in range(first_fit.n_bins)] == [[0, 1, 3], [2]]


def test_overlong_lengths_are_refused_as_by_every_algorithm():
    with pytest.raises(ShardError, match="outside"):
        pack_lengths([5, 11], 10, "megatron_lm_mffd")
