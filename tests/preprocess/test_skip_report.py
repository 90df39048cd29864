"""``--skip-report FILE`` lists every record the run skipped, at whichever stage: the tokenize
stage's (bad records under ``--skip-bad``) and the plan stage's (sequences ``--overlong drop``
drops, or that keep nothing trained after ``--overlong truncate``), in input order, each plan
drop with its length and counted in the summary's ``sequences_dropped`` as it is (issue 29)."""

import json

import pytest

from megatron_sft_idx.preprocess.cli import main
from support.sft_fixtures import write_jsonl


def _chat(i, words=4):
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": " ".join(f"answer{i}w{k}" for k in range(words))}]}


@pytest.mark.parametrize("overlong, reason", [("drop", "overlong_dropped"),
                                              ("truncate", "overlong_untrainable_after_truncation")])
def test_the_skip_report_lists_the_plans_drops_with_their_length(tmp_path, families, capsys, overlong, reason):
    long_reply = _chat(3, words=900)
    if overlong == "truncate":   # a long prompt: nothing trained within the pack size
        long_reply["messages"][0]["content"] = " ".join(f"ask{k}" for k in range(900))
        long_reply["messages"][1]["content"] = "short"
    first = write_jsonl(tmp_path / "a.jsonl", [_chat(0), {"messages": "nope"}, _chat(1)])
    second = write_jsonl(tmp_path / "b.jsonl", [_chat(2), long_reply, _chat(4), long_reply])
    report = tmp_path / "skips.jsonl"
    code = main(["--input", str(first), str(second), "--output-prefix", str(tmp_path / "out" / "ds"),
                 "--tokenizer", families["qwen25"], "--pack-size", "512", "--skip-bad", "--overlong", overlong,
                 "--skip-report", str(report), "--json", "--workers", "1"])
    assert code == 0
    s = json.loads(capsys.readouterr().out)
    assert s["records_skipped"] == {"missing_key": 1} and s["sequences_dropped"] == {reason: 2}
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert [(x["file"], x["line"], x["reason"], x.get("stage")) for x in lines] == [
        (str(first), 2, "missing_key", None), (str(second), 2, reason, "plan"), (str(second), 4, reason, "plan")]
    assert lines[1]["length"] == lines[2]["length"] > 512   # (the sequence's tokens, as stored)
    assert sum(x["reason"] == reason for x in lines) == s["sequences_dropped"][reason]


def test_no_plan_drop_no_plan_line(tmp_path, families, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", [_chat(0), {"messages": "nope"}])
    report = tmp_path / "skips.jsonl"
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "ds"), "--tokenizer",
                 families["qwen25"], "--pack-size", "512", "--skip-bad", "--overlong", "drop",
                 "--skip-report", str(report), "--workers", "1"]) == 0
    assert [json.loads(x) for x in report.read_text().splitlines()] == [
        {"file": str(path), "line": 2, "reason": "missing_key"}]
