"""``--input DIR``: the summary says what the directory gave and what it left, with why -- files
of a kind the run does not read, hidden files, hidden directories (not searched) -- in ``--json``
(``inputs`` read, ``inputs_left`` not) and in the printed summary, not only in a warning (issue 29)."""

import json

from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.summary import format_summary
from support.sft_fixtures import openai, write_jsonl


def _directory(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / ".cache").mkdir()
    write_jsonl(data / "a.jsonl", [openai(i) for i in range(3)])
    write_jsonl(data / "sub" / "b.jsonl", [openai(i) for i in range(3, 5)])
    write_jsonl(data / ".cache" / "stale.jsonl", [openai(9)])
    write_jsonl(data / ".hidden.jsonl", [openai(8)])
    (data / "README.md").write_text("not data")
    (data / "sub" / "NOTES").write_text("not data either")
    return data


def _argv(tmp_path, data, families, *extra):
    return ["--input", str(data), "--output-prefix", str(tmp_path / "out" / "ds"), "--tokenizer",
            families["qwen25"], "--pack-size", "2048", "--workers", "1", *extra]


def test_the_summary_lists_what_a_directory_left_and_why(tmp_path, families, capsys):
    data = _directory(tmp_path)
    assert main(_argv(tmp_path, data, families, "--json")) == 0
    s = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in s["inputs"]] == [str(data / "a.jsonl"), str(data / "sub" / "b.jsonl")]
    assert s["records_read"] == 5
    assert s["inputs_left"] == [
        {"name": str(data / ".hidden.jsonl"), "reason": "hidden file"},
        {"name": str(data / "README.md"), "reason": "not a kind the run reads (.md)"},
        {"name": str(data / ".cache") + "/", "reason": "hidden directory, not searched"},
        {"name": str(data / "sub" / "NOTES"), "reason": "not a kind the run reads (no extension)"}]
    assert main(_argv(tmp_path, data, families, "--overwrite")) == 0
    text = capsys.readouterr().out
    assert "inputs              2 files, 5 records" in text
    assert (f"  left out 4 paths: {data / '.hidden.jsonl'} (hidden file), {data / 'README.md'} (not a kind the "
            f"run reads (.md)), {data / '.cache'}/ (hidden directory, not searched), {data / 'sub' / 'NOTES'} "
            "(not a kind the run reads (no extension))") in text


def test_files_named_directly_leave_nothing(tmp_path, families, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", [openai(0)])
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "ds"), "--tokenizer",
                 families["qwen25"], "--pack-size", "2048", "--workers", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["inputs_left"] == [] and "left out" not in format_summary(s)
