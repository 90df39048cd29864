"""Bridge 0.7's global-batch packing samples (megatron_sft_idx/training/global_batch.py).

The contract comes from Bridge's documentation only (docs/TRAINING.md "Global-batch packing");
its consumer, Megatron-Core's sequence-packing scheduler, is code: its CPU steps ran on these
samples at Megatron-LM ``d98e8a64`` and what they returned is tests/golden/bridge_global_batch/
(tests/compat/make_bridge_global_batch_golden.py regenerates it). Here the samples are built
again from the same store (their digest checked first, so a changed producer is told apart from
a changed scheduler) and the scheduler's bins compared with them element by element.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from megatron_sft_idx.errors import ShardError  # noqa: E402
from megatron_sft_idx.packing import pad_multiple_for  # noqa: E402
from megatron_sft_idx.preprocess.sequences import StoreSequences  # noqa: E402
from megatron_sft_idx.reader import MMapIndexedDataset  # noqa: E402
from megatron_sft_idx.training.collate import PackedCollator  # noqa: E402
from megatron_sft_idx.training.global_batch import (REQUIRED_SAMPLE_KEYS, GlobalBatchSequences,  # noqa: E402
                                                    collate_samples, unpacked_sample)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the generator by its path: tests/compat/ stays off sys.path (tests/training/test_compat_stacks.py says why)
_spec = importlib.util.spec_from_file_location("make_bridge_global_batch_golden",
                                               os.path.join(HERE, "compat", "make_bridge_global_batch_golden.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return gen.build_inputs(str(tmp_path_factory.mktemp("gb")))["store"]


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(gen.GOLDEN, "golden.json")) as f:
        doc = json.load(f)
    return doc, np.load(os.path.join(gen.GOLDEN, "arrays.npz"))


def test_a_sample_has_the_documented_keys_dtypes_and_shapes():
    s = unpacked_sample(np.arange(10, 17), np.array([0, 0, 1, 1, 1, 0, 0]), pad_to_multiple_of=4, pad_id=3)
    assert tuple(s) == REQUIRED_SAMPLE_KEYS
    for key in ("tokens", "labels", "position_ids"):
        assert s[key].dtype == torch.int64 and tuple(s[key].shape) == (8,)
    assert s["loss_mask"].dtype == torch.float32 and tuple(s["loss_mask"].shape) == (8,)
    for key in ("original_seq_len", "padded_seq_len"):
        assert s[key].dtype == torch.int32 and tuple(s[key].shape) == (1,)
    assert s["tokens"].tolist() == [10, 11, 12, 13, 14, 15, 3, 3]
    assert s["labels"].tolist() == [11, 12, 13, 14, 15, 16, 3, 3]
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0] and s["position_ids"].tolist() == list(range(8))
    assert (int(s["original_seq_len"]), int(s["padded_seq_len"])) == (6, 8)
    folded = unpacked_sample(np.arange(10, 17), np.zeros(7), pad_to_multiple_of=4, fold_alignment_padding=True)
    assert int(folded["original_seq_len"]) == int(folded["padded_seq_len"]) == 8
    with pytest.raises(ShardError, match="at least 2 tokens"):
        unpacked_sample([5], [0])
    with pytest.raises(ShardError, match="pad_to_multiple_of"):
        unpacked_sample([5, 6], [0, 0], pad_to_multiple_of=0)


def test_store_and_shard_give_bridges_runtime_view_of_each_sequence(store, tmp_path):
    """Each sample is the sequence's segment of the Bridge batch our collate builds (tested against
    Bridge's own collate): tokens, labels, loss and positions; from the store and from shards of it."""
    seqs = StoreSequences(store)
    ds = GlobalBatchSequences(seqs, pad_to_multiple_of=pad_multiple_for(cp=2), pad_id=0)
    collate = PackedCollator(4096, eos_id=0, bridge_semantics="next")
    for g in range(len(ds)):
        item = seqs[g]
        row = collate([{"input_ids": item.input_ids, "loss_mask": item.loss_mask,
                        "seq_boundaries": np.array([0, item.input_ids.shape[0]])}])
        s, n = ds[g], int(ds[g]["original_seq_len"])
        assert n == item.input_ids.shape[0] - 1 and int(s["padded_seq_len"]) % 4 == 0
        for key in ("tokens", "labels", "position_ids"):
            assert torch.equal(s[key][:n], row[key][0, :n])
        assert torch.equal(s["loss_mask"][:n], row["loss_mask"][0, :n].float())
        assert not s["loss_mask"][n:].any()
    shard_dir = os.path.dirname(store)
    prefixes = sorted(os.path.join(shard_dir, "out", f[:-4]) for f in os.listdir(os.path.join(shard_dir, "out"))
                      if f.endswith(".idx") and not f.endswith(".seq.idx"))
    shard = GlobalBatchSequences(MMapIndexedDataset(prefixes[0]), pad_to_multiple_of=4)
    by_tokens = {ds[g]["tokens"].numpy().tobytes(): g for g in range(len(ds))}
    assert len(shard) == len(ds) and len(prefixes) == 1
    for i in range(len(shard)):   # the shard's packs hold the store's sequences in another order
        g = by_tokens[shard[i]["tokens"].numpy().tobytes()]
        assert all(torch.equal(shard[i][k], ds[g][k]) for k in REQUIRED_SAMPLE_KEYS)
    assert collate_samples([ds[0], ds[1]])[1] is not None
    with pytest.raises(ShardError, match="sequence store"):
        GlobalBatchSequences([1, 2, 3])


