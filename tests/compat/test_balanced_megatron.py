"""A balanced order through the Megatron-LM door, against the installed megatron-core (every stack):

* ``preprocess-sft --balance-for`` writes ``P.order``; ``SFTIndexedDatasetConfig(pack_order_file="auto")``
  built by the real ``BlendedMegatronDatasetBuilder`` serves exactly ``order.sample_index`` (and, on
  a stack that ships ``megatron.training``, the real ``MegatronPretrainingSampler`` hands every DP
  rank exactly its planned packs: tests/compat/test_balanced_loaders.py);
* the order's CRC is in the dataset's unique identifiers (its cache files differ from the shuffle's
  and from another order's), and a cached index is served again;
* refusals, each naming what to change: a blend, a split that is not the whole data, another seed,
  an order of other packs, ``shuffle=False`` or a ``pack_order`` beside it; a topology mismatch warns.
"""

import os

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard
from support.token_inputs import tokens_input

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import CostModel, Order, Topology, TopologyMismatchWarning, plan_order, shard_pack_costs
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.training import megatron as M

DP, MBS, GBS, SEED = 4, 1, 16, 1234


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("balanced_mlm")
    prefix = str(root / "chat")
    summary = run(Config([tokens_input(root / "in.jsonl")], prefix, input_format="tokens", vocab_size=50, pad_id=0,
                         pack_size=256, balance_for=(DP, MBS, GBS), cost_model="1,1", balance_epochs=3,
                         progress=False))
    other = str(root / "other")
    write_shard(other, random_packs(np.random.default_rng(7), 40, pack_size=64))
    return {"prefix": prefix, "summary": summary, "other": other, "root": root}


@pytest.fixture(autouse=True)
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build(blend, sizes=(40, 0, 0), split="100,0,0", cache=None, **kw):
    options = dict(random_seed=SEED, sequence_length=256, blend=M.parse_data_path(blend), split=split,
                   path_to_cache=cache, tokenizer=None, pack_order_file="auto", data_parallel_size=DP,
                   micro_batch_size=MBS, global_batch_size=GBS)
    options.update(kw)
    cfg = M.SFTIndexedDatasetConfig(**options)
    return BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, list(sizes), lambda: True, cfg).build()


def test_preprocess_writes_the_order_and_the_builder_serves_it(data):
    prefix = data["prefix"]
    assert data["summary"]["orders"] == [prefix + ".order"]
    order = Order.load(prefix + ".order")
    assert (order.seed, order.epochs, order.topology) == (SEED, 3, Topology(DP, MBS, GBS))
    order.check_costs(shard_pack_costs(MMapIndexedDataset(prefix), order.cost_model))
    n = order.num_packs
    train, valid, test = build(prefix, sizes=(2 * n + 5, 0, 0))
    assert valid is None and test is None
    np.testing.assert_array_equal(np.asarray(train.sample_index), order.sample_index(2 * n + 5))
    packs = MMapIndexedDataset(prefix)
    for j in (0, 1, n - 1, n, 2 * n + 4):  # the samples are the planned packs, laid out as usual
        expected = M._layout_pack(packs[int(order.sample_index(2 * n + 5)[j])], 256, train.pad_token_id, prefix)
        assert all(np.array_equal(train[j][k].numpy(), expected[k].numpy()) for k in expected)
    # the balance is real: the order's predicted straggler overhead is below the shuffle's
    assert order.stats["balanced"]["mean"] < order.stats["shuffle"]["mean"]


