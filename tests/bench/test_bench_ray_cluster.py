"""Smoke run of ``bench.ray_cluster`` (shared filesystem): a real three-node cluster at a tiny size;
checks what it reads back and the JSON the docs quote, never its timings."""

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("ray", reason="the [ray] extra is not installed")


def test_ray_cluster_benchmark_entry_point(tmp_path, monkeypatch):
    from bench import ray_cluster

    monkeypatch.setattr("bench._common.RESULTS_DIR", tmp_path)
    assert ray_cluster.main(["--conversations", "1500", "--partition-bytes", "200K", "--pack-size", "1024",
                             "--work-dir", str(tmp_path / "work"), "--timeout", "400"]) == 0
    doc = json.loads((tmp_path / "ray_cluster.json").read_text())
    assert doc["mode"] == "shared filesystem" and doc["nodes"] == 3
    for run in (doc["cluster_cold"], doc["cluster"]):
        assert run["exit"] == 0 and run["identical_to_local"] is True and run["path_audit"] == {}
        assert run["data_files_identical_to_local"] is True
        assert run["engine"]["kind"] == "ray" and run["engine"]["cpus"] == 3
        assert sum(run["task_runs_by_node"].values()) >= run["units"]["tokenize"] >= 5
        assert run["driver_peak_rss_mib"] > 0
    assert set(doc["per_million_conversations_by_node"]) == {"head", "worker1", "worker2"}
    assert doc["loopback"]["interfaces"] == ["lo"]
    assert set(doc["projection"]["projected_s"]) == {"8", "64"} and "model" in doc["projection"]
    assert doc["projection"]["plan_rate_from"]
    assert doc["ratio_cluster_over_local_wall"] > 0
