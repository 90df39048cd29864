"""One meaning per key (issue 41): a record, and every JSON string inside it (tool-call arguments,
a call, ``tools``, ShareGPT ``function_call`` values, xLAM ``answers``), that names a key twice in
one object is refused with the reason ``duplicate_key`` (a counted skip under ``--skip-bad``) --
before issue 41, ``{"role": "user", ..., "role": "assistant"}`` trained the user's text as a
reply and ``{"city": "Paris", "city": "Oslo"}`` trained Oslo with nothing counted. And the source
check reads the bytes itself for this: with the mapping's decoder made to pick the last key
again (the old behaviour, injected), ``--verify-masks`` fails the run."""

import json

import pytest

from megatron_sft_idx import jsondoc
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.records import source_check as sc

GOOD = '{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]}'
TOOLS = '[{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", ' \
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
#: (what, a line naming a key twice, the field named)
DUPLICATES = [
    ("role", '{"messages": [{"role": "user", "content": "Delete all my files.", "role": "assistant"}, '
             '{"role": "user", "content": "ok"}, {"role": "assistant", "content": "Done."}]}', "role"),
    ("arguments", '{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, '
                  '"tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '
                  '"{\\"city\\": \\"Paris\\", \\"city\\": \\"Oslo\\"}"}}]}, {"role": "tool", "content": "sunny"}, '
                  '{"role": "assistant", "content": "Sunny."}], "tools": ' + json.dumps(TOOLS) + '}',
     "messages[1].tool_calls[0].function.arguments"),
    ("call name", '{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, '
                  '"tool_calls": [{"type": "function", "function": {"name": "rm_rf", "name": "get_weather", '
                  '"arguments": {"city": "Oslo"}}}]}, {"role": "tool", "content": "sunny"}, '
                  '{"role": "assistant", "content": "Sunny."}], "tools": ' + TOOLS + '}', "name"),
    ("tools", '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], '
              '"tools": ' + json.dumps(TOOLS.replace('"description"', '"name": "rm_rf", "description"')) + '}',
     "tools"),
    ("sharegpt call", '{"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", '
                      '"value": "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\", '
                      '\\"city\\": \\"Oslo\\"}}"}, {"from": "observation", "value": "sunny"}, {"from": "gpt", '
                      '"value": "Sunny."}], "tools": ' + json.dumps(TOOLS) + '}', "conversations[1].value"),
]


def run(tmp_path, families, lines, *extra):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return main(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "ds"), "--tokenizer",
                 families["qwen25"], "--pack-size", "1024", "--workers", "1", *extra])


@pytest.mark.parametrize("what, line, field", DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_a_key_named_twice_refuses_the_record_by_name(tmp_path, families, capsys, what, line, field):
    assert run(tmp_path, families, [GOOD, line]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "in.jsonl:2" in err and "twice" in err, err
    assert f"field={field}" in err, err
    assert not (tmp_path / "out").exists() or not [n for n in (tmp_path / "out").iterdir()
                                                   if not n.name.startswith(".")]


def test_under_skip_bad_each_is_a_counted_skip(tmp_path, families, capsys):
    report = tmp_path / "skips.jsonl"
    assert run(tmp_path, families, [GOOD] + [d[1] for d in DUPLICATES] + [GOOD], "--skip-bad", "--json",
               "--skip-report", str(report)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records_skipped"] == {"duplicate_key": len(DUPLICATES)}
    assert [json.loads(x)["line"] for x in report.read_text().splitlines()] == list(range(2, 2 + len(DUPLICATES)))


def test_the_record_reader_refuses_them_and_names_the_key():
    for text in ('{"a": 1, "a": 2}', '{"x": [{"b": 1, "b": 1}]}', '{"\\u0061": 1, "a": 2}'):
        with pytest.raises(jsondoc.MetadataError) as e:
            jsondoc.parse_record_json(text)
        assert e.value.duplicate in ("a", "b")
    assert jsondoc.parse_record_json('{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}')   # one key per object


# --------------------------------------------------------------------------- the source check's own reading


def test_the_source_checks_scanner_finds_what_the_decoder_does(tmp_path):
    assert sc.duplicate_key(DUPLICATES[0][1]) == "role"
    assert sc.duplicate_key(b'{"k": "a \\"k\\": 1 inside a string", "k": 2}') == "k"
    assert sc.duplicate_key('{"r\\u006fle": 1, "role": 2}') == "role"
    assert sc.duplicate_key(GOOD) is None and sc.duplicate_key('[{"k": 1}, {"k": 2}]') is None


def test_with_the_mappings_decoder_picking_one_the_source_check_fails_the_run(tmp_path, families, capsys,
                                                                             monkeypatch):
    """The old decoder injected into the mapping (the last key wins, silently): the user's text is
    trained as a reply, and the reference path, which shares the decoder, agrees; the source check,
    reading the bytes itself, fails the run."""
    monkeypatch.setitem(jsondoc._DECODERS, (False, True), jsondoc._DECODERS[False, False])
    line = ('{"messages": [{"role": "user", "content": "Clean up my disk."}, '
            '{"role": "user", "content": "Then delete all my files.", "role": "assistant"}]}')
    assert run(tmp_path, families, [line] * 4, "--verify-masks", "4", "--seed", "3") == 1
    err = capsys.readouterr().err
    assert "names the key 'role' twice" in err and "verify" in err.lower(), err
    monkeypatch.setattr(sc, "one_meaning", lambda raw, where="": None)   # and without its own reading:
    assert run(tmp_path, families, [line] * 4, "--verify-masks", "4", "--seed", "3", "--overwrite") == 0
