"""Hostile input records (issue 9, item 6): each family ends as a ``file:line`` InputError, or a
counted skip under ``--skip-bad``; never a traceback, and never unbounded memory.

Families: JSON nested deeper than Python can parse (anywhere in the record, or in a JSON string
the record holds: tool-call arguments, xLAM answers and tools), text holding a
lone UTF-16 surrogate (as an escape or as CESU-8 bytes, in every text field of every record
kind), and records longer than ``--max-record-bytes`` (plain, gzip; blank or not), whose peak
memory is measured in a child process.
"""

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_sft_idx.jsondoc import RECORD_MAX_DEPTH
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess import Config, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]})


def deep(open_, close, depth, inner="1"):
    return open_ * depth + inner + close * depth


def chat_line(content, role="assistant"):
    return '{"messages": [{"role": "user", "content": "Q?"}, {"role": "%s", "content": "%s"}]}' % (role, content)


DEEP = {
    "top_level_array": deep("[", "]", 100_000),
    "top_level_object": deep('{"a":', "}", 50_000),
    "inside_an_ignored_key": '{"meta": %s, "messages": []}' % deep("[", "]", 20_000),
    "inside_content": chat_line("x").replace('"x"', deep("[", "]", 10_000)).replace('"%s"', ""),
    "string_then_deep": '{"messages": "%s", "x": %s}' % ("y" * 1000, deep('{"b":', "}", 30_000)),
}

SURROGATES = {
    "high_in_content": (chat_line("bad \\ud800 text"), "messages[1].content"),
    "low_in_content": (chat_line("\\udc00"), "messages[1].content"),
    "reversed_pair": (chat_line("\\udc00\\ud800"), "messages[1].content"),
    "in_role": (chat_line("ok", role="assist\\ud801ant"), "messages[1].role"),
    "sharegpt_value": ('{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "\\ud83d"}]}',
                       "conversations[1].value"),
    "sharegpt_from": ('{"conversations": [{"from": "hu\\udfffman", "value": "Q"}, {"from": "gpt", "value": "A"}]}',
                      "conversations[0].from"),
    "prompt": ('{"prompt": "\\ud800?", "completion": "fine"}', "prompt"),
    "completion": ('{"prompt": "fine?", "completion": "x\\udbff"}', "completion"),
}


def write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return str(path)


def cfg(tmp_path, path, **kw):
    return Config(inputs=[path], output_prefix=str(tmp_path / "out" / "ds"), tokenizer=TOKENIZER, pack_size=256,
                  progress=False, **kw)


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deeply_nested_json_is_a_located_error_or_a_counted_skip(tmp_path, name):
    path = write(tmp_path / "d.jsonl", [GOOD, DEEP[name], GOOD])
    with pytest.raises(InputError, match=f"^{path}:2: ") as e:
        run(cfg(tmp_path, path))
    assert getattr(e.value, "reason") in ("json_too_deep", "missing_key")
    s = run(cfg(tmp_path, path, skip_bad=True))
    assert s["conversations"] == 2 and sum(s["skipped"].values()) == 1


def test_moderate_nesting_in_an_ignored_key_is_accepted(tmp_path):
    line = json.dumps({"meta": json.loads(deep("[", "]", 200)), **json.loads(GOOD)})
    s = run(cfg(tmp_path, write(tmp_path / "m.jsonl", [line])))
    assert s["conversations"] == 1


