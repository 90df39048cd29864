"""The one sample order of the training adapters (batching/samples.py): epochs of the seeded
shuffle, a split's packs, a pack order, no shuffle, a balanced order; and every adapter serves it.
The adapters against the real megatron-core / Bridge stacks: tests/compat."""

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs
from megatron_sft_idx.batching.layout import Topology, base_permutation
from megatron_sft_idx.batching.samples import sample_index
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.locality import BlockLocalOrder
from megatron_sft_idx.reader import MMapIndexedDataset

MODEL = CostModel(1.0, 1.0)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("samples") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(5), 40, pack_size=64))
    return prefix


def planned(source, seed, epochs=2):
    return plan_order(shard_pack_costs(source, MODEL), Topology(2, 2, 8), MODEL, seed=seed, epochs=epochs)


def test_epochs_of_the_seeded_shuffle_cut_to_length():
    index = sample_index(250, 97, seed=1234)
    expected = np.concatenate([base_permutation(97, 1234, e) for e in range(3)])[:250]
    np.testing.assert_array_equal(index, expected)
    assert index.dtype == np.int32 and not index.flags.writeable
    assert not np.array_equal(index, sample_index(250, 97, seed=1235))


def test_a_splits_packs_are_permuted_as_they_are_given():
    packs = np.arange(10, 60, 2, dtype=np.int64)   # (a split: the packs it holds, not 0..n-1)
    index = sample_index(60, packs, seed=3)
    rng = np.random.RandomState(3)
    expected = np.concatenate([rng.permutation(packs) for _ in range(3)])[:60]
    np.testing.assert_array_equal(index, expected)
    assert sorted(index[:25]) == packs.tolist()
    np.testing.assert_array_equal(sample_index(60, packs, seed=3, shuffle=False), np.tile(packs, 3)[:60])


def test_a_pack_order_draws_each_epoch_from_the_same_stream():
    calls = []

    def reverse_then_shuffle(source, packs, rng):
        calls.append((source, packs.tolist()))
        return rng.permutation(packs[::-1])

    index = sample_index(25, 10, seed=8, order=reverse_then_shuffle, source="src")
    rng = np.random.RandomState(8)
    np.testing.assert_array_equal(index, np.concatenate([rng.permutation(np.arange(10)[::-1]) for _ in range(3)])[:25])
    assert calls == [("src", list(range(10)))] * 3


def test_a_block_local_order_over_a_shard(shard):
    source = MMapIndexedDataset(shard)
    order = BlockLocalOrder(window=2, block_size=256)
    index = sample_index(100, len(source), seed=4, order=order, source=source)
    rng = np.random.RandomState(4)
    expected = np.concatenate([order(source, np.arange(40), rng) for _ in range(3)])[:100]
    np.testing.assert_array_equal(index, expected)


def test_a_balanced_order_serves_its_positions(shard):
    source = MMapIndexedDataset(shard)
    order = planned(source, seed=9)
    index = sample_index(70, 40, seed=9, balanced=order)
    np.testing.assert_array_equal(index, order.sample_index(70))
    assert not index.flags.writeable
    with pytest.raises(ShardError, match="81 samples need 3 epochs of the balanced order; it holds 2") as info:
        sample_index(81, 40, seed=9, balanced=order, path="/d/s", field="pack_order_file")
    assert (info.value.path, info.value.field) == ("/d/s", "pack_order_file")
    with pytest.raises(ShardError, match="replaces the shuffle"):
        sample_index(10, 40, seed=9, balanced=order, order=BlockLocalOrder())
    with pytest.raises(ShardError, match="replaces the shuffle"):
        sample_index(10, 40, seed=9, balanced=order, shuffle=False)
    with pytest.raises(ShardError, match="another number of packs"):
        sample_index(10, 41, seed=9, balanced=order)


def test_no_samples_and_refused_counts():
    assert sample_index(0, 0, seed=1).shape == (0,) and sample_index(0, 5, seed=1).shape == (0,)
    with pytest.raises(ShardError, match="needs packs"):
        sample_index(1, 0, seed=1)
    with pytest.raises(ShardError, match="non-negative") as info:
        sample_index(-1, 5, seed=1)
    assert info.value.field == "max_num_samples"


def test_large_pack_indices_are_int64():
    packs = np.array([0, 2**31], dtype=np.int64)
    index = sample_index(4, packs, seed=0)
    assert index.dtype == np.int64 and sorted(index.tolist()) == [0, 0, 2**31, 2**31]


def test_bridge_and_trl_serve_the_one_order(shard, tmp_path):
    pytest.importorskip("torch")
    from megatron_sft_idx.training.bridge import PackedSFTDataset
    from megatron_sft_idx.training.hf import PaddingFreeDataset

    for make in (PackedSFTDataset, PaddingFreeDataset):
        np.testing.assert_array_equal(make(shard, max_num_samples=90, seed=6).samples_mapping,
                                      sample_index(90, 40, seed=6))
    order = planned(MMapIndexedDataset(shard), seed=6)
    path = str(tmp_path / "s.order")
    order.save(path)
    for make in (PackedSFTDataset, PaddingFreeDataset):
        ds = make(shard, balanced_order=path, seed=6)
        np.testing.assert_array_equal(ds.samples_mapping, order.sample_index(40))
    with pytest.raises(ShardError, match="replaces the shuffle") as info:
        PackedSFTDataset(shard, balanced_order=path, seed=6, max_num_samples=10, order=BlockLocalOrder())
    assert info.value.field == "balanced_order"
