"""Every field accounted for (issue 29): each record-level key is read by the shape, absent (null),
or ignored by a named rule -- documented metadata, ``--ignore-field``, holding no text -- and
counted by name; a key holding text no rule covers refuses the record by name. Null counts as
absent at every depth, so the columnar nulls of Parquet and Arrow never reach the template.
Llama-Nemotron's post-training shape and record-level system prompt keys are read as such."""

import copy
import json

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.shapes import METADATA_KEYS, SchemaOptions, drop_nulls
from support.sft_fixtures import alpaca, glaive, openai, xlam

CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def parse(record, fmt="auto", ignored=None, **opts):
    schema = SchemaOptions(**opts)
    return parse_record(json.dumps(record), "d.jsonl", 7, fmt, schema.prompt_key, schema.completion_key, schema,
                        ignored)


def refused(record, field, fmt="auto", **opts):
    with pytest.raises(InputError) as e:
        parse(record, fmt, **opts)
    assert e.value.reason == "unknown_field" and e.value.field == field, str(e.value)
    assert str(e.value).startswith("d.jsonl:7: ") and f"--ignore-field {field}" in str(e.value)
    return e.value


# ---------------------------------------------------------------- record-level keys

@pytest.mark.parametrize("make", [lambda: dict(CHAT), lambda: glaive(1), lambda: alpaca(2, True), lambda: xlam(3)],
                         ids=["chat", "sharegpt", "alpaca", "xlam"])
def test_a_record_level_key_holding_text_is_refused_by_name_in_every_shape(make):
    record = make()
    record["critique"] = "The answer is wrong."   # text no rule covers: it would be lost
    refused(record, "critique")
    ignored = {}
    parse(record, ignored=ignored, ignore_fields=("critique",))   # --ignore-field says it carries nothing
    assert ignored.get("ignore-field:critique") == 1


def test_metadata_and_keys_without_text_are_ignored_and_counted_by_rule():
    record = dict(CHAT, id="r-17", source="oasst", num_tokens=45, turn_count=[1, 2], license="cc-by-4.0",
                  empty="", absent=None, row=[[1, 2, 3]], struct={"a": None, "b": None})
    ignored = {}
    for _ in range(3):
        parse(record, ignored=ignored)
    assert ignored == {"metadata:id": 3, "metadata:source": 3, "metadata:license": 3, "no-text:num_tokens": 3,
                       "no-text:turn_count": 3, "no-text:row": 3}   # (null and "" are absent: not counted)
    refused(dict(CHAT, meta_notes={"k": [1, "text inside"]}), "meta_notes")   # text at any depth
    refused(dict(CHAT, num_tokens="forty-five"), "num_tokens")   # a documented count holding text
    assert {"id", "source", "category", "license", "generator", "version"} <= METADATA_KEYS


@pytest.mark.parametrize("key,value", [("points", 4.5), ("turns_rated", [1, 2]), ("nested", [[1, 2.5, True]]),
                                       ("is_good", True)])
def test_a_number_or_a_flag_under_an_undocumented_name_is_refused(key, value):
    """"No text" is no rule by itself (issue 41): a value's type does not say it carries nothing."""
    e = refused(dict(CHAT, **{key: value}), key)
    assert repr(value)[:20] in str(e)
    ignored = {}
    parse(dict(CHAT, **{key: value}), ignored=ignored, ignore_fields=(key,))
    assert ignored == {f"ignore-field:{key}": 1}


@pytest.mark.parametrize("key,value", [("label", False), ("train", False), ("loss", 0), ("mask", [0, 1]),
                                       ("chosen", "The better reply."), ("rejected", True), ("reward", -1.5),
                                       ("is_harmful", True), ("labels", {"helpful": 1}), ("weight", 0)])
def test_a_flag_that_decides_what_is_trained_is_refused_unless_ignored(key, value):
    """A preference-style "label": false (an undesirable completion) was ignored as "no text" and
    the completion trained; every such flag is now refused by its own reason, in every shape."""
    for make in (lambda: dict(CHAT), lambda: glaive(1), lambda: alpaca(2, True), lambda: xlam(3)):
        record = make()
        record[key] = value
        with pytest.raises(InputError) as e:
            parse(record)
        assert e.value.reason == "training_flag" and e.value.field == key, str(e.value)
        assert f"--ignore-field {key}" in str(e.value) and "trained" in str(e.value)
        ignored = {}
        parse(record, ignored=ignored, ignore_fields=(key,))
        assert ignored.get(f"ignore-field:{key}") == 1


def test_a_flag_is_metadata_only_with_its_documented_values():
    ignored = {}
    parse(dict(CHAT, reasoning="on"), ignored=ignored)
    assert ignored == {"metadata:reasoning": 1}
    refused(dict(CHAT, reasoning="First I think about it."), "reasoning")


def test_a_prompt_record_accounts_for_its_keys():
    ignored = {}
    parse({"prompt": "q", "completion": "a", "id": 3}, ignored=ignored)
    assert ignored == {"metadata:id": 1}
    refused({"prompt": "q", "completion": "a", "rationale": "why"}, "rationale")


