"""Tool calls rendered and trained as their producers meant them, on the template families; a
template that cannot render them is refused by name, never used to render a conversation
without them."""

import json
import os

import numpy as np
import pytest

from support.chat_families import with_template
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess import Config, run
from support.sft_fixtures import glaive, openai, toolace, write_jsonl, xlam

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")


def trained_runs(tok, ids, mask):
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


def conversation(record):
    return parse_record(json.dumps(record), "t.jsonl", 1, "auto", "prompt", "completion")[1]


# the families that render a multi-round tool conversation prefix-stably (Qwen3 inserts an empty
# <think> in the final turn only, so it is trained per turn: tests/preprocess/test_reasoning.py)
STABLE = ["llama3", "qwen25", "deepseek", "mistral"]


@pytest.mark.parametrize("family", STABLE)
def test_openai_tool_call_turn_is_trained_with_its_call_and_end_of_turn(families, family):
    tok = ChatTokenizer(families[family])
    eot = tok.hf.eos_token
    for i in range(6):
        record = openai(i, with_system=family != "mistral")
        ids, mask = tok.encode_chat(conversation(record), "assistant", "t.jsonl", i + 1)
        runs = trained_runs(tok, ids, mask)
        assert len(runs) == 2, runs
        call, answer = runs
        city = json.loads(record["messages"][-3]["tool_calls"][0]["function"]["arguments"])["city"]
        assert "get_weather" in call and f'"{city}"' in call and call.endswith(eot) and call.count(eot) == 1
        assert answer.strip().startswith(record["messages"][-1]["content"]) and answer.endswith(eot)
        rendered = tok.decode(ids)
        result = record["messages"][-2]["content"]
        if family == "llama3":  # Llama 3.1 renders a tool result as a JSON string
            result = json.dumps(result)
        assert result in rendered  # the tool result is there, untrained
        assert not any(result in r or "Is it raining" in r for r in runs)


@pytest.mark.parametrize("family", ["qwen25", "deepseek"])
@pytest.mark.parametrize("make", [glaive, xlam, toolace])
def test_sharegpt_tool_shapes_train_every_call_round(families, family, make):
    tok = ChatTokenizer(families[family])
    record = make(3)
    ids, mask = tok.encode_chat(conversation(record), "assistant", "t.jsonl", 1)
    runs = trained_runs(tok, ids, mask)
    turns = [t for t in record["conversations"] if t["from"] in ("function_call", "gpt")]
    assert len(runs) == len(turns)
    for run_text, turn in zip(runs, turns):
        if turn["from"] == "gpt":
            assert turn["value"] in run_text
        else:
            calls = json.loads(turn["value"])
            for c in calls if isinstance(calls, list) else [calls]:
                assert c["name"] in run_text
                assert all(json.dumps(v) in run_text for v in c["arguments"].values())
    observations = [t["value"] for t in record["conversations"] if t["from"] == "observation"]
    assert all(o in tok.decode(ids) and not any(o in r for r in runs) for o in observations)


@pytest.mark.parametrize("family", STABLE)
def test_batched_encoder_equals_reference_on_tool_data(families, family):
    records = [openai(i, with_system=family != "mistral") for i in range(8)]
    if family in ("qwen25", "deepseek"):
        records += [glaive(i) for i in range(4)] + [toolace(i) for i in range(4)] + [xlam(i) for i in range(4)]
    raws = [(i + 1, json.dumps(r)) for i, r in enumerate(records)]
    for backend, method in (("auto", "auto"), ("hf", "prefix")):
        enc = RecordEncoder(EncodeOptions(tokenizer_path=families[family], tokenizer_backend=backend,
                                          span_method=method))
        got = enc.encode_batch(raws, "t.jsonl")
        want = [enc.tok.encode_chat(conversation(r), "assistant", "t.jsonl", i) for i, r in enumerate(records)]
        assert np.array_equal(got.ids, np.concatenate([w[0] for w in want]))
        assert np.array_equal(got.loss_mask, np.concatenate([w[1] for w in want]))


# ---------------------------------------------------------------- refused, never rendered without the calls

