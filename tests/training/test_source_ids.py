"""Every batch can carry each position's source (data written from a mixture, format 1.2): the
Megatron-LM dataset through the real BlendedMegatronDatasetBuilder, Bridge's collate and the
padding-free collator, each aligned with the tokens it serves; data without sources is refused."""

import numpy as np
import pytest
import torch

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.training.bridge import PackedSFTDataset
from megatron_sft_idx.training.hf import PaddingFreeCollator, PaddingFreeDataset

from support.shardgen import random_packs, write_shard

SEQ = 64
NAMES = [{"name": "chat"}, {"name": "math"}, {"name": "tools"}]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(11)
    packs = [p + (rng.integers(0, 3, p[2].size),) for p in random_packs(rng, 120, pack_size=SEQ)]
    write_shard(str(root / "mixed"), packs, metadata={"sources": NAMES}, vocab_size=1000)
    write_shard(str(root / "plain"), random_packs(rng, 20, pack_size=SEQ), vocab_size=1000)
    return {"mixed": str(root / "mixed"), "plain": str(root / "plain")}


def expected_tokens(ds, i):
    """Each stored position's source, from the reader's own per-sequence ids."""
    pack = ds[i]
    return np.repeat(np.asarray(ds.source_ids(i), np.int64), pack.seq_lengths)


def test_megatron_samples_carry_each_positions_source(shards):
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron_sft_idx.training import megatron as M

    config = M.SFTIndexedDatasetConfig(random_seed=1, sequence_length=SEQ, blend=([shards["mixed"]], None),
                                       split="100,0,0", return_source_ids=True)
    train, _, _ = builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [150, None, None], lambda: True,
                                                        config).build()
    low = MMapIndexedDataset(shards["mixed"])
    assert train.sources == ("chat", "math", "tools")
    for j in (0, 7, 149):
        sample = train[j]
        want = expected_tokens(low, int(train.sample_index[j]))
        got = sample["source_ids"].numpy()
        assert got.shape == (SEQ,) and got[:want.size].tolist() == want.tolist() and (got[want.size:] == -1).all()
        # a trainer's loss per source: the mask restricted to each source's positions
        per = [float(sample["loss_mask"][got == k].sum()) for k in range(3)]
        assert sum(per) == float(sample["loss_mask"].sum())
    plain = M.SFTIndexedDatasetConfig(random_seed=1, sequence_length=SEQ, blend=([shards["plain"]], None),
                                      split="100,0,0", return_source_ids=True)
    with pytest.raises(ShardError, match="records each sequence's source"):
        builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [10, None, None], lambda: True, plain).build()


def test_bridge_batches_carry_each_runtime_positions_source(shards):
    ds = PackedSFTDataset(shards["mixed"], eos_id=999, return_source_ids=True)
    plain = PackedSFTDataset(shards["mixed"], eos_id=999)
    low = MMapIndexedDataset(shards["mixed"])
    rows = [3, 40, 77]
    batch = ds.collate_fn([ds[i] for i in rows])
    same = plain.collate_fn([plain[i] for i in rows])
    assert set(batch) == set(same) | {"source_ids"}
    for key in same:   # the sources change nothing else Bridge's collate returns
        a, b = batch[key], same[key]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), key
    for r, i in enumerate(rows):
        bounds = low[i].seq_boundaries
        runtime = np.repeat(np.asarray(low.source_ids(i), np.int64), np.diff(bounds) - 1)   # each drops its last
        got = batch["source_ids"][r].numpy()
        assert got[:runtime.size].tolist() == runtime.tolist() and (got[runtime.size:] == -1).all()
    with pytest.raises(ShardError, match="records each sequence's source"):
        PackedSFTDataset(shards["plain"], eos_id=999, return_source_ids=True)


def test_padding_free_batches_carry_each_positions_source(shards):
    ds = PaddingFreeDataset(shards["mixed"], return_source_ids=True)
    low = MMapIndexedDataset(shards["mixed"])
    batch = PaddingFreeCollator(pad_to_multiple_of=32)([ds[0], ds[5]])
    want = np.concatenate([expected_tokens(low, 0), expected_tokens(low, 5)])
    got = batch["source_ids"][0].numpy()
    assert got.shape == batch["input_ids"][0].shape and got[:want.size].tolist() == want.tolist()
    assert (got[want.size:] == -1).all() and ds.sources == ("chat", "math", "tools")
    with pytest.raises(ShardError, match="records each sequence's source"):
        PaddingFreeDataset(shards["plain"], return_source_ids=True)