def test_a_tokens_record_accounts_for_its_keys():
    refused({"input_ids": [1, 2], "loss_mask": [0, 1], "text": "hello"}, "text")


# ---------------------------------------------------------------- system prompt keys

@pytest.mark.parametrize("key", ["system", "system_prompt"])
@pytest.mark.parametrize("make", [lambda: dict(CHAT), lambda: glaive(1), lambda: alpaca(2, True)],
                         ids=["chat", "sharegpt", "alpaca"])
def test_a_record_level_system_prompt_becomes_the_first_system_message(make, key):
    record = make()
    record.pop("system", None)
    record[key] = "Be brief."
    conv = parse(record)[1]
    assert conv.messages[0] == {"role": "system", "content": "Be brief."} and conv.where(0) == key


def test_two_system_prompts_are_ambiguous():
    with pytest.raises(InputError) as e:
        parse(dict(CHAT, system="a", system_prompt="b"))
    assert e.value.reason == "ambiguous_record" and e.value.field == "system_prompt"
    with pytest.raises(InputError) as e:
        parse({"messages": [{"role": "system", "content": "s"}] + CHAT["messages"], "system_prompt": "b"})
    assert e.value.reason == "ambiguous_record" and e.value.field == "system_prompt"


# ---------------------------------------------------------------- Llama-Nemotron

def nemotron(i, reasoning=True):
    thought = f"<think>\nAdd {i} and 1.\n</think>\n\n" if reasoning else "<think>\n</think>\n\n"
    return {"input": [{"role": "user", "content": f"What is {i} plus 1?"}], "output": f"{thought}It is {i + 1}.",
            "category": "math", "license": "cc-by-4.0", "reasoning": "on" if reasoning else "off",
            "generator": "DeepSeek-R1", "used_in_training": "yes", "version": "v1.1",
            "system_prompt": f"detailed thinking {'on' if reasoning else 'off'}"}


def test_llama_nemotron_post_training_rows_are_read_directly():
    ignored = {}
    kind, conv = parse(nemotron(3), ignored=ignored)
    assert kind == "chat"
    assert conv.messages == [{"role": "system", "content": "detailed thinking on"},
                             {"role": "user", "content": "What is 3 plus 1?"},
                             {"role": "assistant", "content": "It is 4.", "reasoning_content": "\nAdd 3 and 1.\n"}]
    assert conv.untrained == frozenset({0, 1}) and conv.where(2) == "output"
    assert set(ignored) == {"metadata:category", "metadata:license", "metadata:reasoning", "metadata:generator",
                            "metadata:used_in_training", "metadata:version"}
    conv = parse(nemotron(4, reasoning=False))[1]
    assert conv.messages[-1] == {"role": "assistant", "content": "It is 5."}   # an empty block is no reasoning
    two = nemotron(5)
    two["input"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "5 + 1?"}]
    conv = parse(two)[1]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.untrained == frozenset({0, 1, 2, 3})   # the input is the prompt: never trained
    with pytest.raises(InputError) as e:
        parse(dict(nemotron(1), output=""))
    assert e.value.reason == "empty_conversation"


# ---------------------------------------------------------------- null as absent, at every depth

def test_drop_nulls_at_every_depth_keeps_order_and_identity():
    value = {"a": None, "b": {"c": None, "d": [1, None, {"e": None, "f": 2}]}, "g": 3}
    assert drop_nulls(value) == {"b": {"d": [1, None, {"f": 2}]}, "g": 3}   # (a null list element is a value)
    clean = {"x": {"y": [1, {"z": 2}]}}
    assert drop_nulls(clean) is clean
    assert list(drop_nulls({"z": 1, "n": None, "a": 2})) == ["z", "a"]


def test_columnar_nulls_in_tools_and_arguments_map_as_absent():
    record = copy.deepcopy(openai(1))   # (the fixture's tool definitions are shared)
    record["tools"][0]["function"]["parameters"]["properties"]["altitude"] = None
    record["tools"][0]["function"]["strict"] = None
    call = record["messages"][2]["tool_calls"][0]["function"]
    call["arguments"] = dict(json.loads(call["arguments"]), lat=None)
    conv = parse(record)[1]
    clean = parse(openai(1))[1]
    assert conv.tools == clean.tools and conv.messages == clean.messages


def test_message_fields_ignored_by_flag_are_counted_by_where():
    record = {"messages": [{"role": "user", "content": "q", "id": "m1"},
                           {"role": "assistant", "content": "a", "id": "m2", "weight": 1}], "id": 9}
    with pytest.raises(InputError) as e:
        parse(record)
    assert e.value.reason == "unknown_field" and e.value.field == "messages[0].id"
    ignored = {}
    parse(record, ignored=ignored, ignore_fields=("id",))
    assert ignored == {"ignore-field:messages[].id": 2, "ignore-field:id": 1}


# ---------------------------------------------------------------- nothing rendered the source does not hold

