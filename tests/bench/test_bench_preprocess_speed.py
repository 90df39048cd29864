"""Smoke test of bench.preprocess_speed: the baseline tree is exported and imported as itself, both
systems write the same number of tokens, and the JSON holds the ratios the README quotes."""

import json

import pytest

from bench import preprocess_speed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_preprocess_speed_runs_baseline_and_ours(tmp_path, monkeypatch, capsys):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert preprocess_speed.main(["--count", "60", "--corpora", "example", "--no-two-workers", "--no-warmup"]) == 0
    doc = json.loads((tmp_path / "preprocess_speed.json").read_text())
    runs = doc["corpora"]["example"]
    assert runs["baseline"]["tokens"] == runs["ours"]["tokens"] > 0
    assert runs["speedup_per_core"] > 0 and runs["speedup_wall"] > 0
    assert runs["ours_hf"]["tokens"] == runs["ours"]["tokens"] and runs["gigatoken_over_hf_per_core"] > 0
    assert doc["baseline_ref"] == preprocess_speed.BASELINE_REF


def test_preprocess_speed_runs_the_tool_corpus_as_ours_only(tmp_path, monkeypatch):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert preprocess_speed.main(["--count", "30", "--corpora", "tools", "--no-two-workers", "--no-warmup"]) == 0
    runs = json.loads((tmp_path / "preprocess_speed.json").read_text())["corpora"]["tools"]
    assert runs["ours"]["tokens"] > 0 and runs["ours"]["conversations"] == 30
    assert runs["baseline"]["tokens_per_cpu_s"] is None and runs["speedup_per_core"] is None
