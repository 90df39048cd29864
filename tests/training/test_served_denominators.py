"""The adapters hand every sample and batch its step's global trained-token count from a balanced
order's record, under their consumer's rule, and refuse a pack whose mask says otherwise.
(Megatron-LM's dataset: tests/compat/test_loss_rules.py; the trainers' own losses with it:
tests/training/test_step_denominators.py.)"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from megatron_sft_idx import MMapIndexedDataset  # noqa: E402
from megatron_sft_idx.batching.balance import plan_order  # noqa: E402
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs  # noqa: E402
from megatron_sft_idx.batching.denominators import STEP_TOKENS_KEY, DenominatorWarning  # noqa: E402
from megatron_sft_idx.batching.layout import Topology  # noqa: E402
from megatron_sft_idx.batching.trained import trained_counts  # noqa: E402
from megatron_sft_idx.errors import ShardError  # noqa: E402
from megatron_sft_idx.training.bridge import PackedSFTDataset  # noqa: E402
from megatron_sft_idx.training.hf import PaddingFreeCollator, PaddingFreeDataset  # noqa: E402
from tests.support.shardgen import random_packs, write_shard  # noqa: E402

EOS = 5
TOPO = Topology(2, 2, 8)
MODEL = CostModel.from_preset("llama3-8b")


def make_packs(seed=2):
    return random_packs(np.random.default_rng(seed), 36, vocab=12)


@pytest.fixture
def data(tmp_path):
    prefix = str(tmp_path / "d")
    packs = make_packs()
    write_shard(prefix, packs)
    ds = MMapIndexedDataset(prefix)
    order = plan_order(shard_pack_costs(ds, MODEL), TOPO, MODEL, seed=4, epochs=2,
                       trained=trained_counts(ds, eos_id=EOS))
    path = str(tmp_path / "d.order")
    order.save(path)
    return prefix, packs, order, path


def step_counts(packs, order, without_eos=False):
    """Per served position: the trained positions of its step, summed over its packs by a loop."""
    def count(p):
        ids, loss, starts = p
        last = set(int(x) for x in np.append(starts[1:], len(ids)) - 1)
        return sum(1 for j in range(len(ids)) if loss[j] and j not in last and not (without_eos and ids[j] == EOS))
    index = order.sample_index(order.epochs * order.num_packs)
    per_step = [sum(count(packs[p]) for p in index[s:s + 8]) for s in range(0, len(index), 8)]
    return [per_step[i // 8] for i in range(len(index))]


def test_trl_rows_and_batches_carry_their_steps_count(data):
    prefix, packs, order, path = data
    ds = PaddingFreeDataset(prefix, balanced_order=path, seed=4, max_num_samples=72)
    want = step_counts(packs, order)
    assert [ds[i][STEP_TOKENS_KEY] for i in range(72)] == want
    batch = PaddingFreeCollator()([ds[4], ds[5]])
    assert batch[STEP_TOKENS_KEY].dtype == torch.int64 and int(batch[STEP_TOKENS_KEY]) == want[4]
    # what transformers counts as num_items_in_batch over the step's rows (labels[..., 1:] != -100)
    rows = [PaddingFreeCollator()([ds[i]]) for i in range(8, 16)]
    assert sum(int((r["labels"][..., 1:] != -100).sum()) for r in rows) == want[8]


@pytest.mark.parametrize("semantics, without_eos", [("0.6", True), ("next", False)])
def test_bridge_items_and_batches_carry_their_bridges_count(data, semantics, without_eos):
    prefix, packs, order, path = data
    ds = PackedSFTDataset(prefix, balanced_order=path, seed=4, eos_id=EOS, bridge_semantics=semantics,
                          max_num_samples=72)
    want = step_counts(packs, order, without_eos=without_eos)
    assert [ds[i][STEP_TOKENS_KEY] for i in range(72)] == want
    batch = ds.collate_fn([ds[16], ds[17]])
    assert int(batch[STEP_TOKENS_KEY]) == want[16]
    if semantics == "0.6":   # the count is what this Bridge's collate trains over the step
        total = sum(int(ds.collate_fn([ds[i]])["loss_mask"].sum()) for i in range(16, 24))
        assert total == want[16]
    assert ds[-1][STEP_TOKENS_KEY] == 0   # a padding sample trains nothing


def test_a_run_with_another_global_batch_gets_its_own_steps_counts(data):
    prefix, packs, order, path = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = PaddingFreeDataset(prefix, balanced_order=path, seed=4, topology=Topology(2, 2, 16))
    per_pack = order.trained.pack("stored")[order.sample_index(36)]
    assert [ds[i][STEP_TOKENS_KEY] for i in (0, 15, 16, 35)] == [per_pack[:16].sum()] * 2 + [per_pack[16:32].sum(),
                                                                                              per_pack[32:].sum()]


def test_a_pack_whose_mask_changed_since_planning_is_refused(data, tmp_path):
    prefix, packs, order, path = data
    changed = list(packs)
    ids, loss, starts = changed[9]
    flip = next(j for j in range(len(ids) - 1) if j + 1 not in set(starts.tolist()) and loss[j] == 0)
    loss = loss.copy()
    loss[flip] = 1   # the same index (costs), one more trained position
    changed[9] = (ids, loss, starts)
    other = str(tmp_path / "o")
    write_shard(other, changed)
    for make in (PaddingFreeDataset, lambda *a, **k: PackedSFTDataset(*a, eos_id=EOS, **k)):
        ds = make(other, balanced_order=path, seed=4)
        at = int(np.flatnonzero(ds.samples_mapping == 9)[0])
        ds[at - 1 if at else at + 1]   # other packs are served
        with pytest.raises(ShardError, match="pack 9 trains") as err:
            ds[at]
        assert err.value.pack == 9 and "re-plan the order" in err.value.hint


def test_no_count_is_served_where_the_order_records_none_for_the_consumer(data, tmp_path):
    prefix, packs, order, path = data
    with pytest.warns(DenominatorWarning, match="trains positions no recorded rule counts"):
        ds = PackedSFTDataset(prefix, balanced_order=path, seed=4, eos_id=EOS, answer_only_loss=False,
                              bridge_semantics="next")
    assert STEP_TOKENS_KEY not in ds[0] and STEP_TOKENS_KEY not in ds.collate_fn([ds[0]])
    bare = plan_order(order.costs, TOPO, MODEL, seed=4)
    bare.save(str(tmp_path / "bare.order"))
    with pytest.warns(DenominatorWarning, match="planned without counts"):
        ds = PaddingFreeDataset(prefix, balanced_order=str(tmp_path / "bare.order"), seed=4)
    assert STEP_TOKENS_KEY not in ds[0] and STEP_TOKENS_KEY not in PaddingFreeCollator()([ds[0]])
    stored_only = plan_order(order.costs, TOPO, MODEL, seed=4, trained=trained_counts(MMapIndexedDataset(prefix)))
    with pytest.warns(DenominatorWarning, match="no 'bridge-0.6' counts"):
        PackedSFTDataset(prefix, balanced_order=stored_only, seed=4, eos_id=EOS, bridge_semantics="0.6")
    with pytest.raises(ShardError, match="another EOS id") as err:
        PackedSFTDataset(prefix, balanced_order=path, seed=4, eos_id=EOS + 1, bridge_semantics="0.6")
    assert err.value.field == "trained.eos_id"
