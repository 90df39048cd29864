"""torch serving of planned batches: the order-applying dataset over the real adapters, and dynamic
micro-batches through a DataLoader, padded in each stack's layout (Megatron's checked against a
real megatron-core GPTDataset batch; Bridge's against Bridge's own collate in tests/compat)."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs
from megatron_sft_idx.batching.dynamic import plan_dynamic
from megatron_sft_idx.batching.layout import Topology
from megatron_sft_idx.batching.loaders import DynamicBatchSampler, DynamicCollator, OrderedDataset, SequenceDataset
from megatron_sft_idx.batching.order import TopologyMismatchWarning
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.training.bridge import PackedSFTDataset

TOPO = Topology(2, 1, 4)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("packs") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(0), 48, pack_size=64))
    return prefix


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    """A shard of one sequence per item, as a sequence store's partitions hold them."""
    prefix = str(tmp_path_factory.mktemp("seqs") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(1), 90, pack_size=64, max_seqs=1), pack_size=None)
    return prefix


def test_ordered_dataset_serves_the_planned_packs_through_the_bridge_adapter(shard):
    base = PackedSFTDataset(shard, eos_id=0)
    model = CostModel(1.0, 0.01)
    order = plan_order(shard_pack_costs(base.source, model), TOPO, model, seed=3, epochs=2)
    ds = OrderedDataset.from_order(base, order, 80, topology=TOPO)
    assert len(ds) == 80 and ds.collate_fn is base.collate_fn
    index = order.sample_index(80)
    for i in (0, 5, 47, 48, 79):
        np.testing.assert_array_equal(ds[i]["input_ids"], base[int(index[i])]["input_ids"])
    assert ds[-1]["loss_mask"].sum() == 0  # Bridge's padding sample, decided by the base
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=ds.collate_fn, num_workers=2)
    first = next(iter(loader))
    assert torch.equal(first["tokens"], base.collate_fn([base[int(index[0])], base[int(index[1])]])["tokens"])


