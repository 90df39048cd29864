"""Each input shape mapped into the chat template's vocabulary, and what is refused by name."""

import json

import pytest

from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.shapes import SchemaOptions
from support.sft_fixtures import alpaca, glaive, openai, parts, reasoning, toolace, xlam


def parse(record, fmt="auto", **opts):
    raw = json.dumps(record) if not isinstance(record, str) else record
    schema = SchemaOptions(**opts)
    return parse_record(raw, "d.jsonl", 7, fmt, schema.prompt_key, schema.completion_key, schema)


def refused(record, reason, field=None, fmt="auto", match=None, **opts):
    with pytest.raises(InputError) as e:
        parse(record, fmt, **opts)
    assert e.value.reason == reason, str(e.value)
    assert str(e.value).startswith("d.jsonl:7: ")
    if field is not None:
        assert e.value.field == field, str(e.value)
    if match is not None:
        assert match in str(e.value)
    return e.value


# ---------------------------------------------------------------- OpenAI messages

def test_openai_tool_calls_map_to_the_hf_vocabulary():
    kind, conv = parse(openai(3))
    assert kind == "chat"
    call = conv.messages[2]["tool_calls"][0]
    assert conv.messages[2]["role"] == "assistant" and conv.messages[2]["content"] == ""
    assert call == {"type": "function", "id": "call00003",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}
    assert list(call["function"]["arguments"]) == ["city", "unit"]  # key order as the producer wrote it
    assert conv.messages[3] == {"role": "tool", "content": '{"rain": false}', "tool_call_id": "call00003"}
    assert conv.tools == [{"type": "function", "function": json.loads(json.dumps(openai(3)["tools"][0]["function"]))}]
    assert [conv.where(k) for k in range(5)] == ["messages[0]", "messages[1]", "messages[2]", "messages[3]",
                                                 "messages[4]"]


def test_legacy_function_call_functions_and_function_role():
    record = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"x": 1}'}},
        {"role": "function", "name": "f", "content": "2"},
        {"role": "assistant", "content": "done"}],
        "functions": [{"name": "f", "parameters": {"type": "object"}}]}
    _, conv = parse(record)
    assert conv.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert conv.messages[2] == {"role": "tool", "content": "2", "name": "f"}
    assert conv.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused({"messages": [{"role": "function", "content": "2"}]}, "missing_key", "messages[0].name")


def test_roles_developer_and_ipython_are_aliases_unknown_roles_are_refused():
    _, conv = parse({"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
                                  {"role": "ipython", "content": "r"}, {"role": "assistant", "content": "a"}]})
    assert [m["role"] for m in conv.messages] == ["system", "user", "tool", "assistant"]
    refused({"messages": [{"role": "critic", "content": "x"}]}, "unknown_role", "messages[0].role",
            match="role 'critic'")


def test_content_parts_are_joined_and_non_text_parts_refused():
    _, conv = parse(parts(2))
    assert conv.messages[0]["content"] == "Part one of question 2.\nPart two."
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "ok"}]}
    refused(image, "unsupported_content", "messages[0].content[1]", match="'image_url' part")


def test_unknown_message_fields_are_refused_unless_ignored():
    record = {"messages": [{"role": "user", "content": "q", "train": False},
                           {"role": "assistant", "content": "a"}]}
    err = refused(record, "unknown_field", "messages[0].train")
    assert "--ignore-field train" in str(err)
    _, conv = parse(record, ignore_fields=("train",))
    assert conv.messages[0] == {"role": "user", "content": "q"}


def test_none_values_are_absent_as_parquet_rows_hold_them():
    record = {"messages": [{"role": "user", "content": "q", "tool_calls": None, "tool_call_id": None, "name": None},
                           {"role": "assistant", "content": "a", "reasoning_content": None, "weight": None}],
              "tools": None}
    _, conv = parse(record)
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert conv.tools is None


@pytest.mark.parametrize("arguments,message", [
    ("not json", "not JSON"), ('["a"]', "must be a JSON object"), (3, "must be a JSON object")])
def test_tool_call_arguments_must_be_a_json_object(arguments, message):
    record = openai(0)
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    refused(record, "bad_tool_call", "messages[2].tool_calls[0].function.arguments", match=message)


def test_tool_calls_elsewhere_or_malformed_are_refused():
    record = openai(0)
    record["messages"][1]["tool_calls"] = record["messages"][2]["tool_calls"]
    refused(record, "bad_tool_call", "messages[1].tool_calls")
    record = openai(0)
    record["messages"][2]["tool_calls"][0]["type"] = "code_interpreter"
    refused(record, "bad_tool_call", "messages[2].tool_calls[0].type")
    record = openai(0)
    del record["messages"][2]["tool_calls"][0]["function"]["name"]
    refused(record, "bad_tool_call", "messages[2].tool_calls[0].function.name")