LENIENT = ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
           "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NO_TOOL_ROLE = ("{% for m in messages %}{% if m.role != 'tool' %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
                "{% for c in m.tool_calls or [] %}{{ '<call>' + c.function.name + c.function.arguments | tojson }}"
                "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def refusal(tok, record, loss_on="assistant"):
    with pytest.raises(InputError) as e:
        tok.encode_chat(conversation(record), loss_on, "t.jsonl", 1)
    assert str(e.value).startswith("t.jsonl:1: ")
    return e.value


def test_a_template_without_tool_support_is_refused_not_rendered_without_the_calls(tmp_path):
    for name, template in (("example", None), ("lenient", LENIENT)):
        tok = ChatTokenizer(EXAMPLE_TOKENIZER if template is None else
                            with_template(str(tmp_path / name), EXAMPLE_TOKENIZER, template))
        err = refusal(tok, openai(1))
        assert err.reason == "template_no_tool_support" and err.field == "tools"
        record = openai(1)
        del record["tools"]
        err = refusal(tok, record)
        assert err.reason == "template_no_tool_support" and err.field == "messages[2]"
        assert "does not render tool calls" in str(err)
        err = refusal(tok, glaive(1))
        assert err.reason == "template_no_tool_support"


def test_a_template_that_skips_tool_results_is_refused(tmp_path):
    tok = ChatTokenizer(with_template(str(tmp_path / "t"), EXAMPLE_TOKENIZER, NO_TOOL_ROLE))
    assert tok.traits.tool_arguments is None  # its probe result is skipped too
    record = openai(2)
    del record["tools"]
    err = refusal(tok, record)
    assert err.reason == "template_no_tool_support"


def test_a_template_that_renders_some_text_nowhere_is_refused_by_field(families):
    record = openai(1)
    record["messages"][2]["content"] = "Let me check."  # Llama 3.1 renders the call only
    err = refusal(ChatTokenizer(families["llama3"]), record)
    assert err.reason == "template_dropped_content" and err.field == "messages[2]"
    assert "assistant content of messages[2] nowhere" in str(err)
    mistral = ChatTokenizer(families["mistral"])  # the system prompt goes with a final user turn only
    for loss_on in ("last-turn", "all"):
        err = refusal(mistral, openai(1, with_system=True), loss_on)
        assert err.reason == "template_dropped_content" and err.field == "messages[0]"
        assert "system content of messages[0] nowhere" in str(err)
    two = openai(1)
    two["messages"][2]["tool_calls"].append(two["messages"][2]["tool_calls"][0])
    assert refusal(ChatTokenizer(families["llama3"]), two).reason == "template_error"  # one call per turn


def test_llama3_tool_results_render_json_encoded_and_pass_the_check(families):
    tok = ChatTokenizer(families["llama3"])
    text, _ = tok.chat_text_and_spans(conversation(openai(0)), "assistant", "t.jsonl", 1)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"rain\\": true}"<|eot_id|>' in text


def test_pipeline_counts_tool_records_a_template_cannot_render(tmp_path, families):
    path = write_jsonl(tmp_path / "glaive.jsonl", [glaive(i) for i in range(6)] + [openai(0)])
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "out" / "a"), tokenizer=families["qwen25"],
                   pack_size=1024, progress=False, verify_masks=7))
    assert s["conversations"] == 7 and s["skipped"] == {} and s["verify_masks"]["checked"] == 7
    with pytest.raises(InputError, match=rf"^{path}:1: the chat template renders no tool definitions"):
        run(Config(inputs=[path], output_prefix=str(tmp_path / "out" / "b"), tokenizer=EXAMPLE_TOKENIZER,
                   pack_size=1024, progress=False))
    s = run(Config(inputs=[path, os.path.join(ROOT, "examples", "conversations.jsonl")],
                   output_prefix=str(tmp_path / "out" / "c"), tokenizer=EXAMPLE_TOKENIZER, pack_size=1024,
                   progress=False, skip_bad=True))
    assert s["skipped"] == {"template_no_tool_support": 7}
    assert s["skipped_examples"]["template_no_tool_support"].startswith(f"{path}:1: ")