def test_a_rendered_tool_definition_must_be_held_by_the_records_own():
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools

    fn = {"name": "get_altitude", "description": "Altitude", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}, "datum": None}}}
    source = [{"type": "function", "function": fn}]
    clean = {"name": "get_altitude", "description": "Altitude",
             "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}
    check_rendered_tools("<tools>\n" + json.dumps({"type": "function", "function": clean}) + "\n</tools>", source,
                         "t.jsonl", 3)
    check_rendered_tools(json.dumps([{"name": "get_altitude", "parameters": clean["parameters"]}]),
                         json.dumps(source), "t.jsonl", 3)   # less than the source (Mistral's form), a JSON string
    check_rendered_tools('{"name": "get_altitude", "parameters": {"location": "K2"}}', source, "t.jsonl", 3)  # a call
    nulls = json.dumps({"type": "function", "function": dict(clean, parameters={
        "type": "object", "properties": {"location": {"type": "string"}, "altitude": None}})}, indent=4)
    with pytest.raises(InputError) as e:   # a columnar null the mapping let through
        check_rendered_tools(nulls, source, "t.jsonl", 3)
    assert e.value.reason == "rendered_not_in_source" and e.value.field == "tools.get_altitude.parameters"
    assert str(e.value).startswith("t.jsonl:3: the rendering shows tool 'get_altitude' with 'parameters' as")
    other = json.dumps({"name": "get_altitude", "description": "Altitude of somewhere else", "parameters": {}})
    with pytest.raises(InputError, match="'description'"):
        check_rendered_tools(other, source, "t.jsonl", 3)


def test_definitions_in_a_tools_string_are_held_by_their_exact_text_and_otherwise_compared(monkeypatch):
    """A record's tools given as a JSON string (ShareGPT, xLAM): a rendered definition that is
    one of its elements character for character (no null) is held without decoding the rendering;
    anything else is decoded and compared, so an added key or a kept null is still refused."""
    from megatron_sft_idx.preprocess.records import accounting

    fn = {"name": "get_altitude", "description": "Altitude\nof a place", "parameters": {
        "type": "object", "properties": {"location": {"type": "string", "description": "where"}}}}
    other = {"name": "get_depth", "description": "Depth", "parameters": {"type": "object", "properties": {}}}
    source = json.dumps([fn, other])
    decoded = []
    for name in ("raw_decode", "scan_value"):   # (every way the module decodes)
        real = getattr(accounting, name)
        monkeypatch.setattr(accounting, name, lambda text, at=0, real=real: decoded.append(text) or real(text, at))
    rendering = "<tools>\n" + "\n".join(json.dumps({"type": "function", "function": f}) for f in (fn, other))
    accounting.check_rendered_tools(rendering + "\n</tools>", source, "t.jsonl", 3)
    assert rendering not in "".join(decoded) and not any(text.startswith("<tools>") for text in decoded)
    for bad, field in ((dict(fn, strict=True), "tools.get_altitude.strict"),   # a key the source lacks
                       (dict(fn, description="Altitude"), "tools.get_altitude.description")):   # a value changed
        with pytest.raises(InputError) as e:
            accounting.check_rendered_tools("<tools>\n" + json.dumps(bad) + "\n</tools>", source, "t.jsonl", 3)
        assert e.value.reason == "rendered_not_in_source" and e.value.field == field, str(e.value)
    nulls = dict(fn, parameters=dict(fn["parameters"], required=None))   # the source's own null, rendered
    with pytest.raises(InputError) as e:
        accounting.check_rendered_tools(json.dumps(nulls), json.dumps([nulls]), "t.jsonl", 3)
    assert e.value.field == "tools.get_altitude.parameters", str(e.value)
    accounting.check_rendered_tools(json.dumps(fn), json.dumps([nulls]), "t.jsonl", 3)   # null as absent: held


def test_a_definition_read_before_gives_the_same_verdict_as_one_read_fresh():
    """The read-back remembers definitions it read (tools drawn from a catalogue come again and
    again): a text read before stands for its value only, so a record whose own definition differs
    is refused exactly as when nothing was read before, in either input form."""
    from megatron_sft_idx.preprocess.records import accounting

    fn = {"name": "get_altitude", "description": "Altitude", "parameters": {"type": "object", "properties": {}}}
    changed = dict(fn, description="Altitude above the sea")
    shown = "<tools>\n" + json.dumps(fn) + "\n</tools>"

    def verdicts():
        out = []
        for rendering in (shown, json.dumps(changed)):
            for source in ([fn], json.dumps([fn]), [changed], json.dumps([changed])):
                try:
                    accounting.check_rendered_tools(rendering, source, "t.jsonl", 3)
                    out.append("held")
                except InputError as e:
                    out.append(e.field)
        return out

    accounting._SEEN.clear()
    fresh = verdicts()
    assert fresh == ["held", "held"] + ["tools.get_altitude.description"] * 4 + ["held", "held"]
    for _ in range(3):   # now remembered, from the rendering and from the tools strings
        accounting.check_rendered_tools(shown, json.dumps([fn]), "t.jsonl", 3)
    assert accounting._SEEN["get_altitude"] and verdicts() == fresh


def test_what_the_read_back_remembers_is_bounded(monkeypatch):
    from megatron_sft_idx.preprocess.records import accounting

    monkeypatch.setattr(accounting, "_SEEN_BUDGET", 64 << 10)
    accounting._SEEN.clear()
    accounting._seen_size[0] = 0
    for i in range(600):
        fn = {"name": f"tool_{i % 50}", "description": f"{i} " + "d" * 2000, "parameters": {}}
        accounting.check_rendered_tools(json.dumps(fn), [fn], "t.jsonl", 3)
        assert accounting._seen_size[0] <= 64 << 10 and len(accounting._SEEN) <= accounting._SEEN_NAMES
        assert all(len(kept) <= accounting._SEEN_EACH for kept in accounting._SEEN.values())
    big = {"name": "tool_1", "description": "d" * (accounting._SEEN_TEXT + 1), "parameters": {}}
    for _ in range(3):
        accounting.check_rendered_tools(json.dumps(big), json.dumps([big]), "t.jsonl", 3)
    assert all(len(text) <= accounting._SEEN_TEXT for text, _ in accounting._SEEN["tool_1"])
    long_name = {"name": "t" * (accounting._SEEN_NAME + 1), "description": "d", "parameters": {}}
    for _ in range(3):
        accounting.check_rendered_tools(json.dumps(long_name), json.dumps([long_name]), "t.jsonl", 3)
    assert long_name["name"] not in accounting._SEEN
    kept = accounting._parsed_kept.cache_info().currsize
    huge = json.dumps(dict(big, description="d" * accounting._CACHED_TEXT))   # (one object: parsed whole)
    accounting.check_rendered_tools(huge, huge, "t.jsonl", 3)
    assert accounting._parsed_kept.cache_info().currsize == kept   # (parsed, not kept)
    accounting.check_rendered_tools(json.dumps(fn), json.dumps(fn), "t.jsonl", 3)
    assert accounting._parsed_kept.cache_info().currsize == kept + 1


@pytest.mark.parametrize("text", [
    '[]', ' [ ] ', '[{"name": "a"}]', '[{"name":"a"},{"name":"b","x":[1,{"y":null}]}]',
    '\n[ {"name": "a"} ,\t{"name": "b"} ]\n', '[1, "two", null, [3], {"name": "c"}]',
    '[{"name": "a"}] x', '[{"name": "a"},]', '[{"name": "a"}', '{"name": "a"}', '"[]"', '', '[{"name": "a"} {}]',
    '[{"name": "a"', '[{"name": "a", "d": "b', '[{"name": "a", "d" 1}]', '[{"name": "a", "d": [1, }]'])
def test_a_tools_string_is_read_element_by_element_exactly_as_the_decoder_reads_it(text):
    from megatron_sft_idx.preprocess.records.accounting import _elements

    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    elements = _elements(text)
    if isinstance(whole, list):
        assert [value for value, _ in elements] == whole
        assert all(json.loads(written) == value and written in text for value, written in elements)
    else:
        assert elements is None   # (the caller parses it whole: one object, or not JSON)


def test_the_check_catches_a_mapping_that_lets_nulls_through(tmp_path, families, monkeypatch):
    """Injected defect: a mapping whose null removal does nothing renders Parquet's nulls; the
    check (reading the record itself) refuses every such record by name instead of training it."""
    from megatron_sft_idx.preprocess import Config, run
    from megatron_sft_idx.preprocess.records import shapes
    from support.sft_fixtures import write_jsonl

    record = copy.deepcopy(openai(1))
    record["tools"][0]["function"]["parameters"]["properties"]["altitude"] = None
    path = write_jsonl(tmp_path / "n.jsonl", [record] * 3)

    def go(name):
        return run(Config(inputs=[path], output_prefix=str(tmp_path / name / "ds"), tokenizer=families["qwen25"],
                          pack_size=2048, progress=False, skip_bad=True, workers=1))

    assert go("fixed")["skipped"] == {}
    monkeypatch.setattr(shapes.mapper, "drop_nulls", lambda value: value)
    with pytest.raises(ShardError, match=r"skipped: 3 \(3 rendered not in source\).*n\.jsonl:1: the rendering "
                                         r"shows tool 'get_weather' with 'parameters' as the record does not hold"):
        go("broken")


def test_nemotron_rows_train_the_output_alone_and_pass_the_source_check(tmp_path, families):
    from megatron_sft_idx.preprocess import Config, run
    from megatron_sft_idx.reader import MMapIndexedDataset
    from support.sft_fixtures import write_jsonl

    rows = [nemotron(i, reasoning=i % 2 == 0) for i in range(8)]
    path = write_jsonl(tmp_path / "nemotron.jsonl", rows)
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / "ds"), tokenizer=families["qwen3"],
                   pack_size=2048, progress=False, verify_masks=8, workers=1))
    assert s["records_read"] == 8 and s["conversations"] == 8 and s["verify_masks"]["checked"] == 8
    assert s["ignored_keys"]["metadata:generator"] == 8 and s["ignored_keys"]["metadata:reasoning"] == 8
    trained = s["verify_masks"]["trained_tokens_by_role"]
    assert set(trained) <= {"assistant", "reasoning"} and trained["reasoning"] > 0   # never the input or system
    ds = MMapIndexedDataset(s["outputs"][0])
    assert sum(int(ds[p][1].sum()) for p in range(len(ds))) == s["trainable_tokens"]