def test_weight_zero_excludes_a_turn_from_training():
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
                           {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "weight": 1}]}
    _, conv = parse(record)
    assert conv.untrained == {1}
    refused({"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}, "unknown_field",
            "messages[0].weight")


def test_top_level_system_is_prepended_once():
    _, conv = parse({"system": "S", "messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}]})
    assert conv.messages[0] == {"role": "system", "content": "S"} and conv.fields[0] == "system"
    refused({"system": "S", "messages": [{"role": "system", "content": "T"}]}, "ambiguous_record", "system")


def test_a_record_of_two_shapes_is_refused_under_auto():
    record = {"messages": [{"role": "user", "content": "q"}], "conversations": [{"from": "human", "value": "q"}]}
    refused(record, "ambiguous_record", "conversations")
    # named by --input-format, the other shape's text is still text: refused by name unless ignored
    refused(record, "unknown_field", "conversations", fmt="chat", match="--ignore-field conversations")
    assert parse(record, fmt="chat", ignore_fields=("conversations",))[0] == "chat"


# ---------------------------------------------------------------- reasoning

def test_reasoning_inline_or_as_a_field():
    _, conv = parse(reasoning(1, inline=True))
    m = conv.messages[2]
    assert m["reasoning_content"] == "\nI add 1 and 3 to get 4.\n" and m["content"] == "The sum is 4."
    assert conv.inline[2] == "<think>\nI add 1 and 3 to get 4.\n</think>\n\nThe sum is 4."
    _, conv = parse(reasoning(1, inline=False))
    assert conv.messages[2]["reasoning_content"] == "I add 1 and 3 to get 4." and not conv.inline
    both = reasoning(1, inline=True)
    both["messages"][2]["reasoning_content"] = "again"
    refused(both, "unknown_field", "messages[2].reasoning_content", match="twice")
    empty = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                             "reasoning_content": " \n"}]}
    assert "reasoning_content" not in parse(empty)[1].messages[1]
    refused({"messages": [{"role": "user", "content": "q", "reasoning": "r"}]}, "unknown_field",
            "messages[0].reasoning")


# ---------------------------------------------------------------- ShareGPT

def test_sharegpt_glaive_function_call_and_observation():
    kind, conv = parse(glaive(0))
    assert kind == "chat"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]
    assert conv.messages[3]["content"] == '{"temperature": 10, "sky": "clear"}'
    assert conv.tools[0]["type"] == "function" and conv.tools[0]["function"]["name"] == "get_weather"
    assert conv.fields[2] == "conversations[1]"


def test_sharegpt_function_call_may_open_with_a_thought_block():
    from support.sft_fixtures import glaive_reasoning

    _, conv = parse(glaive_reasoning(2))
    call = conv.messages[2]
    assert call["reasoning_content"] == "\nThe user wants the weather in Lima.\n" and call["content"] == ""
    assert call["tool_calls"][0]["function"]["name"] == "get_weather"
    assert conv.messages[4]["reasoning_content"] == "\nI report the observation.\n"


def test_sharegpt_parallel_calls_and_rounds():
    _, conv = parse(xlam(1))
    assert [c["function"]["arguments"]["city"] for c in conv.messages[1]["tool_calls"]] == ["Lagos", "Pune"]
    assert len(conv.tools) == 2
    _, conv = parse(toolace(2))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                  "assistant"]


def test_sharegpt_refusals():
    bad = glaive(0)
    bad["conversations"][1]["value"] = "get_weather(city=Paris)"
    refused(bad, "bad_tool_call", "conversations[1].value")
    bad = glaive(0)
    bad["conversations"][0]["from"] = "narrator"
    refused(bad, "unknown_role", "conversations[0].from")
    bad = glaive(0)
    bad["tools"] = "{not json"
    refused(bad, "bad_tool_call", "tools")
    bad = glaive(0)
    bad["conversations"].insert(0, {"from": "system", "value": "other"})
    refused(bad, "ambiguous_record", "system")


# ---------------------------------------------------------------- Alpaca and prompt/completion

def test_alpaca_with_and_without_input_system_and_history():
    kind, conv = parse(alpaca(4, with_input=True, system=True, history=True))
    assert kind == "chat"
    assert conv.messages == [
        {"role": "system", "content": "You are a translator."},
        {"role": "user", "content": "Say hello 4."}, {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "Translate sentence 4 to French.\nThe cat number 4 sleeps."},
        {"role": "assistant", "content": "Le chat numero 4 dort."}]
    assert conv.fields == ["system", "history[0][0]", "history[0][1]", "instruction", "output"]
    _, conv = parse(alpaca(4, with_input=False))
    assert conv.messages[0]["content"] == "Translate sentence 4 to French."
    refused({"instruction": "x", "output": ""}, "empty_conversation", "output")
    refused({"instruction": "x", "output": "y", "history": [["only one"]]}, "missing_key", "history[0]")