def test_the_golden_names_the_scheduler_it_ran(golden):
    doc, _ = golden
    assert doc["megatron_lm_commit"] == COMMIT
    assert sorted(doc["files_sha256"]) == sorted(gen.SCHEDULER_FILES)
    assert tuple(doc["required_keys"]) == REQUIRED_SAMPLE_KEYS   # its DpBalancedScheduler's, as Bridge's docs list


@pytest.mark.parametrize("cell", [c[0] for c in gen.CELLS])
def test_megatron_cores_scheduler_packs_our_samples_unchanged(golden, store, cell):
    """Its bins hold every sample once, in its order, element for element; its boundaries are our
    lengths (``cu_seqlens`` the original, ``cu_seqlens_padded`` the padded); its padding mask is
    exactly our alignment padding, where it zeroes the positions (ours run on: the one value it
    changes) and nothing else; folded samples carry no padding between sequences."""
    doc, arrays = golden
    c = next(c for c in doc["cells"] if c["name"] == cell)
    name, cp, mult, fold = next(x for x in gen.CELLS if x[0] == cell)
    samples = gen.cell_samples(store, mult, fold)
    assert gen.samples_digest(samples) == c["samples_sha256"], "our samples changed: regenerate the golden"
    assert c["cp_ranks_share_bins"] is True
    ids = [g for m in c["groups"] for r in range(0, cp * gen.DP_SIZE, cp) for g in m[r]]
    assert sorted(ids) == list(range(len(samples)))   # each sample in one bin of one DP rank
    pad_positions = 0
    for m, ranks in enumerate(c["groups"]):
        for r in range(0, cp * gen.DP_SIZE, cp):
            members = [samples[g] for g in ranks[r]]
            stem = f"{cell}_r{r}_m{m}"
            orig = [int(s["original_seq_len"]) for s in members]
            padded = [int(s["padded_seq_len"]) for s in members]
            assert arrays[f"{stem}_cu_seqlens"].tolist() == np.cumsum([0] + orig).tolist()
            assert arrays[f"{stem}_cu_seqlens_padded"].tolist() == np.cumsum([0] + padded).tolist()
            assert arrays[f"{stem}_max_seqlen"].tolist() == [max(padded)]
            pad = np.concatenate([np.arange(p) >= o for o, p in zip(orig, padded)])
            assert np.array_equal(arrays[f"{stem}_padding_mask"], pad)
            pad_positions += int(pad.sum())
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                ours = torch.cat([s[key] for s in members]).numpy()
                if key == "position_ids":
                    ours = np.where(pad, 0, ours)
                assert np.array_equal(arrays[f"{stem}_{key}"], ours), (stem, key)
    sanitized = c["sanitized"]   # values its batch step replaced: our padding's positions, nothing else
    assert sanitized == {"tokens": 0, "labels": 0, "loss_mask": 0, "position_ids": pad_positions}
    assert (pad_positions == 0) == (fold or mult == 1)