# ---------------------------------------------------------------- tool-call arguments, compared structurally

def _tool_records():
    """OpenAI (string arguments), ShareGPT function_call (one, then two turns of calls), xLAM (a
    JSON string of two calls), each with a columnar null in the first call's arguments."""
    from support.sft_fixtures import glaive, openai, toolace, xlam_raw

    out = []
    for i in range(2):
        r = copy.deepcopy(openai(i, with_system=False))
        fn = r["messages"][1]["tool_calls"][0]["function"]
        fn["arguments"] = json.dumps(dict(json.loads(fn["arguments"]), lat=None))
        out.append(r)
        r = glaive(i)
        r.pop("system")
        turn = r["conversations"][1]
        turn["value"] = json.dumps({"name": "get_weather", "arguments": dict(json.loads(turn["value"])["arguments"],
                                                                             lat=None)})
        out.append(r)
        r = toolace(i)
        r.pop("system")
        out.append(r)
        r = xlam_raw(i)
        r.pop("id")
        out.append(r)
    return out


def _run(tmp_path, families, family, name, records):
    from megatron_sft_idx.preprocess import Config, run
    from support.sft_fixtures import write_jsonl

    path = write_jsonl(tmp_path / f"{name}.jsonl", records + [dict(CHAT)])   # (one record always kept)
    return run(Config(inputs=[path], output_prefix=str(tmp_path / name / "ds"), tokenizer=families[family],
                      pack_size=4096, progress=False, skip_bad=True, workers=1))