def test_alpaca_like_sets_that_name_the_reply_response_or_the_input_context():
    """GPTeacher (instruction, input, response) and Databricks Dolly (instruction, context, response,
    category): the reply and the input are kept, by the shape's documented keys."""
    _, conv = parse({"instruction": "Write a haiku.", "input": "About rain.", "response": "Rain falls."})
    assert conv.messages == [{"role": "user", "content": "Write a haiku.\nAbout rain."},
                             {"role": "assistant", "content": "Rain falls."}]
    assert conv.fields == ["instruction", "response"]
    ignored = {}
    _, conv = parse_record(json.dumps({"instruction": "Who?", "context": "Ada wrote it.", "response": "Ada.",
                                       "category": "qa"}), "d.jsonl", 7, "auto", "prompt", "completion",
                           SchemaOptions(), ignored)
    assert conv.messages[0]["content"] == "Who?\nAda wrote it." and conv.messages[1]["content"] == "Ada."
    assert ignored == {"metadata:category": 1}
    _, conv = parse({"instruction": "", "input": "Only input.", "response": "Ok."})
    assert conv.fields == ["input", "response"]
    refused({"instruction": "x", "output": "y", "response": "z"}, "ambiguous_record", "response")
    refused({"instruction": "x", "input": "y", "context": "z", "output": "o"}, "ambiguous_record", "context")
    refused({"instruction": "x", "response": " "}, "empty_conversation", "response")
    refused({"instruction": "x"}, "missing_key", "output")


def test_prompt_keys_over_alpaca_refuse_to_drop_the_input():
    err = refused(alpaca(1, with_input=True), "unknown_field", "input", prompt_key="instruction",
                  completion_key="output")
    assert "--input-format alpaca" in str(err)
    kind, conv = parse(alpaca(1, with_input=False), prompt_key="instruction", completion_key="output")
    assert kind == "chat" and [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_prompt_completion_chat_raw_and_conversational():
    record = {"prompt": "Q: 2+2?", "completion": " 4"}
    kind, conv = parse(record)
    assert kind == "chat" and conv.messages == [{"role": "user", "content": "Q: 2+2?"},
                                                {"role": "assistant", "content": " 4"}]
    assert parse(record, prompt_format="raw") == ("prompt", ("Q: 2+2?", " 4"))
    conversational = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "example"}, {"role": "user", "content": "q2"}],
                      "completion": [{"role": "assistant", "content": "a"}]}
    _, conv = parse(conversational)
    assert conv.untrained == {0, 1, 2, 3} and conv.fields[-1] == "completion[0]"
    refused(conversational, "missing_key", "prompt", prompt_format="raw")


def test_tokens_records_are_unchanged():
    assert parse({"input_ids": [1, 2, 3], "answer_start_idx": 1}) == ("tokens", ([1, 2, 3], None, 1))


# ---------------------------------------------------------------- xLAM / APIGen rows as published

def test_xlam_rows_map_to_one_user_turn_and_parallel_tool_calls():
    from support.sft_fixtures import xlam_raw

    kind, conv = parse(xlam_raw(2))
    assert kind == "chat" and [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[0]["content"].startswith("What is the weather in")
    calls = conv.messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert calls[1]["function"]["arguments"] == {"city": json.loads(xlam_raw(2)["answers"])[1]["arguments"]["city"],
                                                 "unit": "f"}
    assert conv.tools[0]["type"] == "function" and conv.tools[0]["function"]["parameters"]["city"]["type"] == "str"
    assert conv.where(0) == "query" and conv.where(1) == "answers"
    # answers and tools given as lists (a converted dataset) map the same
    record = dict(xlam_raw(2), answers=json.loads(xlam_raw(2)["answers"]), tools=json.loads(xlam_raw(2)["tools"]))
    assert parse(record, "xlam")[1].messages == conv.messages


def test_xlam_refusals():
    from support.sft_fixtures import xlam_raw

    refused(dict(xlam_raw(0), answers="[]"), "bad_tool_call", "answers", match="holds no function call")
    refused(dict(xlam_raw(0), answers=[]), "bad_tool_call", "answers", match="holds no function call")
    refused(dict(xlam_raw(0), answers="get_weather(Paris)"), "bad_tool_call", "answers")
    refused(dict(xlam_raw(0), answers=json.dumps([{"arguments": {}}])), "bad_tool_call")
    refused(dict(xlam_raw(0), query=None), "missing_key")
    refused(dict(xlam_raw(0), messages=[{"role": "user", "content": "x"}]), "ambiguous_record", fmt="auto")
    refused(dict(glaive(0), query="q", answers="[]"), "ambiguous_record", "answers")
    # named by --input-format, another shape's key present but null does not make a row ambiguous
    assert parse(dict(xlam_raw(0), messages=None), "xlam")[1].where(1) == "answers"


def test_with_rendered_is_replace_of_rendered():
    """``Conversation.with_rendered`` (the adaptation's copy, once a record) gives what
    ``dataclasses.replace(conv, rendered=...)`` gives, and leaves the conversation as it was."""
    import dataclasses
    _, conv = parse_record(json.dumps(toolace(1)), "t", 1, "auto", "prompt", "completion")
    rendered = [dict(m) for m in conv.messages]
    before = dataclasses.asdict(conv)
    got = conv.with_rendered(rendered)
    assert got is not conv and got.rendered is rendered and conv.rendered is None
    assert dataclasses.asdict(got) == dataclasses.asdict(dataclasses.replace(conv, rendered=rendered))
    assert dataclasses.asdict(conv) == before
