"""Inputs read whole and reported (issue 29): the same tool-calling records as Parquet, Arrow and
``save_to_disk`` give the bytes of their JSON Lines form (columnar nulls never rendered); a
directory is read in every kind it holds and the summary lists each file with its records,
sequences and skips; ``--skip-report`` lists every skipped record; a JSON file that is not one
array, or one object spread over lines, is refused by name. Records in, sequences out and skips
are counted as what they are (issue 33)."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import expand_inputs
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.summary import decision_warnings, format_summary
from support.saved_datasets import save_to_disk, shard_bytes
from support.sft_fixtures import openai, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")


def cfg(tmp_path, inputs, name="ds", **kw):
    kw.setdefault("tokenizer", TOKENIZER)
    return Config(inputs=[str(p) for p in inputs], output_prefix=str(tmp_path / "out" / name), pack_size=2048,
                  progress=False, **kw)


ALTITUDE = {"name": "get_altitude", "description": "Altitude of a place",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                            "datum": {"type": "string"}},
                           "required": ["location"]}}
WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                          "required": ["city"]}}


def tool_record(i: int) -> dict:
    """A tool call whose tool definitions and arguments (dicts, as columnar sets hold them) differ
    from row to row, so a columnar file unifies them into structs padded with nulls."""
    tool, args = (WEATHER, {"city": f"City{i}", "unit": "c"}) if i % 2 else (ALTITUDE, {"location": f"Peak{i}"})
    return {"id": f"r{i}", "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": f"Question {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call{i}", "type": "function", "function": {"name": tool["name"], "arguments": args}}]},
        {"role": "tool", "tool_call_id": f"call{i}", "content": json.dumps({"value": i})},
        {"role": "assistant", "content": f"The answer is {i}."}],
        "tools": [{"type": "function", "function": tool}]}


@pytest.mark.compat   # (a dataset saved by the compat stack's `datasets`: support/saved_datasets.py)
def test_columnar_copies_give_the_bytes_of_the_json_lines_form(tmp_path, families):
    records = [tool_record(i) for i in range(24)]
    tok = families["qwen25"]
    jsonl = run(cfg(tmp_path, [write_jsonl(tmp_path / "t.jsonl", records)], name="jsonl", tokenizer=tok))
    table = pa.Table.from_pylist(records)
    parquet = tmp_path / "t.parquet"
    pq.write_table(table, parquet, row_group_size=5)
    # the unified struct type holds every other tool's parameters as nulls: what must not be rendered
    row = pq.read_table(parquet).slice(0, 1).to_pylist()[0]
    assert row["tools"][0]["function"]["parameters"]["properties"]["city"] is None
    assert row["messages"][2]["tool_calls"][0]["function"]["arguments"]["unit"] is None
    arrow = tmp_path / "t.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    saved = save_to_disk(records, str(tmp_path / "saved"))
    want = shard_bytes(jsonl["outputs"][0])
    for name, path in (("parquet", parquet), ("arrow", arrow), ("saved", saved)):
        s = run(cfg(tmp_path, [path], name=name, tokenizer=tok, partition_bytes=1, verify_masks=24))
        assert s["records_read"] == 24 and s["verify_masks"]["checked"] == 24, name
        assert shard_bytes(s["outputs"][0]) == want, f"{name} renders other bytes than JSON Lines"
        assert s["ignored_keys"] == {"metadata:id": 24}


@pytest.mark.compat   # (a dataset saved by the compat stack's `datasets`: support/saved_datasets.py)
def test_a_directory_is_read_in_every_kind_and_each_file_reported(tmp_path, families):
    tok = families["qwen25"]
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.json").write_text(json.dumps([tool_record(i) for i in range(5)], indent=2))
    (data / "sub" / "b.json").write_text(json.dumps([tool_record(i) for i in range(5, 8)]))
    write_jsonl(data / "c.jsonl", [tool_record(i) for i in range(8, 10)])
    pq.write_table(pa.Table.from_pylist([tool_record(i) for i in range(10, 14)]), data / "d.parquet")
    save_to_disk([tool_record(i) for i in range(14, 17)], str(data / "saved"))
    (data / "README.md").write_text("not data")
    s = run(cfg(tmp_path, [data], tokenizer=tok))
    names = [os.path.relpath(f["name"], data) for f in s["inputs"]]
    assert names[:3] == ["a.json", "c.jsonl", "d.parquet"] and names[-1] == os.path.join("sub", "b.json")
    assert all(n.startswith(os.path.join("saved", "data-")) for n in names[3:-1])
    assert [f["records"] for f in s["inputs"]][:3] == [5, 2, 4] and s["records_read"] == 17
    assert sum(f["sequences"] for f in s["inputs"]) == s["sequences_stored"] == 17
    left = []
    assert [n for n in expand_inputs([str(data)], left)] == [f["name"] for f in s["inputs"]]
    assert left == [str(data / "README.md")]   # (what the run warns it did not read)
    text = format_summary(s)
    assert "a.json: 5 records -> 5 sequences, skipped none" in text


def test_skips_are_listed_per_file_and_in_the_skip_report(tmp_path, families, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [tool_record(i) for i in range(4)])
    bad_records = [tool_record(0), {"messages": "nope"}, tool_record(1), dict(tool_record(2), critique="bad"),
                   {"conversations": []}]
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_records)
    with open(bad, "a") as f:
        f.write('{"messages": [\n')
    report = tmp_path / "skips.jsonl"
    out = str(tmp_path / "out" / "cli")
    code = main(["--input", str(good), str(bad), "--output-prefix", out, "--tokenizer", families["qwen25"],
                 "--pack-size", "2048", "--skip-bad", "--skip-report", str(report), "--json", "--workers", "1"])
    assert code == 0
    s = json.loads(capsys.readouterr().out)
    assert [(f["records"], f["sequences"], f["skipped"]) for f in s["inputs"]] == [
        (4, 4, {}), (6, 2, {"empty_conversation": 1, "malformed_json": 1, "missing_key": 1, "unknown_field": 1})]
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert lines == [{"file": str(bad), "line": n, "reason": r} for n, r in
                     ((2, "missing_key"), (4, "unknown_field"), (5, "empty_conversation"), (6, "malformed_json"))]
    assert s["records_skipped"] == s["skipped"] and s["records_read"] == 10


def test_a_json_file_that_is_not_one_array_is_refused_by_name(tmp_path):
    a, b = json.dumps(openai(0)), json.dumps(openai(1))
    path = tmp_path / "two.json"
    path.write_text(f"[{a}}}[{b}]")   # record A's array closed by '}': not one array
    with pytest.raises(InputError, match=rf"^{path}: cannot read input \(ArrayError: not a JSON array at byte"):
        run(cfg(tmp_path, [path], name="two"))
    pretty = tmp_path / "one.json"
    pretty.write_text(json.dumps(openai(0), indent=2))
    with pytest.raises(InputError, match="one JSON object written over several lines") as e:
        run(cfg(tmp_path, [pretty], name="one", skip_bad=True))
    assert e.value.path == str(pretty)
    single = tmp_path / "single.json"   # an object on one line is a JSON Lines file of one record
    single.write_text(json.dumps({"prompt": "q", "completion": "a"}))
    assert run(cfg(tmp_path, [single], name="single"))["records_read"] == 1


def test_per_turn_counts_records_and_sequences_apart(tmp_path, families):
    two_turns = {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                              {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}
    path = write_jsonl(tmp_path / "p.jsonl", [two_turns] * 9 + [{"messages": []}])
    s = run(cfg(tmp_path, [path], tokenizer=families["qwen25"], loss_on="per-turn", skip_bad=True))
    assert s["records_read"] == 10 and s["records_skipped"] == {"empty_conversation": 1}
    assert s["sequences_stored"] == 18 and s["conversations"] == 18 and s["sequences_dropped"] == {}
    text = format_summary(s)
    assert "records             10 read, skipped 1 (1 empty conversation)" in text
    assert "sequences           18 from the records, 18 kept, dropped none" in text
    warning, = decision_warnings(s, 1.0)
    assert warning.startswith("1 of 10 records (10.0%) were skipped: ")


def test_partitions_follow_the_input_size_and_never_change_the_bytes(tmp_path, monkeypatch):
    from megatron_sft_idx.preprocess.records import partitions
    from megatron_sft_idx.preprocess.records.partitions import MIN_PARTITION_BYTES, auto_partition_bytes

    mib = 1 << 20
    assert auto_partition_bytes(0) == MIN_PARTITION_BYTES == 8 * mib and auto_partition_bytes(1 << 40) == 64 * mib
    assert auto_partition_bytes(int(47.5 * mib)) == int(9.5 * mib)   # 5 equal units, not 48 of 1 MiB nor one
    assert auto_partition_bytes(15 * mib) == 15 * mib and auto_partition_bytes(16 * mib) == 8 * mib
    assert auto_partition_bytes(600 * mib) == -(-600 * mib // 64)   # 64 units, none under 8 MiB
    monkeypatch.setattr(partitions, "MIN_PARTITION_BYTES", mib)   # (the run's rule on a small file)
    filler = "word " * 400
    records = [{"messages": [{"role": "user", "content": f"{i} {filler}"}, {"role": "assistant", "content": f"{i}"}]}
               for i in range(1700)]
    path = write_jsonl(tmp_path / "big.jsonl", records)
    size = os.path.getsize(path)
    assert 3 * mib < size < 4 * mib
    auto = run(cfg(tmp_path, [path], name="auto", workers=2))
    one = run(cfg(tmp_path, [path], name="one", partition_bytes=64 << 20))
    assert auto["units"]["tokenize"] == 3 and one["units"]["tokenize"] == 1
    assert 0 < auto["workers_busy"]["tokenize"] <= 1
    assert shard_bytes(auto["outputs"][0]) == shard_bytes(one["outputs"][0])   # source order, whatever the cut
    assert "work units          index 1, tokenize 3, materialize 1 (2 workers; tokenize kept them" in \
        format_summary(auto)
