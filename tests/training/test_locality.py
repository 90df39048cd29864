"""The block-local order: a permutation per epoch, grouped in windows of blocks, in both adapters."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.locality import BlockLocalOrder, BlockLocalSampler, block_local_permutation, pack_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=300), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_permutation_grouped_by_windows_of_blocks(blocks, window, seed):
    blocks = np.sort(np.array(blocks))  # packs are stored in block order
    perm = block_local_permutation(blocks, window, np.random.RandomState(seed))
    assert sorted(perm.tolist()) == list(range(len(blocks)))  # every pack exactly once
    seen = blocks[perm]
    # Windows are contiguous runs of the output holding `window` whole blocks each.
    order_of_blocks = list(dict.fromkeys(seen.tolist()))
    first_seen = {b: i for i, b in reversed(list(enumerate(seen.tolist())))}
    last_seen = {b: i for i, b in enumerate(seen.tolist())}
    for w in range(0, len(order_of_blocks), window):
        group = order_of_blocks[w:w + window]
        lo, hi = min(first_seen[b] for b in group), max(last_seen[b] for b in group)
        assert set(seen[lo:hi + 1].tolist()) == set(group)
    again = block_local_permutation(blocks, window, np.random.RandomState(seed))
    assert np.array_equal(perm, again)  # a function of the seed: same in every rank and restart


def test_window_one_block_at_a_time_and_large_window_is_a_full_shuffle_of_blocks():
    blocks = np.repeat(np.arange(10), 7)
    perm = block_local_permutation(blocks, 1, np.random.RandomState(0))
    runs = np.flatnonzero(np.diff(blocks[perm])) + 1
    assert len(runs) == 9  # ten blocks, each visited as one run
    wide = block_local_permutation(blocks, 10, np.random.RandomState(0))
    assert len(np.flatnonzero(np.diff(blocks[wide]))) > 30  # one window: packs interleave freely


def windows_hold(blocks, window) -> bool:
    """Every block's packs lie in a span of the order that touches at most ``window`` blocks."""
    blocks = list(blocks)
    for b in set(blocks):
        pos = [i for i, x in enumerate(blocks) if x == b]
        if len(set(blocks[pos[0]:pos[-1] + 1])) > window:
            return False
    return True


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("loc") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(3), 300, pack_size=256), pack_size=256)
    return prefix


def test_blocks_follow_the_bin_layout_and_shards(shard):
    ds = MMapIndexedDataset(shard)
    blocks = pack_blocks(ds, 4096)
    assert np.array_equal(blocks, ds.sequence_pointers // 4096)
    from megatron_sft_idx.multi import MultiShardDataset

    multi = MultiShardDataset.open([shard, shard])
    both = pack_blocks(multi, 4096)
    assert len(both) == 2 * len(ds) and both[len(ds)] == blocks.max() + 1  # per-shard blocks


def test_sampler_yields_each_pack_once_per_epoch(shard):
    ds = MMapIndexedDataset(shard)
    sampler = BlockLocalSampler(ds, window=2, seed=5, block_size=4096)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(first) == sorted(second) == list(range(len(ds))) and first != second


def test_bridge_adapter_takes_the_order(shard):
    pytest.importorskip("torch")
    from megatron_sft_idx.training.bridge import PackedSFTDataset

    order = BlockLocalOrder(window=2, block_size=4096)
    ds = PackedSFTDataset(shard, max_num_samples=750, seed=9, order=order)
    mapping = np.asarray(ds.samples_mapping)
    n = len(ds.source)
    for e in range(2):
        assert sorted(mapping[e * n:(e + 1) * n].tolist()) == list(range(n))  # epochs stay permutations
    blocks = order.blocks(ds.source)
    assert windows_hold(blocks[mapping[:n]], 2) and windows_hold(blocks[mapping[n:2 * n]], 2)
    assert not windows_hold(blocks[np.random.RandomState(0).permutation(n)], 2)
    full = PackedSFTDataset(shard, max_num_samples=750, seed=9)
    assert not np.array_equal(mapping, np.asarray(full.samples_mapping))


def test_megatron_adapter_takes_the_order(shard):
    pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_sft_idx.training import megatron as M

    def build(order):
        config = M.SFTIndexedDatasetConfig(random_seed=4, sequence_length=256, blend=([shard], None),
                                           split="100,0,0", pack_order=order)
        return BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [600, None, None], lambda: True,
                                             config).build()[0]

    local, full = build(BlockLocalOrder(window=2, block_size=4096)), build(None)
    index = np.asarray(local.sample_index)
    assert sorted(index[:300].tolist()) == list(range(300))
    assert "BlockLocalOrder" in local.unique_description and local.unique_description_hash != \
        full.unique_description_hash  # a different order is a different cached sample index
    assert windows_hold(pack_blocks(local.dataset, 4096)[index[:300]], 2)