def _kept_and_refused(s):
    return s["records_read"] - sum(s["skipped"].values()), s["skipped"].get("rendered_not_in_source", 0)


def test_a_rendered_call_must_be_held_by_one_of_the_records_calls():
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools

    calls = ({"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "lat": null}'}},
             {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}})
    oslo, rome = '"city": "Oslo"', '"city": "Rome", "unit": "c"'
    for ok in (f'<tool_call>\n{{"name": "get_weather", "arguments": {{{oslo}}}}}\n</tool_call>',
               f'{{"name": "get_weather", "parameters": {{{oslo}}}}}<|eom_id|>'   # Llama 3.1's form
               f'{{"name": "get_weather", "parameters": {{"unit": "c", "city": "Rome"}}}}',
               f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{{oslo}}}}}, '
               '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "c1"}]',   # less than the source
               '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',   # a JSON string, parsed
               'get_weather\n```json\n{"city": "Oslo"}\n```'):   # not a JSON call: no verdict
        check_rendered_tools(ok, None, "t.jsonl", 3, calls)
    for bad, n, field in ((f'{{"name": "get_weather", "arguments": {{{oslo}, "lat": null}}}}', 1,
                           "tool_calls.get_weather.arguments.lat"),   # a null the mapping kept
                          (f'{{"name": "get_weather", "arguments": {{{rome}}}}} '
                           f'{{"name": "get_weather", "arguments": {{{oslo}}}}}', 1,
                           "tool_calls.get_weather.arguments.city"),   # two calls' arguments swapped
                          (f'{{"name": "get_weather", "parameters": {{{oslo}}}}}'
                           f'{{"name": "get_weather", "parameters": {{{rome}}}}}'
                           f'{{"name": "get_weather", "parameters": {{{rome}}}}}', 3,
                           "tool_calls.get_weather.arguments.city")):   # a call the record does not make
        with pytest.raises(InputError) as e:
            check_rendered_tools(bad, None, "t.jsonl", 3, calls)
        assert e.value.reason == "rendered_not_in_source" and e.value.field == field, str(e.value)
        assert str(e.value).startswith(f"t.jsonl:3: the rendering shows call {n} of tool 'get_weather' with ")


@pytest.mark.parametrize("family", ["qwen25", "llama3", "deepseek", "mistral", "qwen3"])
def test_real_templates_render_tool_calls_the_source_holds(tmp_path, families, family):
    records = _tool_records()
    s = _run(tmp_path, families, family, "clean", records)
    kept, refused_ = _kept_and_refused(s)
    assert refused_ == 0, s["skipped"]
    assert kept == len(_rendered(family)) + 1, s["skipped"]


def _rendered(family):
    """The tool records the family's template renders (Llama 3.1's one call a turn; Mistral's calls
    need ids, which those without are given: records/shapes/call_ids.py)."""
    return {"llama3": {0, 1, 2, 4, 5, 6}}.get(family, set(range(8)))


def _defect_keep_nulls(monkeypatch):
    from megatron_sft_idx.preprocess.records import shapes

    monkeypatch.setattr(shapes.mapper, "drop_nulls", lambda value: value)
    monkeypatch.setattr(shapes.mapper, "may_hold_null", lambda value: (True, None))


def _defect_add_key(monkeypatch):
    from megatron_sft_idx.preprocess.records import shapes

    original = shapes.Mapper.arguments
    monkeypatch.setattr(shapes.Mapper, "arguments", lambda self, value, where: dict(original(self, value, where),
                                                                                      verbose=True))


