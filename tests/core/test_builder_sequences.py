"""IndexedDatasetBuilder.add_sequences: many one-sequence packs in one call, same bytes as add_packed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sft_idx.builder import IndexedDatasetBuilder
from megatron_sft_idx.errors import InvariantError


def _files(prefix):
    return [open(prefix + s, "rb").read() for s in (".bin", ".loss.bin", ".seq.bin", ".idx", ".seq.idx")]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(0, 2 ** 31 - 1))
def test_same_bytes_as_one_add_packed_per_sequence(tmp_path_factory, lengths, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 70000, size=sum(lengths))      # crosses uint16: both widen the same way
    loss = rng.integers(0, 2, size=ids.size).astype(np.uint8)
    ends = np.cumsum(lengths)
    loss[ends - 1] = 0
    d = tmp_path_factory.mktemp("b")
    with IndexedDatasetBuilder(str(d / "one"), pack_size=None) as b:
        for a, e in zip(np.concatenate([[0], ends[:-1]]), ends):
            b.add_packed(ids[a:e], loss[a:e], [0])
    with IndexedDatasetBuilder(str(d / "batch"), pack_size=None) as b:
        half = len(lengths) // 2
        cut = int(ends[half - 1]) if half else 0
        assert b.add_sequences(ids[:cut], loss[:cut], lengths[:half]) == 0
        assert b.add_sequences(ids[cut:], loss[cut:], lengths[half:]) == half
    assert _files(str(d / "one")) == _files(str(d / "batch"))


def test_bad_sequence_is_refused_naming_it_and_nothing_is_written(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "s"), vocab_size=100) as b:
        b.add_sequences([1, 2, 3], [1, 1, 0], [3])
        with pytest.raises(InvariantError, match="pack 2 rejected") as e:
            b.add_sequences([1, 2, 3, 4, 5], [1, 0, 0, 1, 1], [2, 3])   # last position of pack 2 trains
        assert e.value.rule == "LOSS_ON_LAST"
        with pytest.raises(InvariantError):
            b.add_sequences([1, 200], [1, 0], [2])
        assert len(b) == 1
    with pytest.raises(Exception, match="add up"):
        with IndexedDatasetBuilder(str(tmp_path / "t")) as b:
            b.add_sequences([1, 2, 3], [1, 1, 0], [2])