def test_the_order_is_part_of_the_cache_identity(data, tmp_path):
    prefix = data["prefix"]
    cache = str(tmp_path / "cache")
    balanced = build(prefix, cache=cache)[0]
    shuffled = build(prefix, cache=cache, pack_order_file=None)[0]
    assert balanced.unique_identifiers["pack_order_file"] == Order.load(prefix + ".order").file_crc32
    assert balanced.unique_description_hash != shuffled.unique_description_hash
    assert not np.array_equal(np.asarray(balanced.sample_index), np.asarray(shuffled.sample_index))
    again = build(prefix, cache=cache)[0]   # from the cache files
    np.testing.assert_array_equal(np.asarray(again.sample_index), np.asarray(balanced.sample_index))
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith("-sample_index.npy")]) == 2
    # another order of the same data (another topology): other cache files
    costs = shard_pack_costs(MMapIndexedDataset(prefix), CostModel(1.0, 1.0))
    plan_order(costs, Topology(2, 1, 8), CostModel(1.0, 1.0), seed=SEED).save(str(tmp_path / "t2.order"))
    with pytest.warns(TopologyMismatchWarning):
        third = build(prefix, cache=cache, pack_order_file=str(tmp_path / "t2.order"))[0]
    assert third.unique_description_hash not in {balanced.unique_description_hash, shuffled.unique_description_hash}


def test_a_blend_is_refused(data):
    with pytest.raises(ShardError, match="train data_path is a blend"):
        build(f"0.5 {data['prefix']} 0.5 {data['prefix']}")


def test_a_split_that_is_not_the_whole_data_is_refused(data):
    with pytest.raises(ShardError, match="train split must be all of it") as info:
        build(data["prefix"], sizes=(40, 4, 0), split="90,10,0")
    assert "100,0,0" in str(info.value)


def test_another_seed_is_refused(data):
    with pytest.raises(ShardError, match="another data seed") as info:
        build(data["prefix"], random_seed=SEED + 1)
    assert info.value.field == "seed"


def test_an_order_of_other_packs_is_refused(data, tmp_path):
    costs = shard_pack_costs(MMapIndexedDataset(data["other"]), CostModel(1.0, 1.0))
    plan_order(costs, Topology(DP, MBS, GBS), CostModel(1.0, 1.0), seed=SEED).save(str(tmp_path / "x.order"))
    with pytest.raises(ShardError, match="different number of packs|planned for other data"):
        build(data["prefix"], pack_order_file=str(tmp_path / "x.order"))


def test_a_missing_order_file_and_a_second_order_are_refused(data):
    with pytest.raises(ShardError, match="no balanced order beside the data"):
        build(data["other"], sizes=(10, 0, 0), sequence_length=64)
    with pytest.raises(ShardError, match="replaces the shuffle"):
        build(data["prefix"], shuffle=False)


def test_a_topology_mismatch_warns_and_still_serves_the_order(data):
    with pytest.warns(TopologyMismatchWarning, match="balanced for DP 4"):
        train = build(data["prefix"], data_parallel_size=8, global_batch_size=32)[0]
    order = Order.load(data["prefix"] + ".order")
    np.testing.assert_array_equal(np.asarray(train.sample_index), order.sample_index(40))


def test_more_samples_than_the_order_holds_are_refused(data):
    n = Order.load(data["prefix"] + ".order").num_packs
    with pytest.raises(ShardError, match="need 4 epochs of the balanced order; it holds 3") as info:
        build(data["prefix"], sizes=(3 * n + 1, 0, 0))
    assert "--balance-epochs" in str(info.value)


def test_per_split_paths_balance_the_train_split_and_shuffle_the_validation_split(data):
    cfg = M.SFTIndexedDatasetConfig(random_seed=SEED, sequence_length=256, blend=None,
                                    blend_per_split=M.parse_per_split_data_path(data["prefix"], data["other"]),
                                    split=None, path_to_cache=None, tokenizer=None, pack_order_file="auto",
                                    data_parallel_size=DP, micro_batch_size=MBS, global_batch_size=GBS)
    train, valid, _ = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [40, 20, 0], lambda: True, cfg).build()
    np.testing.assert_array_equal(np.asarray(train.sample_index), Order.load(data["prefix"] + ".order").sample_index(40))
    n = len(MMapIndexedDataset(data["other"]))
    expected = np.random.RandomState(SEED).permutation(n)[:20]   # the ordinary shuffle, no order beside it needed
    np.testing.assert_array_equal(np.asarray(valid.sample_index), expected)
    assert "pack_order_file" not in valid.unique_identifiers
