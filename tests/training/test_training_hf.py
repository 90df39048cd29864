"""TRL / transformers padding-free batches from packed shards, against the installed packages.

The reference batches are built by TRL 1.16's ``DataCollatorForLanguageModeling(padding_free=True)``
and transformers' ``DataCollatorWithFlattening`` over the same sequences: once from our rows
(TRL's packed-row input, ``seq_lengths``) and once from each sequence as its own example, with
labels written from the stored mask by an independent per-position loop.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.batching import Topology
from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs
from megatron_sft_idx.batching.layout import where
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.training.hf import (IGNORE_INDEX, PaddingFreeCollator, PaddingFreeDataset,
                                          check_training_args, flatten_sequences)

trl_sft = pytest.importorskip("trl.trainer.sft_trainer", reason="trl is in the test extra")
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments  # noqa: E402
import transformers  # noqa: E402

PAD = 0
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_the_transformers_under_test_is_the_one_asked_for():
    """Under tests/training/test_compat_transformers.py: the stack's version, from its directory."""
    asked = os.environ.get("MEGATRON_SFT_IDX_TRANSFORMERS")
    if asked is None:   # the environment's own (.ci/constraints.txt): whatever it is
        return
    version, path = asked.split("@", 1)
    assert transformers.__version__ == version
    assert os.path.realpath(transformers.__file__).startswith(os.path.realpath(path) + os.sep)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("hf") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(31), 40, pack_size=64))
    return prefix


def reference_sequences(source, packs, answer_only_loss=True):
    """Each stored sequence as ``{"input_ids", "labels"}``, labels written position by position."""
    out = []
    for i in packs:
        pack = source[int(i)]
        ids, loss, bounds = pack.input_ids, pack.loss_mask, pack.seq_boundaries
        for a, b in zip(bounds[:-1], bounds[1:]):
            labels = []
            for j in range(a, b):
                trained = j > a and (not answer_only_loss or loss[j - 1] == 1)
                labels.append(int(ids[j]) if trained else IGNORE_INDEX)
            out.append({"input_ids": [int(t) for t in ids[a:b]], "labels": labels})
    return out


def assert_batches_equal(ours, ref):
    assert set(ours) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert ours[key].shape == value.shape, key
            assert torch.equal(ours[key], value), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
@pytest.mark.parametrize("answer_only_loss", [True, False])
def test_batches_equal_trls_padding_free_collator(shard, batch_size, pad_to_multiple_of, answer_only_loss):
    ds = PaddingFreeDataset(shard, answer_only_loss=answer_only_loss)
    ours = PaddingFreeCollator(PAD, pad_to_multiple_of)
    trl = trl_sft.DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True,
                                                 pad_to_multiple_of=pad_to_multiple_of)
    for start in range(0, len(ds), batch_size):
        packs = range(start, min(start + batch_size, len(ds)))
        rows = [ds[i] for i in packs]
        expected = trl(reference_sequences(ds.source, packs, answer_only_loss))
        assert_batches_equal(ours(rows), expected)  # over the same sequences, one example each
        assert_batches_equal(ours(rows), trl(rows))  # TRL's packed-row input: our rows as they are


@pytest.mark.parametrize("batch_size", [1, 5])
def test_batches_equal_transformers_flattening_collator(shard, batch_size):
    ds = PaddingFreeDataset(shard)
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    for start in range(0, len(ds), batch_size):
        packs = range(start, min(start + batch_size, len(ds)))
        rows = [ds[i] for i in packs]
        expected = flat(reference_sequences(ds.source, packs))
        assert_batches_equal(PaddingFreeCollator()(rows), expected)
        assert_batches_equal(PaddingFreeCollator()(flatten_sequences(rows)), expected)


def test_rows_without_seq_lengths_use_position_ids(shard):
    """A transformers Trainer drops ``seq_lengths`` (not a model argument) but keeps ``position_ids``."""
    ds = PaddingFreeDataset(shard)
    rows = [ds[i] for i in range(6)]
    stripped = [{k: v for k, v in r.items() if k != "seq_lengths"} for r in rows]
    assert_batches_equal(PaddingFreeCollator()(stripped), PaddingFreeCollator()(rows))


