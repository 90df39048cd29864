"""Smoke test of bench.family_cost: each family runs on the same corpus, every conversation is
kept, and the tokens stored equal one render per conversation (the JSON the docs quote)."""

import json

import pytest

from bench import family_cost


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_family_cost_runs_each_family_against_qwen3(tmp_path, monkeypatch):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert family_cost.main(["--count", "30", "--rounds", "1", "--corpora", "chat,tools",
                             "--families", "qwen3,glm-4.7"]) == 0
    doc = json.loads((tmp_path / "family_cost.json").read_text())
    for corpus in ("chat", "tools"):
        rows = doc["corpora"][corpus]
        assert set(rows) == {"qwen3", "glm-4.7"} and rows["qwen3"]["vs_qwen3"] == 1.0
        for family, row in rows.items():
            assert row["conversations"] == 30 and row["skipped"] == {} and not row["dropped"], (family, row)
            assert row["tokens_stored"] == row["tokens_one_render"], (corpus, family, row)
    assert doc["corpora"]["tools"]["glm-4.7"]["stop"] == "next-role"
