"""Smoke test of bench.floor: render once and encode once on the corpus, the main job beside them,
and the fraction the issue asks for in the JSON."""

import json

import pytest

from bench import floor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_floor_renders_encodes_and_runs_the_main_job(tmp_path, monkeypatch):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert floor.main(["--count", "40", "--rounds", "1", "--corpora", "example,tools"]) == 0
    doc = json.loads((tmp_path / "floor.json").read_text())
    for kind in ("example", "tools"):
        r = doc["corpora"][kind]
        assert r["conversations"] == 40 and len(r["runs"]) == 1
        # the floor encodes the whole rendering; the job writes it (nothing truncated at this size)
        assert r["floor_tokens"] == r["job_tokens"] > 0
        assert r["render_s"] > 0 and r["encode_s"] > 0 and r["job_cpu_s"] > 0
        assert 0 < r["fraction"] == pytest.approx((r["render_s"] + r["encode_s"]) / r["job_cpu_s"])
        # the cold job is a fresh preprocess-sft process: its start-up makes it dearer than the warm one
        assert r["cold_cpu_s"] > r["job_cpu_s"] and r["cold_fraction"] < r["fraction"]


def test_floor_measures_your_own_data_with_your_tokenizer(tmp_path, monkeypatch):
    """Issue 44 item 6: the README's rate, measured on a user's file and tokenizer (``--input``)."""
    import os

    import bench._common as common

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data, tok = os.path.join(root, "examples", "conversations.jsonl"), os.path.join(root, "examples", "tokenizer")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert floor.main(["--input", data, "--tokenizer", tok, "--rounds", "1"]) == 0
    doc = json.loads((tmp_path / "floor.json").read_text())
    assert list(doc["corpora"]) == ["yours"]
    r = doc["corpora"]["yours"]
    with open(data) as f:
        assert r["conversations"] == sum(1 for line in f if line.strip())
    assert r["vocab_size"] == 1024 and r["job_rate"] > 0 and r["cold_rate"] > 0
    with pytest.raises(SystemExit, match="one local .jsonl file"):
        floor.main(["--input", str(tmp_path / "missing.jsonl"), "--tokenizer", tok])
