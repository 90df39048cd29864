"""The per-pack path: ``ds[i]``, ``get`` windows and ``get_many`` agree with the raw arrays."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import InvariantError
from megatron_sft_idx.multi import MultiShardDataset


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("hot")
    rng = np.random.default_rng(21)
    out = []
    for k, n in enumerate((90, 40)):
        out.append(str(root / f"s{k}"))
        write_shard(out[-1], random_packs(rng, n, pack_size=128), pack_size=128)
    return out


def raw_pack(ds, i):
    a = ds.arrays()
    t0 = int(a.sequence_pointers[i]) // ds.dtype.itemsize
    t1 = t0 + int(a.sequence_lengths[i])
    return a.tokens[t0:t1], a.loss_mask[t0:t1], a.seq_starts[int(a.seq_offsets[i]):int(a.seq_offsets[i + 1])]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_getitem_and_get_many_equal_the_raw_arrays(shards):
    ds = MMapIndexedDataset(shards[0])
    n = len(ds)
    for i in range(n):
        assert same(ds[i], raw_pack(ds, i)) and same(ds[np.int64(i)], raw_pack(ds, i))
        assert same(ds[i - n], raw_pack(ds, i))
    order = np.random.default_rng(0).permutation(n)
    got = ds.get_many(order)
    assert len(got) == n and all(same(p, raw_pack(ds, int(i))) for p, i in zip(got, order))
    assert all(same(p, raw_pack(ds, i)) for p, i in zip(ds.get_many([-1, 0, -n]), (n - 1, 0, 0)))
    assert ds.get_many([]) == [] and ds.get_many(np.empty(0, np.int64)) == []
    assert all(not p.input_ids.flags.writeable for p in got[:3])
    assert same(ds[5:9][2], raw_pack(ds, 7)) and ds[n:n + 3] == []


@pytest.mark.parametrize("bad, error", [([0, 1.5], TypeError), ([[0, 1]], TypeError), ([0, 90], IndexError),
                                        ([-91], IndexError), ("ab", TypeError)])
def test_get_many_refuses_bad_indices(shards, bad, error):
    with pytest.raises(error):
        MMapIndexedDataset(shards[0]).get_many(bad)


@pytest.mark.parametrize("bad, error", [(1.0, TypeError), (90, IndexError), (-91, IndexError), ("3", TypeError)])
def test_getitem_refuses_bad_indices(shards, bad, error):
    with pytest.raises(error):
        MMapIndexedDataset(shards[0])[bad]


def _window_reference(pack, offset, length):
    starts = [0] + [int(s) - offset for s in pack.seq_start_id if offset < s < offset + length]
    return pack.input_ids[offset:offset + length], pack.loss_mask[offset:offset + length], np.array(starts)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 89), st.floats(0, 1, exclude_max=True), st.floats(0, 1))
def test_get_windows_follow_the_rule(shards, i, a, b):
    ds = MMapIndexedDataset(shards[0])
    pack = ds[i]
    n = pack.packed_len
    offset = int(a * n)
    length = max(1, int(b * (n - offset)))
    window = ds.get(i, offset, length)
    assert same(window, _window_reference(pack, offset, length))
    assert window.seq_start_id.dtype == np.int32 and not window.seq_start_id.flags.writeable
    assert ds.get(i) is not None and same(ds.get(i), pack)


def test_get_many_checks_corrupt_index_entries(shards, tmp_path):
    import shutil

    prefix = str(tmp_path / "c")
    for suffix in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"):
        shutil.copy(shards[0] + suffix, prefix + suffix)
    ds = MMapIndexedDataset(prefix)
    h = ds.idx_header
    with open(prefix + ".idx", "r+b") as f:  # pack 3's length: far past the end of .bin
        f.seek(h.lengths_offset + 4 * 3)
        f.write((1 << 30).to_bytes(4, "little"))
    ds = MMapIndexedDataset(prefix)
    with pytest.raises(InvariantError, match="pack 3 is corrupt"):
        ds.get_many([0, 1, 3])
    with pytest.raises(InvariantError, match="pack 3 is corrupt"):
        ds[3]


def test_multi_shard_get_many_follows_global_indices(shards):
    multi = MultiShardDataset.open(shards)
    parts = [MMapIndexedDataset(s) for s in shards]
    order = np.random.default_rng(2).permutation(len(multi))
    flat = [(0, i) for i in range(90)] + [(1, i) for i in range(40)]
    for pack, g in zip(multi.get_many(order), order.tolist()):
        k, i = flat[g]
        assert same(pack, raw_pack(parts[k], i))
    with pytest.raises(IndexError):
        multi.get_many([130])
