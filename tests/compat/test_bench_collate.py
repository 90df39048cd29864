"""bench.collate at a tiny size against the installed Megatron-Bridge: it runs, and it checks
that every batch of ours equals Bridge's own collate_fn's before it times anything."""

import json

import pytest

from bench import collate


def test_collate_bench_compares_equal_batches_with_bridges_collate(tmp_path):
    code = collate.main(["--packs", "12", "--pack-size", "256", "--max-seqs", "6", "--batch-size", "1", "3",
                         "--pad-seq-to-mult", "1", "4", "--repeat", "1", "--results-dir", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "collate.json").read_text())["results"]
    assert {(r["pad_seq_to_mult"], r["options"], r["batch_size"]) for r in rows} == {
        (m, o, b) for m in (1, 4) for o in collate.OPTION_SETS for b in (1, 3)}
    assert all(r["batches_equal"] == 16 and r["ours_ms"] > 0 and r["bridge_ms"] > 0 for r in rows)


def test_a_differing_batch_stops_the_benchmark():
    import torch

    ref = {"tokens": torch.zeros(1, 4, dtype=torch.long), "token_count": [4]}
    collate.same_batch(ref, {"tokens": torch.zeros(1, 4, dtype=torch.long), "token_count": [4]}, "equal")
    for bad in ({"tokens": torch.zeros(1, 4, dtype=torch.int), "token_count": [4]},
                {"tokens": torch.ones(1, 4, dtype=torch.long), "token_count": [4]},
                {"tokens": torch.zeros(1, 4, dtype=torch.long), "token_count": [3]},
                {"tokens": torch.zeros(1, 4, dtype=torch.long)}):
        with pytest.raises(AssertionError):
            collate.same_batch(ref, bad, "differs")
