"""Every field that reaches the model is checked in the rendering, or ignored by a named, counted
rule (issue 41): a message's ``name`` (who spoke, in multi-party data) must be rendered in its
message's place, or dropped by ``--ignore-field name`` and counted -- before, a template that
dropped it lost the speaker with nothing counted; a tool result's ``name`` that names the call it
answers is that call's name. A key beside a tool definition in its ``{"type": "function", ...}``
wrapper is refused by the mapping (unless ignored) and by the read-back of the rendering (a key
the template or the mapping adds there, as inside the definition). And a flag word where text is
expected is read as the flag: a message's ``"reasoning": "off"`` is no reasoning to train."""

import json

import pytest

from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.shapes import SchemaOptions

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
PARTY = {"messages": [{"role": "user", "name": "alice", "content": "Shall we meet at noon?"},
                      {"role": "user", "name": "bob", "content": "Noon is fine."},
                      {"role": "assistant", "content": "Noon it is, then."}]}
#: a template that says who speaks (the qwen25 stand-in's layout, with the message's name)
NAMED = ("{%- for m in messages %}{{ '<|im_start|>' + m.role }}{% if m.name %}{{ ' name=' + m.name }}{% endif %}"
         "{{ '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def call_record(result_name):
    return {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                         {"role": "tool", "name": result_name, "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}],
            "tools": [{"type": "function", "function": WEATHER}]}


def run(tmp_path, families, records, *extra):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return main(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "ds"), "--tokenizer",
                 families["qwen25"], "--pack-size", "1024", "--workers", "1", *extra])


def one_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --------------------------------------------------------------------------- a message's name


def test_a_speakers_name_the_template_drops_is_refused_naming_it(tmp_path, families, capsys):
    assert run(tmp_path, families, [PARTY]) == 1
    err = one_error(capsys)
    assert "user name of messages[0]" in err and "field=messages[0].name" in err and "--ignore-field name" in err


def test_ignore_field_name_drops_the_names_and_counts_them(tmp_path, families, capsys):
    assert run(tmp_path, families, [PARTY] * 3, "--ignore-field", "name", "--json", "--verify-masks", "3") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ignored_keys"] == {"ignore-field:messages[].name": 6}


def test_a_template_that_renders_the_name_passes(tmp_path, families, capsys):
    template = tmp_path / "named.jinja"
    template.write_text(NAMED)
    assert run(tmp_path, families, [PARTY], "--chat-template", str(template), "--verify-masks", "1") == 0


def test_a_tool_results_name_is_its_calls_name(tmp_path, families, capsys):
    assert run(tmp_path, families, [call_record("get_weather")], "--verify-masks", "1") == 0
    (tmp_path / "b").mkdir()
    assert run(tmp_path / "b", families, [call_record("get_time")]) == 1   # names no call it answers
    assert "tool name of messages[2]" in one_error(capsys)


# --------------------------------------------------------------------------- a tool definition's wrapper


def parse(record, **opts):
    schema = SchemaOptions(**opts)
    ignored = {}
    return parse_record(json.dumps(record), "d.jsonl", 7, "auto", "prompt", "completion", schema, ignored), ignored


def test_a_key_beside_a_definition_is_refused_by_the_mapping_unless_ignored():
    record = call_record("get_weather")
    record["tools"] = [{"type": "function", "function": WEATHER, "strict": True}]
    with pytest.raises(InputError) as e:
        parse(record)
    assert e.value.reason == "unknown_field" and e.value.field == "tools[0].strict", str(e.value)
    (kind, conv), ignored = parse(record, ignore_fields=("strict",))
    assert conv.tools == [{"type": "function", "function": WEATHER}] and ignored == {"ignore-field:tools[].strict": 1}


def test_a_key_added_beside_a_definition_is_refused_by_the_read_back(tmp_path, families, capsys, monkeypatch):
    """The mapping made to pass a key into the wrapper (a defect injected): the qwen25 template
    writes each tool whole (tojson), so the rendering shows it beside the definition; the read-back
    compares the wrapper with the record's and refuses it, naming the tool and the key."""
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools
    from megatron_sft_idx.preprocess.records.shapes.mapper import Mapper

    real = Mapper.tools

    def tools(self, value, where):
        out = real(self, value, where)
        return [dict(t, strict=True) for t in out] if out else out

    monkeypatch.setattr(Mapper, "tools", tools)
    assert run(tmp_path, families, [call_record("get_weather")]) == 1
    err = one_error(capsys)
    assert "in a wrapper with 'strict'" in err and "field=tools.get_weather(wrapper).strict" in err, err
    source = [{"type": "function", "function": WEATHER}]
    check_rendered_tools(json.dumps(source[0]), source, "d.jsonl", 1)                    # as the record gives it
    check_rendered_tools(json.dumps(WEATHER), [WEATHER], "d.jsonl", 1)                   # bare
    check_rendered_tools(json.dumps({"type": "function", "function": WEATHER}), [WEATHER], "d.jsonl", 1)
    with pytest.raises(InputError, match="in a wrapper with 'type'"):
        check_rendered_tools(json.dumps({"type": "tool", "function": WEATHER}), source, "d.jsonl", 1)


# --------------------------------------------------------------------------- a flag word where text is expected


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "thinking"])
def test_a_reasoning_switch_on_a_message_is_read_as_the_flag(field):
    record = {"messages": [{"role": "system", "content": "detailed thinking off", field: "off"},
                           {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello.", field: "Off"}]}
    (kind, conv), ignored = parse(record)
    assert all("reasoning_content" not in m for m in conv.messages)
    assert ignored == {f"metadata:messages[].{field}": 2}
    record["messages"][2][field] = "First I greet."          # text: the turn's reasoning, as before
    (kind, conv), _ = parse(record)
    assert conv.messages[2]["reasoning_content"] == "First I greet."


def test_a_reasoning_switch_is_not_trained_end_to_end(tmp_path, families, capsys):
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello.",
                            "reasoning": "on"}]}
    assert run(tmp_path, families, [record] * 2, "--verify-masks", "2", "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ignored_keys"] == {"metadata:messages[].reasoning": 2}