def _defect_swap(monkeypatch):
    from megatron_sft_idx.preprocess.records import shapes

    original = shapes.Mapper.done

    def done(self, tools, source=None):
        calls = [c["function"] for m in self.messages for c in m.get("tool_calls") or ()]
        if len(calls) > 1 and calls[0]["arguments"] != calls[-1]["arguments"]:
            calls[0]["arguments"], calls[-1]["arguments"] = calls[-1]["arguments"], calls[0]["arguments"]
        return original(self, tools, source)

    monkeypatch.setattr(shapes.Mapper, "done", done)


@pytest.mark.parametrize("family", ["qwen25", "llama3", "mistral", "qwen3"])
@pytest.mark.parametrize("defect, changed", [(_defect_keep_nulls, {0, 1, 4, 5}),
                                             (_defect_add_key, set(range(8))),
                                             (_defect_swap, {2, 3, 6, 7})], ids=["nulls", "added", "swapped"])
def test_a_mapping_that_changes_arguments_is_refused_on_every_record_it_changes(tmp_path, families, family, defect,
                                                                               changed, monkeypatch):
    """Injected defects: the mapping keeps the arguments' nulls, adds a key, or swaps two calls'
    arguments. The text check agrees with the mapping (it renders what it was given); the
    accounting reads the record itself and refuses every record the defect changed."""
    records = _tool_records()
    defect(monkeypatch)
    s = _run(tmp_path, families, family, "broken", records)
    refused_by_name = len(changed & _rendered(family))
    assert _kept_and_refused(s) == (len(_rendered(family)) + 1 - refused_by_name, refused_by_name), s["skipped"]


def _batch_and_reference(families, family, loss_on, records, skip_bad=True):
    """``(batch, reference)``: the encoder's batch of ``records``, and per record what the
    reference gives it (tokens and mask, or its error) one record at a time."""
    from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder

    enc = RecordEncoder(EncodeOptions(tokenizer_path=families[family], loss_on=loss_on, skip_bad=skip_bad))
    raws = [(n + 1, json.dumps(r)) for n, r in enumerate(records)]
    want = []
    for line, raw in raws:
        o = enc.options
        try:
            _, payload = parse_record(raw, "b.jsonl", line, o.input_format, o.prompt_key, o.completion_key,
                                      enc.schema, {})
            want.append(enc.tok.encode_chat(payload, loss_on, "b.jsonl", line, enc.policy))
        except InputError as err:
            want.append(err)
    return enc, raws, want


@pytest.mark.parametrize("every", [1, 2, 64])
@pytest.mark.parametrize("loss_on", ["assistant", "per-turn", "all"])
def test_read_backs_made_every_few_records_refuse_what_the_reference_refuses(families, monkeypatch, loss_on,
                                                                             every):
    """The encoder queues each record's read-back and makes them every ``READ_BACK_EVERY``
    records (cheaper than between renders): with a mapping that adds a key to every call, the
    records refused, each one's error, the surviving bytes and the first error a strict run
    raises are the reference's, record by record, whatever the window."""
    from megatron_sft_idx.preprocess.records import encode

    monkeypatch.setattr(encode, "READ_BACK_EVERY", every)
    _defect_add_key(monkeypatch)
    records = [r for pair in zip(_tool_records(), [dict(CHAT)] * 8) for r in pair]   # tools, chat, tools, ...
    enc, raws, want = _batch_and_reference(families, "qwen25", loss_on, records)
    got = enc.encode_batch(raws, "b.jsonl")
    refused = [(line, w.reason) for (line, _), w in zip(raws, want) if isinstance(w, InputError)]
    assert got.skipped_lines == refused and {r for _, r in refused} == {"rendered_not_in_source"}
    assert len(refused) == 8 and set(got.first_skipped.values()) == {str(want[0])}
    if loss_on != "per-turn":   # (per-turn's reference gives the last turn's sequence alone)
        kept = [w for w in want if not isinstance(w, InputError)]
        assert got.lengths.tolist() == [ids.size for ids, _ in kept]
        assert got.ids.tolist() == [t for ids, _ in kept for t in ids.tolist()]
        assert got.loss_mask.tolist() == [t for _, mask in kept for t in mask.tolist()]
    strict = _batch_and_reference(families, "qwen25", loss_on, [dict(CHAT)] + records[:3] + ["not a record"],
                                  skip_bad=False)[0]
    with pytest.raises(InputError) as e:
        strict.encode_batch([(n + 1, json.dumps(r)) for n, r in enumerate([dict(CHAT)] + records)], "b.jsonl")
    assert str(e.value) == str(want[0]).replace("b.jsonl:1:", "b.jsonl:2:")   # (one line later)


