"""Smoke tests of the remote and hot-path benchmarks at a tiny size: they run, every reader
reads back exactly the corpus, and the JSON holds what the README quotes. No timing asserted."""

import json

import pytest

from bench import hotpath, remote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_remote_bench_entry_point(tmp_path):
    rc = remote.main(["--packs", "120", "--pack-size", "256", "--shards", "2", "--block-size", "8K",
                      "--shuffle-block-size", "4K", "--window", "2", "--max-seconds", "1",
                      "--results-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "remote.json").read_text())
    assert set(doc["readers"]) == set(remote.SYSTEMS)
    for name, row in doc["readers"].items():
        assert row["verified"] and row["reads"] > 0 and row["gets_per_pack"] is not None, name
    assert doc["readers"]["ours_block_local"]["hit_rate"] > doc["readers"]["ours_shuffle"]["hit_rate"]
    stats = doc["order_statistics"]["as_stored"]
    assert stats["block_local"]["block_fetches_per_epoch"] <= stats["shuffle"]["block_fetches_per_epoch"]


def test_remote_bench_refuses_unknown_readers(tmp_path):
    assert remote.main(["--systems", "nope", "--results-dir", str(tmp_path)]) == 2


def test_hotpath_entry_point(tmp_path):
    assert hotpath.main(["--packs", "200", "--pack-size", "256", "--slice", "10",
                         "--results-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "hotpath.json").read_text())
    for mode in ("warm", "cold"):
        assert set(doc["results"][mode]["passes"]) == set(hotpath.PASSES)
        assert all(p["rounds"] >= 1 and p["ratio_vs_upstream_sft"] > 0
                   for p in doc["results"][mode]["passes"].values())
