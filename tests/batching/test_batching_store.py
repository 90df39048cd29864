"""Dynamic batching planned from a real sequence store (``preprocess-sft --store``): the store's own
reader verifies the partitions and gives the lengths without tokens; ``plan-batches --dynamic``
plans from the store or from a shard of one-sequence packs; a packed shard is refused."""

import json
import os
import pickle
import random
import re

import numpy as np
import pytest

from megatron_sft_idx.batching import DynamicBatchSampler, DynamicCollator, SequenceDataset, plan_dynamic
from megatron_sft_idx.tools.plan_batches_cli import main as plan_batches
from megatron_sft_idx.preprocess.sequences import StoreSequences, sequence_lengths
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.multi import MultiShardDataset
from megatron_sft_idx.preprocess.cli import main as preprocess
from megatron_sft_idx.reader import MMapIndexedDataset


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    rows = []
    r = random.Random(11)
    with open(root / "in.jsonl", "w") as f:
        for _ in range(240):
            n = r.choice([6, 12, 40, 90, 180])
            ids = [1] + [r.randrange(3, 49) for _ in range(n - 2)] + [2]
            rows.append(ids)
            f.write(json.dumps({"input_ids": ids, "answer_start_idx": n // 2}) + "\n")
    assert preprocess(["--input", str(root / "in.jsonl"), "--input-format", "tokens", "--vocab-size", "50",
                       "--pad-id", "0", "--pack-size", "256", "--output-prefix", str(root / "packed"), "--store",
                       str(root / "store"), "--partition-bytes", "4K", "--quiet"]) == 0
    return {"root": root, "rows": rows, "store": str(root / "store"), "packed": str(root / "packed")}


def test_the_store_gives_every_sequence_and_its_length_in_input_order(built):
    seqs = StoreSequences(built["store"])
    assert len(seqs.store.partitions) > 1   # several partitions: ids run across them
    assert len(seqs) == len(built["rows"])
    np.testing.assert_array_equal(seqs.lengths, [len(ids) for ids in built["rows"]])
    for g in (0, 1, len(seqs) // 2, len(seqs) - 1):
        assert seqs[g].input_ids.tolist() == built["rows"][g]
    np.testing.assert_array_equal(sequence_lengths(seqs), seqs.lengths)
    copy = pickle.loads(pickle.dumps(seqs))
    assert copy[5].input_ids.tolist() == built["rows"][5]
    with pytest.raises(ShardError, match="outside the store"):
        seqs[len(seqs)]


def test_a_changed_partition_is_refused_before_any_length_is_used(built, tmp_path):
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(built["store"], store)
    path = os.path.join(store, "parts", "part_000001.bin")
    data = bytearray(open(path, "rb").read())
    data[3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardError) as info:
        StoreSequences(store)
    assert "part_000001" in str(info.value)


def test_dynamic_batches_from_the_store_serve_each_step_once_with_the_stored_tokens(built):
    seqs = StoreSequences(built["store"])
    plan = plan_dynamic(seqs.lengths, global_batch_size=24, data_parallel_size=2, max_tokens_per_microbatch=512,
                        sequence_length_round=16, seed=3)
    dataset, collate = SequenceDataset(seqs), DynamicCollator("megatron")
    served = []
    for rank in range(2):
        for batch in DynamicBatchSampler(plan, rank):
            out = collate([dataset[key] for key in batch])
            width = batch[0][1]
            assert out["tokens"].shape == (len(batch), width) and len(batch) * width <= 512
            for row, (g, _) in zip(out["tokens"], batch):
                n = len(built["rows"][g])
                assert row[:n].tolist() == built["rows"][g]
            served += [g for g, _ in batch]
    assert sorted(served) == sorted(plan.served.tolist()) and len(set(served)) == len(served) == plan.steps * 24


def test_plan_batches_dynamic_from_a_store_and_from_one_sequence_packs(built, capsys):
    args = ["--dynamic", "--dp", "2", "--global-batch-size", "24", "--max-tokens-per-microbatch", "512",
            "--sequence-length-round", "16", "--seed", "3", "--epochs", "2", "--json"]
    assert plan_batches(["--store", built["store"], *args]) == 0
    got = json.loads(capsys.readouterr().out)
    lengths = StoreSequences(built["store"]).lengths
    expected = [plan_dynamic(lengths, global_batch_size=24, data_parallel_size=2, max_tokens_per_microbatch=512,
                             sequence_length_round=16, seed=3, epoch=e).stats() for e in range(2)]
    assert got == {"sequences": len(built["rows"]), "epochs": expected}
    part = os.path.join(built["store"], "parts", "part_000000")   # a shard of one-sequence packs
    assert plan_batches([part, *args]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["sequences"] == len(MMapIndexedDataset(part))
    assert plan_batches([built["store"] + "/parts/part_00000[01]", "--dynamic", "--dp", "2", "--global-batch-size",
                         "24", "--max-tokens-per-microbatch", "512"]) == 0
    capsys.readouterr()


def test_a_budget_too_small_names_the_longest_and_a_budget_that_fits(built, capsys):
    """Issue 44 item 4: one run tells the budget that works (no rerun to find the next one)."""
    lengths = StoreSequences(built["store"]).lengths
    args = ["--store", built["store"], "--dynamic", "--dp", "2", "--global-batch-size", "24",
            "--sequence-length-round", "16", "--seed", "3"]
    small = int(np.quantile(lengths, 0.5))
    assert plan_batches([*args, "--max-tokens-per-microbatch", str(small)]) == 2   # a setting, not the data
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    served = plan_dynamic(lengths, global_batch_size=24, data_parallel_size=2, max_tokens_per_microbatch=10**9,
                          sequence_length_round=16, seed=3).served
    steps = lengths[served].reshape(-1, 24)
    need = np.minimum(-(-steps // 16) * 16, steps.max(axis=1, keepdims=True))   # capped at the step's width
    fits = int(need.max())
    assert f"{int((need > small).sum()):,} of the {len(served):,} sequences served do not fit" in err
    named = re.search(r"the longest is sequence (\d+) \(([\d,]+) tokens", err)
    assert int(named[2].replace(",", "")) == lengths[int(named[1])] == lengths[served].max()
    assert f"to {fits} or more" in err
    assert plan_batches([*args, "--max-tokens-per-microbatch", str(fits)]) == 0
    capsys.readouterr()


def test_packed_shards_are_refused_for_dynamic_batching(built, capsys):
    with pytest.raises(ShardError, match="one sequence per item"):
        sequence_lengths(MultiShardDataset.open(built["packed"]))
    assert plan_batches([built["packed"], "--dynamic", "--dp", "2", "--global-batch-size", "24",
                         "--max-tokens-per-microbatch", "512"]) == 2
    assert "one sequence per item" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--dynamic", "--dp", "2", "--global-batch-size", "4", "--max-tokens-per-microbatch", "64"], "give one of them"),
    (["X", "--dynamic", "--dp", "2", "--global-batch-size", "4"], "--max-tokens-per-microbatch"),
    (["X", "--dp", "2", "--global-batch-size", "4", "--max-tokens-per-microbatch", "64"], "go with --dynamic"),
])
def test_dynamic_usage_errors(argv, message, capsys):
    assert plan_batches(argv) == 2 and message in capsys.readouterr().err