def test_ordered_dataset_refuses_an_index_outside_the_base_and_warns_on_topology(shard):
    base = MMapIndexedDataset(shard)
    with pytest.raises(ShardError, match="points outside the dataset's 48 samples"):
        OrderedDataset(base, np.array([0, 48]))
    order = plan_order(np.ones(48), TOPO, CostModel(1.0, 0.0), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OrderedDataset.from_order(base, order, 48, topology=Topology(4, 1, 4))
    assert [w.category for w in caught] == [TopologyMismatchWarning]


def _loader(sequences, plan, rank, collator, consumed=0):
    return torch.utils.data.DataLoader(SequenceDataset(MMapIndexedDataset(sequences)),
                                       batch_sampler=DynamicBatchSampler(plan, rank, consumed), collate_fn=collator,
                                       num_workers=2)


def test_dynamic_megatron_batches_hold_the_planned_sequences(sequences):
    ds = MMapIndexedDataset(sequences)
    lengths = ds.sequence_lengths
    plan = plan_dynamic(lengths, global_batch_size=12, data_parallel_size=3, max_tokens_per_microbatch=128,
                        sequence_length_round=8, seed=2)
    for rank in range(3):
        planned = [(ids, w) for _, ids, w in plan.iter_rank(rank)]
        batches = list(_loader(sequences, plan, rank, DynamicCollator("megatron", pad_id=7)))
        assert len(batches) == len(planned) == len(DynamicBatchSampler(plan, rank))
        for batch, (ids, width) in zip(batches, planned):
            assert batch["tokens"].shape == (len(ids), width)
            for row, i in enumerate(ids):
                pack = ds[int(i)]
                n = pack.input_ids.shape[0]
                assert batch["tokens"][row, :n].tolist() == pack.input_ids.tolist()
                assert (batch["tokens"][row, n:] == 7).all() and (batch["labels"][row, n - 1:] == 7).all()
                assert batch["labels"][row, :n - 1].tolist() == pack.input_ids[1:].tolist()
                assert batch["loss_mask"][row, :n].tolist() == pack.loss_mask.astype(np.float32).tolist()
                assert batch["loss_mask"][row, n:].sum() == 0
            assert batch["position_ids"].tolist() == [list(range(width))] * len(ids)


def test_dynamic_bridge_batches_shift_inputs_and_masks(sequences):
    ds = MMapIndexedDataset(sequences)
    plan = plan_dynamic(ds.sequence_lengths, global_batch_size=10, data_parallel_size=2,
                        max_tokens_per_microbatch=256, seed=5)
    batch = next(iter(_loader(sequences, plan, 1, DynamicCollator("bridge", pad_id=3))))
    ids, width = plan.rank_microbatches(0, 1)[0]
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["loss_mask"].dtype == torch.int64 and batch["tokens"].shape == (len(ids), width)
    for row, i in enumerate(ids):
        pack = ds[int(i)]
        n = pack.input_ids.shape[0]
        assert batch["tokens"][row, :n - 1].tolist() == pack.input_ids[:-1].tolist()
        assert (batch["tokens"][row, n - 1:] == 3).all()
        assert batch["labels"][row, :n - 1].tolist() == pack.input_ids[1:].tolist()
        assert batch["loss_mask"][row, :n - 1].tolist() == pack.loss_mask[:-1].tolist()
    with_mask = DynamicCollator("bridge", get_attention_mask_from_fusion=False)([SequenceDataset(ds)[(0, 64)]])
    assert with_mask["attention_mask"].shape == (1, 1, 64, 64)


def test_dynamic_sampler_resumes_at_the_consumed_step(sequences):
    ds = MMapIndexedDataset(sequences)
    plan = plan_dynamic(ds.sequence_lengths, global_batch_size=10, data_parallel_size=2,
                        max_tokens_per_microbatch=256, seed=5)
    full = list(DynamicBatchSampler(plan, 0))
    resumed = list(DynamicBatchSampler(plan, 0, consumed_samples=30))
    skipped = int(plan.mb_offsets[3])
    assert resumed == full[skipped:] and len(resumed) == len(DynamicBatchSampler(plan, 0, 30))
    assert list(DynamicBatchSampler(plan, 0, consumed_samples=90 + 30, epoch_offset=90)) == resumed
    with pytest.raises(ShardError, match="not a step boundary"):
        DynamicBatchSampler(plan, 0, consumed_samples=15)
    with pytest.raises(ShardError, match="rank 2 is outside"):
        DynamicBatchSampler(plan, 2)


def test_megatron_keys_dtypes_and_mask_are_gpt_datasets():
    """Against a real megatron-core GPTDataset batch: same keys, dtypes, shapes and causal mask."""
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    tok = SimpleNamespace(eod=0, pad=-1, vocab_size=100, unique_identifiers={"class": "test"})
    cfg = gpt.GPTDatasetConfig(random_seed=1, sequence_length=16, split="1,0,0", tokenizer=tok,
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                               create_attention_mask=True)
    mock = BlendedMegatronDatasetBuilder(gpt.MockGPTDataset, [2, 0, 0], lambda: True, cfg).build()[0]
    theirs = torch.utils.data.default_collate([mock[0], mock[1]])
    sample = {"input_ids": np.arange(1, 11), "loss_mask": np.ones(10, dtype=np.uint8), "width": 16}
    ours = DynamicCollator("megatron", attention_mask=True)([sample, sample])
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert torch.equal(ours["position_ids"], theirs["position_ids"])
    assert set(DynamicCollator("megatron")([sample])) == set(theirs) - {"attention_mask"}


def test_a_sequence_wider_than_its_micro_batch_is_refused(sequences):
    ds = SequenceDataset(MMapIndexedDataset(sequences))
    n = ds[0]["input_ids"].shape[0]
    with pytest.raises(ShardError, match="more than its micro-batch width"):
        ds[(0, n - 1)]
    with pytest.raises(ShardError, match="unknown stack"):
        DynamicCollator("deepspeed")


def test_megatron_lm_dataset_unshuffled_then_ordered_serves_the_plan(shard):
    """The recipe of docs/BATCHING.md until the adapters take an order: SFTIndexedDataset built
    with shuffle=False over one shard (sample j is pack j), wrapped in OrderedDataset."""
    mc_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron_sft_idx.training import megatron as M

    config = M.SFTIndexedDatasetConfig(random_seed=1234, sequence_length=64, blend=([shard], None), split="100,0,0",
                                       shuffle=False)
    train = mc_builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [96, 0, 0], lambda: True, config).build()[0]
    model = CostModel(1.0, 0.01)
    order = plan_order(shard_pack_costs(MMapIndexedDataset(shard), model), TOPO, model, seed=1234, epochs=2)
    ds = OrderedDataset.from_order(train, order, len(train))
    index = order.sample_index(96)
    packs = MMapIndexedDataset(shard)
    for i in (0, 13, 47, 48, 95):
        n = packs[int(index[i])].input_ids.shape[0]
        assert ds[i]["tokens"][:n].tolist() == packs[int(index[i])].input_ids.tolist()