def test_a_record_the_read_back_refuses_gets_the_references_first_error(tmp_path, families, monkeypatch):
    """A record whose one-render read-back fails is asked of the reference again, so the error it
    gets is the reference's first: here the reference's prefix renders refuse it before its
    read-back, and that is the error, as when the read-back was made between renders."""
    from bench.tool_corpus import HERMES_TEMPLATE
    from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
    from support.chat_families import with_template

    _defect_add_key(monkeypatch)
    records = [dict(CHAT), _tool_records()[0], dict(CHAT)]
    hermes = {"hermes": with_template(str(tmp_path / "hermes"), families["llama3"], HERMES_TEMPLATE)}
    enc, raws, want = _batch_and_reference(hermes, "hermes", "assistant", records)
    assert want[1].reason == "rendered_not_in_source"   # (the read-back refuses it, as the reference does)
    assert enc.locator is not None   # (the one-render method: the reference renders prefixes)
    real = ChatTokenizer.prefix_spans

    def refusing(self, conv, *args, **kwargs):
        if conv.source_calls:
            raise InputError("b.jsonl:2: prefixes differ (injected)", reason="template_error")
        return real(self, conv, *args, **kwargs)
    monkeypatch.setattr(ChatTokenizer, "prefix_spans", refusing)
    got = enc.encode_batch(raws, "b.jsonl")
    assert got.skipped_lines == [(2, "template_error")] and got.lengths.size == 2
    assert enc.stats["one_render"] == 3


