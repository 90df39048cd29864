"""Smoke test of bench.trl_padding_free: it runs at a tiny size through ``main(argv)`` and writes
the JSON keys docs/BENCHMARKS.md reads; its own checks (same tokens both ways, our collator's
batch equal to TRL's on the same rows) run before anything is timed. No timing is asserted."""

import json

import pytest

pytest.importorskip("trl", reason="trl is in the test extra")

from bench import trl_padding_free  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_benchmark_runs_and_writes_its_keys(tmp_path, capsys):
    assert trl_padding_free.main(["--sequences", "120", "--pack-size", "512", "--batch-size", "1", "3",
                                  "--repeat", "1", "--results-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "trl_padding_free.json").read_text())
    assert doc["sequences"] == 120 and doc["packs"]["ours"] > 0 and doc["packs"]["trl"] > 0
    assert [r["batch_size"] for r in doc["rows"]] == [1, 3]
    for row in doc["rows"]:
        assert set(row["batches_per_s"]) == {"trl", "ours", "trl_collate_our_rows"}
        assert all(v > 0 for v in row["batches_per_s"].values())
    assert "ours / TRL" in capsys.readouterr().out