def tool_call_line(arguments):
    return json.dumps({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": arguments}}]}]})


#: JSON strings inside records (parsed by the record mapping, not the line reader), 100k deep.
DEEP_STRINGS = {
    "tool_call_arguments": tool_call_line(deep('{"a":', "}", 100_000)),
    "xlam_answers": json.dumps({"query": "Q?", "answers": deep("[", "]", 100_000), "tools": "[]"}),
    "xlam_tools": json.dumps({"query": "Q?", "answers": '[{"name": "f", "arguments": {}}]',
                              "tools": deep("[", "]", 100_000)}),
    "sharegpt_function_call": json.dumps({"conversations": [{"from": "human", "value": "Q?"},
                                                            {"from": "function_call", "value": deep("[", "]", 100_000)},
                                                            {"from": "observation", "value": "1"},
                                                            {"from": "gpt", "value": "done"}]}),
    # deeper than the record bound, shallow enough for Python's parser: refused all the same
    "arguments_past_the_bound": tool_call_line(deep('{"a":', "}", RECORD_MAX_DEPTH + 1)),
}


@pytest.mark.parametrize("name", sorted(DEEP_STRINGS))
def test_deep_json_inside_a_string_is_a_located_error_or_a_counted_skip(tmp_path, name):
    path = write(tmp_path / "d.jsonl", [GOOD, DEEP_STRINGS[name], GOOD])
    with pytest.raises(InputError, match=f"^{re.escape(path)}:2: .*nested deeper than {RECORD_MAX_DEPTH}") as e:
        run(cfg(tmp_path, path))
    assert e.value.reason == "json_too_deep"
    s = run(cfg(tmp_path, path, skip_bad=True))
    assert s["conversations"] == 2 and s["skipped"] == {"json_too_deep": 1}


def test_arguments_at_the_bound_are_parsed(tmp_path):
    inner = RECORD_MAX_DEPTH
    line = tool_call_line(deep('{"a":', "}", inner))
    path = write(tmp_path / "ok.jsonl", [line])
    from megatron_sft_idx.preprocess.records.inputs import parse_record

    kind, conv = parse_record(line.encode(), path, 1, "auto", "prompt", "completion")
    args = conv.messages[-1]["tool_calls"][0]["function"]["arguments"]
    depth = 0
    while isinstance(args, dict):
        args, depth = args["a"], depth + 1
    assert kind == "chat" and depth == inner


def test_the_cli_counts_100k_deep_arguments_under_skip_bad_and_names_the_line_without(tmp_path, capsys):
    """The issue's case: one hostile row in a run; --skip-bad counts it, without it the run fails
    in one line naming file:line (never RecursionError)."""
    path = write(tmp_path / "a.jsonl", [GOOD, GOOD, DEEP_STRINGS["tool_call_arguments"], GOOD])
    argv = ["--input", path, "--tokenizer", TOKENIZER, "--pack-size", "256", "--quiet"]
    rc = main(argv + ["--output-prefix", str(tmp_path / "o" / "ds"), "--skip-bad", "--json"])
    out = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out.err and "RecursionError" not in out.err
    s = json.loads(out.out)
    assert s["conversations"] == 3 and s["skipped"] == {"json_too_deep": 1}
    assert s["skipped_examples"]["json_too_deep"].startswith(f"{path}:3: ")
    rc = main(argv + ["--output-prefix", str(tmp_path / "p" / "ds")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 1 and len(err) == 1 and f"{path}:3: " in err[0] and "RecursionError" not in err[0], err


def assert_refused_as_lone_surrogate(tmp_path, line, field):
    """A run of a good record then ``line`` stops at line 2, naming ``field`` and the rule."""
    path = write(tmp_path / "s.jsonl", [GOOD, line])
    with pytest.raises(InputError, match=f"^{re.escape(path)}:2: '{re.escape(field)}' holds a lone UTF-16") as e:
        run(cfg(tmp_path, path))
    assert e.value.reason == "invalid_unicode"


@pytest.mark.parametrize("name", sorted(SURROGATES))
def test_lone_surrogates_are_refused_before_the_tokenizer(tmp_path, name):
    assert_refused_as_lone_surrogate(tmp_path, *SURROGATES[name])


def test_cesu8_surrogate_bytes_are_refused_too_and_real_pairs_are_fine(tmp_path):
    path = tmp_path / "c.jsonl"
    with open(path, "wb") as f:
        f.write(GOOD.encode() + b"\n")
        f.write(chat_line("emoji \\ud83d\\ude00 fine").encode() + b"\n")    # a proper pair
        f.write(chat_line("x").encode().replace(b'"x"', b'"\xed\xa0\x80"') + b"\n")  # CESU-8 lone surrogate
    with pytest.raises(InputError, match=f"^{path}:3: 'messages\\[1\\].content' holds a lone"):
        run(cfg(tmp_path, str(path)))
    s = run(cfg(tmp_path, str(path), skip_bad=True))
    assert s["conversations"] == 2 and s["skipped"] == {"invalid_unicode": 1}


def _tool_record(arguments, tools):
    return json.dumps({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": arguments}}]}], "tools": tools})


_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
#: a lone surrogate in a JSON value of a tool record (where the mapping reads values it serialises
#: rather than texts it walks): as an escape in an object, doubly escaped in a JSON string, as
#: CESU-8 bytes; each must be refused, whatever shortcut proves other records free of them
TOOL_SURROGATES = {
    "arguments_object": (_tool_record({"k": "v\ud800"}, _TOOLS), "messages[1].tool_calls[0].function.arguments"),
    "arguments_string": (_tool_record(json.dumps({"k": "v\ud800"}), _TOOLS),
                         "messages[1].tool_calls[0].function.arguments"),
    "arguments_key": (_tool_record({"k\udfff": 1}, _TOOLS), "messages[1].tool_calls[0].function.arguments"),
    "tools_description": (_tool_record({}, [{"type": "function", "function": {"name": "f", "description": "\udc00"}}]),
                          "tools[0]"),
    "tools_string": (_tool_record({}, json.dumps([{"name": "f", "description": "x\uDBFF"}])), "tools[0]"),
}


@pytest.mark.parametrize("name", sorted(TOOL_SURROGATES))
def test_lone_surrogates_in_tool_values_are_refused(tmp_path, name):
    line, field = TOOL_SURROGATES[name]
    line = line.replace("\\\\u", "\\u")   # (json.dumps escaped the test's backslash: the escape itself)
    assert_refused_as_lone_surrogate(tmp_path, line, field)


#: a lone surrogate that a JSON string inside the record spells only once decoded: the inner
#: escape's backslash, ``u`` or ``d`` written as an escape itself, so that the record's bytes hold
#: no ``\\ud`` (the escape of the inner escape's backslash, of its ``u``, of its ``d`` / ``D``)
SPELLED_SURROGATES = {"backslash": r"\u005Cud800", "backslash_lower": r"\u005cudbff", "u": r"\\\u0075d800",
                      "d": r"\\u\u0064800", "D": r"\\u\u0044C00"}


@pytest.mark.parametrize("name", sorted(SPELLED_SURROGATES))
def test_a_surrogate_spelled_by_escapes_in_a_json_string_is_refused(tmp_path, name):
    from megatron_sft_idx.preprocess.records.shapes import surrogate_free

    line = _tool_record(json.dumps({"k": "vXX"}), _TOOLS).replace("XX", SPELLED_SURROGATES[name])
    arguments = json.loads(json.loads(line)["messages"][1]["tool_calls"][0]["function"]["arguments"])
    assert any(0xD800 <= ord(c) <= 0xDFFF for c in arguments["k"])   # (the case spells one)
    assert not surrogate_free(line.encode())
    assert_refused_as_lone_surrogate(tmp_path, line, "messages[1].tool_calls[0].function.arguments")


def test_cesu8_surrogate_bytes_in_tool_arguments_are_refused(tmp_path):
    path = tmp_path / "c.jsonl"
    with open(path, "wb") as f:
        f.write(GOOD.encode() + b"\n")
        f.write(_tool_record({"k": "x"}, _TOOLS).encode().replace(b'"x"', b'"\xed\xa0\x80"') + b"\n")
        f.write(_tool_record(json.dumps({"k": "x"}), _TOOLS).encode().replace(b'\\"x\\"', b'\\"\xed\xb0\x80\\"')
                + b"\n")
    s = run(cfg(tmp_path, str(path), skip_bad=True))
    assert s["conversations"] == 1 and s["skipped"] == {"invalid_unicode": 2}


def test_surrogate_free_says_so_only_of_records_that_cannot_hold_one():
    """The mapping's shortcut (shapes.base.surrogate_free): True only where no decoded string,
    at any depth of JSON strings, can hold a lone surrogate."""
    from megatron_sft_idx.jsondoc import parse_record_json
    from megatron_sft_idx.preprocess.records.shapes import surrogate_free

    def strings(value):
        if isinstance(value, str):
            yield value
            if value[:1] in "[{":
                try:
                    yield from strings(parse_record_json(value))
                except Exception:
                    pass
        elif isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    def lone(text):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in text)

    lines = [_tool_record({"k": "caf\u00e9 \ud83d\ude00"}, _TOOLS).encode(), GOOD.encode(),
             json.dumps(json.loads(_tool_record({"k": "é 😀"}, _TOOLS)), ensure_ascii=False).encode(),
             " ".encode() + GOOD.encode()]
    lines += [line.replace("\\\\u", "\\u").encode() for line, _ in TOOL_SURROGATES.values()]
    lines += [line.encode() for line, _ in SURROGATES.values()]
    lines += [_tool_record({"k": "x"}, _TOOLS).encode().replace(b'"x"', b'"\xed\xa0\x80"'),
              GOOD.encode("utf-16")]
    verdicts = [surrogate_free(line) for line in lines]
    assert verdicts[:2] == [False, True] and verdicts[2] is True and not any(verdicts[3:])
    for line, free in zip(lines, verdicts):
        if free:
            assert not any(lone(t) for t in strings(parse_record_json(line)))


def test_every_hostile_family_in_one_file_is_counted_under_skip_bad(tmp_path, capsys):
    lines = [GOOD] + list(DEEP.values()) + [line for line, _ in SURROGATES.values()] + ["x" * 600_000, GOOD]
    path = write(tmp_path / "all.jsonl", lines)
    rc = main(["--input", path, "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o" / "ds"),
               "--pack-size", "256", "--skip-bad", "--max-record-bytes", "512K", "--json", "--quiet"])
    out = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out.err
    s = json.loads(out.out)
    assert s["conversations"] == 2 and sum(s["skipped"].values()) == len(lines) - 2
    assert s["skipped"]["record_too_large"] == 1 and s["skipped"]["invalid_unicode"] == len(SURROGATES)
    assert s["skipped"]["json_too_deep"] >= 4
    assert s["skipped_examples"]["record_too_large"].startswith(f"{path}:{len(lines) - 1}: record of 600001 bytes")


PROBE = r"""
import json, sys
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.errors import ShardError
args = json.loads(sys.argv[1])
try:
    s = run(Config(progress=False, **args))
    out = {"ok": True, "skipped": s["skipped"], "conversations": s["conversations"]}
except ShardError as e:
    out = {"ok": False, "error": str(e)}
# (VmHWM, not ru_maxrss: that keeps the size the forking pytest worker had before exec)
out["peak_mib"] = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) / 1024
print(json.dumps(out))
"""


def probe(**kw) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(kw)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("compress", [False, True])
def test_a_50_mb_conversation_is_refused_with_bounded_memory(tmp_path, compress):
    """The issue's case (12.7 GB peak before): the 50 MB line is never held whole; peak RSS stays
    within a few MiB of a run without it (the default --max-record-bytes is 2 MiB)."""
    huge = chat_line("word " * (10 << 20))  # 50 MiB
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write(small, [GOOD] * 50)
    write(big, [GOOD] * 25 + [huge] + [GOOD] * 25)
    if compress:
        for p in (small, big):
            with open(p, "rb") as f, gzip.open(str(p) + ".gz", "wb") as g:
                g.write(f.read())
        small, big = str(small) + ".gz", str(big) + ".gz"
    common = dict(tokenizer=TOKENIZER, pack_size=256)
    base = probe(inputs=[str(small)], output_prefix=str(tmp_path / "a" / "ds"), **common)
    refused = probe(inputs=[str(big)], output_prefix=str(tmp_path / "b" / "ds"), **common)
    assert not refused["ok"] and refused["error"].startswith(f"{big}:26: record of {len(huge) + 1} bytes exceeds")
    skipped = probe(inputs=[str(big)], output_prefix=str(tmp_path / "c" / "ds"), skip_bad=True, **common)
    assert skipped["ok"] and skipped["skipped"] == {"record_too_large": 1} and skipped["conversations"] == 50
    for run_ in (refused, skipped):
        assert run_["peak_mib"] - base["peak_mib"] < 48, (run_, base)  # the line alone is 50 MiB