def test_a_transformers_trainer_feeds_the_model_our_batches(shard, tmp_path):
    model = tiny_llama()
    ds = PaddingFreeDataset(shard)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, train_sampling_strategy="sequential",
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=PaddingFreeCollator())
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == -(-len(ds) // 4)
    for k, batch in enumerate(batches):
        rows = [ds[i] for i in range(4 * k, min(4 * k + 4, len(ds)))]
        assert_batches_equal({key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in batch.items()},
                             PaddingFreeCollator()(rows))


def tiny_llama(vocab=1000):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_trls_sft_trainer_feeds_the_model_our_batches(shard, tmp_path):
    """SFTTrainer(padding_free=True) over ``as_iterable_dataset()``: its own collator, our rows."""
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(EXAMPLES / "tokenizer"))
    ds = PaddingFreeDataset(shard, max_num_samples=30, seed=5)
    config = SFTConfig(str(tmp_path), padding_free=True, max_length=None, per_device_train_batch_size=4,
                       dataset_kwargs={"skip_prepare_dataset": True}, report_to=[], use_cpu=True, max_steps=2)
    trainer = SFTTrainer(model=tiny_llama(len(tokenizer)), args=config, train_dataset=ds.as_iterable_dataset(),
                         processing_class=tokenizer)
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == -(-30 // 4)
    collate = PaddingFreeCollator(tokenizer.pad_token_id)
    for k, batch in enumerate(batches):
        rows = [ds[i] for i in range(4 * k, min(4 * k + 4, 30))]
        assert_batches_equal({key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in batch.items()},
                             collate(rows))


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("trainer", ["trl", "transformers"])
def test_the_example_trains_a_tiny_model(shard, tmp_path, trainer):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "trl_sft.py"), "--train", shard, "--trainer", trainer,
                           "--steps", "3", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("trained 3 steps on 6 packs (their first 1024 tokens); loss per step: "), last
    losses = [float(x) for x in last.split(": ")[1].split(", ")]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_an_s3_shard_serves_the_same_rows(shard, bucket):
    from megatron_sft_idx.publishing import upload_shard

    upload_shard(shard, f"s3://{bucket}/sft/train_000")
    remote, local = PaddingFreeDataset(f"s3://{bucket}/sft/train_000"), PaddingFreeDataset(shard)
    assert len(remote) == len(local)
    collate = PaddingFreeCollator()
    for start in range(0, len(local), 7):
        idx = range(start, min(start + 7, len(local)))
        assert_batches_equal(collate([remote[i] for i in idx]), collate([local[i] for i in idx]))


def test_a_balanced_order_reaches_each_rank_as_planned(shard, tmp_path):
    """Sequential sampling of the order, sharded by accelerate's ``BatchSamplerShard`` (what the
    Trainer's dataloader does on W ranks), gives each rank Megatron's slice of every step."""
    from accelerate.data_loader import BatchSamplerShard

    dp, mbs, gbs, seed = 2, 2, 8, 7
    topology = Topology(dp, mbs, gbs)
    model = CostModel(1.0, 1.0)
    order = plan_order(shard_pack_costs(open_packed(shard), model), topology, model, seed=seed, epochs=2)
    path = str(tmp_path / "s.order")
    order.save(path)
    ds = PaddingFreeDataset(shard, balanced_order=path, seed=seed, max_num_samples=64)
    assert ds.ordered and len(ds) == 64
    mapping = order.sample_index(64)
    base = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), mbs, drop_last=False)
    for rank in range(dp):
        got = [i for batch in BatchSamplerShard(base, num_processes=dp, process_index=rank) for i in batch]
        step, micro, r, slot = where(np.array(got), topology)
        assert (r == rank).all()
        assert np.array_equal(np.sort(got), np.flatnonzero(where(np.arange(64), topology)[2] == rank))
        rows = [ds[i] for i in got]
        for g, row in zip(got, rows):
            assert np.array_equal(row["input_ids"], ds.source[int(mapping[g])].input_ids)

    with pytest.raises(ShardError, match="another data seed"):
        PaddingFreeDataset(shard, balanced_order=path, seed=seed + 1)
    args = TrainingArguments(str(tmp_path / "o"), per_device_train_batch_size=mbs, report_to=[], use_cpu=True)
    with pytest.raises(ShardError, match="train_sampling_strategy"):
        check_training_args(ds, args)
    args.train_sampling_strategy = "sequential"
    with pytest.warns(UserWarning, match="balanced for"):
        check_training_args(ds, args)  # one CPU process is not the planned 2-rank topology


def test_bad_batches_are_refused():
    collate = PaddingFreeCollator()
    with pytest.raises(ShardError, match="empty batch"):
        collate([{"input_ids": []}])
    with pytest.raises(ShardError, match="do not add up"):
        collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "seq_lengths": [2, 2]}])
    with pytest.raises(ShardError, match="differ in length"):
        collate([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ShardError, match="pad_to_multiple_of"):
        PaddingFreeCollator(0, 0)


def test_the_example_cuts_rows_to_max_length_whole_sequences_first(shard):
    """Issue 44 item 5: ``examples/trl_sft.py --max-length N`` trains each pack's first N tokens;
    the cut row is a prefix of the whole one, its sequences the ones that end within N then the
    start of the one cut, and TRL's padding-free collator takes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_sft_example", EXAMPLES / "trl_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    whole = PaddingFreeDataset(shard)
    cut = example.Cut(whole, 24)
    collate = trl_sft.DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, return_position_ids=True)
    cut_any = False
    for i in range(len(whole)):
        a, b = whole[i], cut[i]
        n = min(24, len(a["input_ids"]))
        cut_any |= len(a["input_ids"]) > 24
        for key in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(np.asarray(b[key]), np.asarray(a[key])[:n]), key
        assert sum(b["seq_lengths"]) == n and b["seq_lengths"][:-1] == a["seq_lengths"][:len(b["seq_lengths"]) - 1]
        starts = np.repeat(np.cumsum([0] + b["seq_lengths"][:-1]), b["seq_lengths"])
        assert np.array_equal(np.asarray(b["position_ids"]), np.arange(n) - starts)
    assert cut_any
    batch = collate([{k: cut[i][k] for k in ("input_ids", "labels", "position_ids")} for i in range(3)])
    assert batch["input_ids"].shape == (1, sum(min(24, len(whole[i]["input_ids"])) for i in range(3)))
