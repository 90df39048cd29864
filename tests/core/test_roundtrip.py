"""Property tests: every pack written is read back exactly, with correct indexes and statistics."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from support.shardgen import random_pack

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def expected_stats(packs, pack_size):
    """The packing statistics, computed here independently of the builder."""
    seqlens = np.concatenate([np.diff(np.append(s, len(ids))) for ids, _, s in packs])
    packed = np.array([len(ids) for ids, _, _ in packs])
    n_seq = sum(len(s) for _, _, s in packs)
    n_tok = int(packed.sum())
    return {
        "pack_count": len(packs), "sequence_count": n_seq, "token_count": n_tok,
        "loss_token_count": int(sum(int(np.sum(loss)) for _, loss, _ in packs)),
        "max_samples_per_bin": max(len(s) for _, _, s in packs),
        "dataset_max_seqlen": int(seqlens.max()), "min_seqlen": int(seqlens.min()),
        "min_packed_seqlen": int(packed.min()), "max_packed_seqlen": int(packed.max()),
        "packing_factor": round(n_seq / len(packs), 6),
        "packing_efficiency": None if pack_size is None else round(n_tok / (len(packs) * pack_size), 6),
    }


def single_token_pack(n):
    """n sequences of one token each: every loss value must be 0 (label-aligned)."""
    return np.arange(n) + 1, np.zeros(n, np.uint8), np.arange(n)


@st.composite
def shards(draw):
    pad_mult = draw(st.sampled_from([1, 1, 2, 4]))
    pack_size = pad_mult * draw(st.integers(1, 16))
    n_packs = draw(st.sampled_from([1, 1, 2, 5, 30, 120]))
    vocab = draw(st.sampled_from([50, 65536, 200_000]))
    mode = draw(st.sampled_from(["auto", "explicit", "vocab"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    full_share = draw(st.sampled_from([0.0, 0.5, 1.0]))
    packs = []
    for _ in range(n_packs):
        kind = rng.random()
        if pad_mult == 1 and kind < 0.1:
            packs.append(single_token_pack(int(rng.integers(1, pack_size + 1))))
        else:
            packs.append(random_pack(rng, pack_size=pack_size, vocab=min(vocab, 65536), max_seqs=6,
                                     pad_mult=pad_mult, full=kind < full_share))
    if vocab > 65536:  # ids beyond uint16 arrive mid-stream
        k = int(rng.integers(0, n_packs))
        ids = packs[k][0].copy()
        ids[int(rng.integers(0, len(ids)))] = int(rng.integers(65536, vocab))
        packs[k] = (ids,) + tuple(packs[k][1:])
    kw = {"pack_size": draw(st.sampled_from([pack_size, None])),
          "metadata": {"pad_seq_to_mult": pad_mult}}
    if mode == "explicit":
        kw["dtype"] = np.uint16 if vocab <= 65536 else np.int32
    elif mode == "vocab":
        kw["vocab_size"] = vocab
    return packs, kw


def write(prefix, packs, kw):
    with IndexedDatasetBuilder(prefix, **kw) as b:
        for i, p in enumerate(packs):
            assert b.add_packed(*p) == i
    return b.metadata


@SETTINGS
@given(case=shards())
def test_round_trip(tmp_path_factory, case):
    packs, kw = case
    prefix = str(tmp_path_factory.mktemp("rt") / "s")
    written = write(prefix, packs, kw)
    ds = MMapIndexedDataset(prefix, check_packs=True)
    n = len(packs)
    wide = max(int(ids.max()) for ids, _, _ in packs) > 65535
    dtype = np.int32 if wide else np.uint16
    assert len(ds) == n and ds.dtype.numpy == dtype and not ds.is_pretrain
    assert ds.metadata == written and ds.metadata.token_dtype == np.dtype(dtype).name
    assert ds.metadata.pack_size == kw["pack_size"] and ds.metadata.vocab_size == kw.get("vocab_size")
    assert ds.metadata.pad_seq_to_mult == kw["metadata"]["pad_seq_to_mult"]

    for i, (ids, loss, starts) in enumerate(packs):
        pack = ds[i]
        assert pack.input_ids.dtype == dtype and pack.loss_mask.dtype == np.uint8
        assert pack.seq_start_id.dtype == np.int32
        np.testing.assert_array_equal(pack.input_ids, ids)
        np.testing.assert_array_equal(pack.loss_mask, loss)
        np.testing.assert_array_equal(pack.seq_start_id, starts)
        np.testing.assert_array_equal(pack.seq_boundaries, np.append(starts, len(ids)))
        assert pack.packed_len == len(ids)
        d = pack.as_dict()
        assert set(d) == {"input_ids", "seq_boundaries", "loss_mask"}
        np.testing.assert_array_equal(d["seq_boundaries"], pack.seq_boundaries)
        np.testing.assert_array_equal(ds[i - n].input_ids, ids)  # negative index

    lengths = np.array([len(p[0]) for p in packs])
    counts = np.array([len(p[2]) for p in packs])
    np.testing.assert_array_equal(ds.sequence_lengths, lengths)
    np.testing.assert_array_equal(ds.sequence_pointers,
                                  np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize)
    np.testing.assert_array_equal(ds.document_indices, np.arange(n + 1))
    np.testing.assert_array_equal(ds.seq_offsets, np.concatenate([[0], np.cumsum(counts)]))
    assert ds.num_tokens == lengths.sum()

    stats = ds.metadata.stats
    assert {k: getattr(stats, k) for k in expected_stats(packs, kw["pack_size"])} == \
        expected_stats(packs, kw["pack_size"])

    arrays = ds.arrays()
    np.testing.assert_array_equal(arrays.tokens, np.concatenate([p[0] for p in packs]))
    np.testing.assert_array_equal(arrays.loss_mask, np.concatenate([p[1] for p in packs]))
    np.testing.assert_array_equal(arrays.seq_starts, np.concatenate([p[2] for p in packs]))


@SETTINGS
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 12), data=st.data())
def test_slices_indices_and_windows(tmp_path_factory, seed, n, data):
    rng = np.random.default_rng(seed)
    packs = [random_pack(rng, pack_size=24, vocab=500, max_seqs=5) for _ in range(n)]
    prefix = str(tmp_path_factory.mktemp("sl") / "s")
    write(prefix, packs, {"pack_size": 24})
    ds = MMapIndexedDataset(prefix)

    a = data.draw(st.integers(-n - 3, n + 3))
    b = data.draw(st.integers(-n - 3, n + 3))
    got = ds[a:b]
    want = packs[a:b]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.input_ids, w[0])
        np.testing.assert_array_equal(g.seq_start_id, w[2])
    with pytest.raises(ValueError, match="contiguous"):
        ds[::2]
    for bad in (n, n + 5, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]
    with pytest.raises(TypeError):
        ds[1.0]
    np.testing.assert_array_equal(ds[np.int64(n - 1)].input_ids, packs[-1][0])

    i = data.draw(st.integers(0, n - 1))
    ids, loss, starts = packs[i]
    plen = len(ids)
    offset = data.draw(st.integers(0, plen - 1))
    length = data.draw(st.integers(1, plen - offset))
    win = ds.get(i, offset, length)
    np.testing.assert_array_equal(win.input_ids, ids[offset:offset + length])
    np.testing.assert_array_equal(win.loss_mask, loss[offset:offset + length])
    inside = starts[(starts > offset) & (starts < offset + length)] - offset
    np.testing.assert_array_equal(win.seq_start_id, np.concatenate([[0], inside]))
    ws = win.seq_start_id
    assert ws[0] == 0 and np.all(np.diff(ws) > 0) and ws[-1] < length  # the window is a valid pack layout
    np.testing.assert_array_equal(ds.get(i, offset).input_ids, ids[offset:])
    np.testing.assert_array_equal(ds.get(i).input_ids, ids)
    for bad_off, bad_len in ((plen, 1), (-1, 1), (offset, 0), (offset, plen - offset + 1)):
        with pytest.raises(IndexError, match="outside pack"):
            ds.get(i, bad_off, bad_len)


def test_views_are_read_only(tmp_path, rng):
    prefix = str(tmp_path / "s")
    write(prefix, [random_pack(rng) for _ in range(3)], {"pack_size": 64})
    ds = MMapIndexedDataset(prefix)
    pack = ds[1]
    window = ds.get(1, 0, 1)
    arrays = ds.arrays()
    for arr in (*pack, *window, *arrays, ds.sequence_lengths, ds.sequence_pointers, ds.document_indices):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[...] = 0


@pytest.mark.parametrize("wide_at", [0, 3, 9])
def test_auto_dtype_widens_when_a_large_id_arrives_mid_stream(tmp_path, rng, wide_at):
    packs = [random_pack(rng, pack_size=16, vocab=65536) for _ in range(10)]
    ids = packs[wide_at][0].copy()
    ids[-1] = 65536
    packs[wide_at] = (ids,) + packs[wide_at][1:]
    prefix = str(tmp_path / "s")
    meta = write(prefix, packs, {"pack_size": 16})
    ds = MMapIndexedDataset(prefix)
    assert meta.token_dtype == "int32" and ds.dtype.name == "int32"
    assert ds.metadata.files[".bin"].size == 4 * sum(len(p[0]) for p in packs)
    for i, (ids, loss, starts) in enumerate(packs):
        np.testing.assert_array_equal(ds[i].input_ids, ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted("s" + s for s in
                                                                (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"))