def test_a_source_system_prompt_must_be_in_the_rendering_a_template_default_need_not_be(tmp_path, families):
    """Qwen2.5 inserts its own system prompt when the record gives none (template text, not
    source: nothing to hold); when the record gives one, the rendering must hold it. A template
    that renders the source's system prompt nowhere is refused by the field, never trained
    without it."""
    from support.chat_families import with_template

    with_system = [dict(CHAT, system=f"Answer in {n} words.") for n in range(3)]
    s = _run(tmp_path, families, "qwen25", "qwen", [dict(CHAT) for _ in range(3)] + with_system)
    assert s["skipped"] == {} and s["records_read"] == 7
    no_system = with_template(str(tmp_path / "nosys"), families["qwen25"], (
        "{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    s = _run(tmp_path, {"nosys": no_system}, "nosys", "nosys", with_system)
    assert s["skipped"] == {"template_dropped_content": 3} and s["records_read"] == 4


def _pasted(i):
    """An OpenAI record whose user pastes a call of the declared tool (other arguments than the
    record's own call) and a definition of it (another description), whose tool result echoes a
    call, and whose final reply quotes one: JSON in messages' own text, not calls or definitions."""
    r = copy.deepcopy(openai(i, with_system=False))
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Atlantis", "unit": "k", "extra": None}})
    definition = json.dumps({"name": "get_weather", "description": "Pasted, not declared", "parameters": {
        "type": "object", "properties": {"depth": {"type": "number"}}}})
    r["messages"][0]["content"] = f"Call it like {call}, it is defined as {definition}. " + r["messages"][0]["content"]
    r["messages"][2]["content"] = json.dumps({"echo": {"name": "get_weather", "arguments": {"city": "Nowhere"}}})
    r["messages"][3]["content"] = f'I called {{"name": "get_weather", "arguments": {{"city": "Mu{i}"}}}} for you.'
    return r


@pytest.mark.parametrize("family", ["qwen25", "llama3", "qwen3"])
def test_json_a_user_pastes_is_not_taken_for_a_rendered_call_or_definition(tmp_path, families, family):
    """A user pasting a declared tool's call or definition (and a tool result or reply quoting a
    call) is the message's own text: accepted, while the rendered call and definitions are still
    compared -- a mapping that adds a key to the call is refused on the same records."""
    records = [_pasted(i) for i in range(3)]
    s = _run(tmp_path, families, family, "pasted", records)
    assert s["skipped"] == {} and s["records_read"] == 4, s["skipped"]


@pytest.mark.parametrize("defect", [_defect_add_key, _defect_keep_nulls], ids=["added", "nulls"])
def test_a_pasted_call_does_not_hide_a_changed_rendered_call(tmp_path, families, defect, monkeypatch):
    records = [_pasted(i) for i in range(3)]
    for r in records:   # (a null in the record's own call, for the kept-nulls defect)
        fn = r["messages"][1]["tool_calls"][0]["function"]
        fn["arguments"] = json.dumps(dict(json.loads(fn["arguments"]), lat=None))
    defect(monkeypatch)
    s = _run(tmp_path, families, "qwen25", "pasted_broken", records)
    assert _kept_and_refused(s) == (1, 3), s["skipped"]


def test_json_that_breaks_off_is_read_as_no_definition_or_call_and_never_raises_but_refusals():
    """A rendering (or a tools string) whose JSON breaks off inside a definition or a call -- an
    unterminated string, a missing delimiter, a cut list -- gives nothing to compare there, as
    text that is not JSON does; it never escapes as a decoder's error."""
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools

    fn = {"name": "get_altitude", "description": "Altitude", "parameters": {"type": "object", "properties": {}}}
    calls = ({"function": {"name": "get_altitude", "arguments": '{"place": "K2"}'}},)
    whole = json.dumps(fn)
    for cut in (len(whole) - 1, len(whole) - 3, whole.index("Alt") + 2, whole.index('"type"') + 3):
        for tools in ([fn], json.dumps([fn]), json.dumps([fn])[:cut]):
            check_rendered_tools("<tools>\n" + whole[:cut], tools, "t.jsonl", 3)
            check_rendered_tools('{"name": "get_altitude", "arguments": {"place": "K' + whole[:cut], tools, "t.jsonl",
                                 3, calls)
    with pytest.raises(InputError):   # (and what does decode is still compared)
        check_rendered_tools(json.dumps(dict(fn, strict=True)) + whole[:-2], [fn], "t.jsonl", 3)


def test_check_rendered_tools_reads_no_call_inside_a_messages_own_text():
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools

    calls = ({"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},)
    pasted = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    text = f"user: {pasted}\nassistant: " + '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    with pytest.raises(InputError, match="call 1 of tool 'get_weather'"):   # without the span: read as call 1
        check_rendered_tools(text, None, "t.jsonl", 3, calls)
    check_rendered_tools(text, None, "t.jsonl", 3, calls, own=[(6, 6 + len(pasted))])
    with pytest.raises(InputError, match="call 2 of tool 'get_weather'"):   # a rendered call outside is still read
        check_rendered_tools(text + pasted, None, "t.jsonl", 3, calls, own=[(6, 6 + len(pasted))])


# ---------------------------------------------------------------- arguments encoded twice

def _twice(i, inner=None):
    """An OpenAI record whose call's arguments are a JSON string of the arguments' JSON text, and a
    ShareGPT one whose function_call value does the same (public function-calling samples)."""
    r = copy.deepcopy(openai(i, with_system=False))
    fn = r["messages"][1]["tool_calls"][0]["function"]
    fn["arguments"] = json.dumps(fn["arguments"] if inner is None else inner)
    g = glaive(i)
    turn = g["conversations"][1]
    call = json.loads(turn["value"])
    turn["value"] = json.dumps(dict(call, arguments=json.dumps(json.dumps(call["arguments"]) if inner is None
                                                               else inner)))
    return [r, g]


def test_arguments_encoded_twice_are_decoded_once_more_when_they_hold_an_object():
    ignored = {}
    for record in _twice(1):
        _, conv = parse(record, ignored=ignored)
        calls = [c for m in conv.messages for c in m.get("tool_calls") or ()]
        assert calls[0]["function"]["arguments"] == {"city": "Lagos", "unit": "c"}
    assert ignored == {"decoded-twice:messages[].tool_calls[].function.arguments": 1,
                       "decoded-twice:conversations[].value[].arguments": 1}, ignored
    for inner, what in (("not json", "a string that is not JSON"), (json.dumps([1, 2]), "a JSON list"),
                        (json.dumps("{}x"), "a JSON str")):   # (three levels: refused, not decoded on)
        for record in _twice(1, inner):
            with pytest.raises(InputError) as e:
                parse(record)
            assert e.value.reason == "bad_tool_call" and what in str(e.value), str(e.value)


@pytest.mark.parametrize("family", ["qwen25", "llama3"])
def test_arguments_encoded_twice_train_as_the_object_and_are_counted(tmp_path, families, family):
    """End to end: the same records with arguments encoded once and twice give the same bytes;
    the summary counts the rule by field, and both checks (accounting, --verify-masks) pass."""
    from megatron_sft_idx.preprocess import Config, run
    from megatron_sft_idx.preprocess.summary import format_summary
    from support.sft_fixtures import write_jsonl

    def go(name, records):
        path = write_jsonl(tmp_path / f"{name}.jsonl", records)
        return run(Config(inputs=[path], output_prefix=str(tmp_path / name / "ds"), tokenizer=families[family],
                          pack_size=4096, progress=False, verify_masks=8, workers=1))

    once = [r for i in range(3) for r in (copy.deepcopy(openai(i, with_system=False)), glaive(i))]
    twice = [r for i in range(3) for r in _twice(i)]
    a, b = go("once", once), go("twice", twice)
    assert a["rules_applied"] == {} and b["skipped"] == {} and b["conversations"] == 6
    assert b["rules_applied"] == {"decoded-twice:conversations[].value[].arguments": 3,
                                  "decoded-twice:messages[].tool_calls[].function.arguments": 3}
    assert "rules applied       conversations[].value[].arguments (decoded twice) 3" in format_summary(b)
    for x, y in zip(a["outputs"], b["outputs"]):
        for ext in (".bin", ".idx"):
            assert open(x + ext, "rb").read() == open(y + ext, "rb").read()


def test_a_call_compared_by_its_exact_text_still_counts_in_order():
    """The read-back's fast path (the rendered call is the record's n-th call of the tool
    character for character) gives the verdict the decoding does: swapped or changed
    arguments, or one call too many, are refused all the same."""
    from megatron_sft_idx.preprocess.records.accounting import check_rendered_tools

    oslo, rome = '{"city": "Oslo"}', '{"city": "Rome", "n": 2}'
    calls = ({"function": {"name": "f", "arguments": oslo}}, {"function": {"name": "f", "arguments": json.loads(rome)}})

    def call(args):
        return '{"name": "f", "arguments": ' + args + '}'

    check_rendered_tools(call(oslo) + call(rome), None, "t.jsonl", 3, calls)
    for bad, n in ((call(rome) + call(oslo), 1), (call(oslo) + call('{"city": "Rome", "n": 3}'), 2),
                   (call(oslo) + call(rome) + call(rome), 3), (call('{"city": "Oslo", "n": null}') + call(rome), 1)):
        with pytest.raises(InputError, match=f"call {n} of tool 'f'"):
            check_rendered_tools(bad, None, "t.jsonl", 3, calls)
