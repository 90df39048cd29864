"""Cross-reads with the real PyPI megatron-core: its reader opens our shards, ours opens its datasets."""

import warnings

import numpy as np
import pytest
import torch

from megatron_sft_idx import MMapIndexedDataset
from support.shardgen import random_packs, write_shard

# upstream add_document passes a tensor to numpy.array (a numpy 2 DeprecationWarning of theirs).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as upstream


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 65000), (np.int32, 200_000)])
def test_upstream_reads_our_shard(tmp_path, rng, dtype, vocab):
    prefix = str(tmp_path / "s")
    packs = random_packs(rng, 40, pack_size=48, vocab=vocab)
    packs.append((np.array([vocab - 1]), np.array([0]), np.array([0])))  # a one-token pack at the top id
    write_shard(prefix, packs, pack_size=48, vocab_size=vocab)
    ours = MMapIndexedDataset(prefix)
    theirs = upstream.IndexedDataset(prefix)
    assert ours.dtype.numpy == dtype and theirs.index.dtype == dtype
    assert len(theirs) == len(packs)
    for i, (ids, _, _) in enumerate(packs):
        got = theirs[i]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, ids)
        np.testing.assert_array_equal(got, ours[i].input_ids)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    np.testing.assert_array_equal(theirs.index.sequence_pointers, ours.sequence_pointers)
    # Partial reads agree too (upstream's get(idx, offset, length)).
    for i in (0, 7, len(packs) - 2):
        n = len(packs[i][0])
        np.testing.assert_array_equal(theirs.get(i, n // 3, n - n // 3), ours.get(i, n // 3).input_ids)
    assert upstream.IndexedDataset.exists(prefix)


def _upstream_write(prefix, dtype, build):
    builder = upstream.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    build(builder)
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_we_read_upstream_add_item_dataset(tmp_path, rng, dtype):
    prefix = str(tmp_path / "u")
    docs = [[rng.integers(0, 60000, int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 4)))]
            for _ in range(15)]

    def build(b):
        for doc in docs:
            for seq in doc:
                b.add_item(torch.from_numpy(seq))
            b.end_document()

    _upstream_write(prefix, dtype, build)
    seqs = [s for doc in docs for s in doc]
    ours = MMapIndexedDataset(prefix)
    theirs = upstream.IndexedDataset(prefix)
    assert ours.is_pretrain and ours.metadata.kind == "pretrain" and len(ours) == len(seqs)
    for i, s in enumerate(seqs):
        pack = ours[i]
        assert pack.input_ids.dtype == dtype
        np.testing.assert_array_equal(pack.input_ids, s)
        np.testing.assert_array_equal(pack.input_ids, theirs[i])
        np.testing.assert_array_equal(pack.loss_mask, np.ones(len(s), np.uint8))
        assert pack.seq_start_id.tolist() == [0]
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    np.testing.assert_array_equal(ours.sequence_lengths, [len(s) for s in seqs])


def test_we_read_upstream_add_document_dataset(tmp_path, rng):
    prefix = str(tmp_path / "u")
    docs = []
    for _ in range(10):
        lengths = rng.integers(1, 20, int(rng.integers(1, 5))).tolist()
        docs.append((rng.integers(0, 32000, sum(lengths)), lengths))

    def build(b):
        for tokens, lengths in docs:
            b.add_document(torch.from_numpy(tokens), lengths)

    _upstream_write(prefix, np.uint16, build)
    ours = MMapIndexedDataset(prefix, check_packs=True)
    theirs = upstream.IndexedDataset(prefix)
    seqs = [s for tokens, lengths in docs for s in np.split(tokens, np.cumsum(lengths)[:-1])]
    assert len(ours) == len(theirs) == len(seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ours[i].input_ids, s)
        np.testing.assert_array_equal(ours[i].input_ids, theirs[i])
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.arrays().tokens, np.concatenate([t for t, _ in docs]))
