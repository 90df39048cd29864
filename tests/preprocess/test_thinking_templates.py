"""Thinking templates (history-dependent): trained as rendered where the history rule applies, else
refused by --loss-on assistant with a hint that names what works; --loss-on last-turn and per-turn
give exact masks, checked by --verify-masks.

The two templates are written for these tests (not copied from upstream); they behave as the
Qwen3 and DeepSeek-R1 families do: reasoning is rendered only for the final turn(s) and dropped
from earlier assistant turns, so a turn renders differently once a later turn follows it.
"""

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import RecordEncoder
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.encode import EncodeOptions
from megatron_sft_idx.reader import MMapIndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")

# Qwen3-like: reasoning kept only for assistant turns after the last user message.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = m['content'] -%}{%- set thought = '' -%}"
    "{%- if '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set answer = answer.split('</think>')[-1].strip() -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and thought -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# DeepSeek-R1-like: every assistant turn but the final message loses its reasoning.
R1_STYLE = (
    "{{ '<|endoftext|>' }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}{{ '<|im_start|>User: ' + m['content'] }}"
    "{%- else -%}"
    "{%- set answer = m['content'] -%}"
    "{%- if not loop.last and '</think>' in answer -%}{%- set answer = answer.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>Assistant: ' + answer + '<|im_end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>Assistant: ' }}{%- endif -%}"
)
TEMPLATES = {"qwen3": QWEN3_STYLE, "r1": R1_STYLE}


def thinking_conversation(i, turns=2):
    messages = [{"role": "system", "content": "Think, then answer."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {i}.{t}: what is {t} + {i}?"},
                     {"role": "assistant", "content": f"<think>\nAdd {t} and {i}.\n</think>\n\nIt is {t + i}."}]
    return messages


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name, template in TEMPLATES.items():
        d = tmp_path_factory.mktemp(name) / "tok"
        shutil.copytree(EXAMPLE_TOKENIZER, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def trained_texts(tok, ids, mask):
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


def test_assistant_mode_trains_the_history_as_rendered_where_the_rule_applies(tokenizers):
    """Qwen3-style: the history's reasoning block is the block the final turn shows, removed whole:
    each turn is trained as the one rendering shows it (docs/INPUTS.md, "Thinking templates")."""
    tok = ChatTokenizer(tokenizers["qwen3"])
    ids, mask = tok.encode_chat(thinking_conversation(1), "assistant", "think.jsonl", 4)
    assert "Add 0 and 1" not in tok.decode(ids)
    assert trained_texts(tok, ids, mask) == ["It is 1.<|im_end|>",
                                             "<think>\nAdd 1 and 1.\n</think>\n\nIt is 2.<|im_end|>"]


@pytest.mark.parametrize("name", ["r1"])
def test_assistant_mode_refuses_and_names_the_modes_that_work(tokenizers, name):
    """R1-style: the history keeps the whitespace after the block it strips, so no rule makes the
    prefix the history's: refused, naming what works."""
    tok = ChatTokenizer(tokenizers[name])
    with pytest.raises(InputError, match="not render conversation prefixes") as e:
        tok.encode_chat(thinking_conversation(1), "assistant", "think.jsonl", 4)
    message = str(e.value)
    assert "--loss-on last-turn" in message and "--loss-on per-turn" in message and "--loss-on all" in message
    assert e.value.path == "think.jsonl:4" and e.value.reason == "template_error"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_last_turn_trains_the_final_turn_with_its_reasoning(tokenizers, name):
    tok = ChatTokenizer(tokenizers[name])
    messages = thinking_conversation(3)
    ids, mask = tok.encode_chat(messages, "last-turn", "t.jsonl", 1)
    assert tok.decode(ids) == tok.render(messages)
    final = messages[-1]["content"]
    want = ("<think>\nAdd 1 and 3.\n</think>\n\nIt is 4.<|im_end|>" if name == "qwen3" else final + "<|im_end|>")
    assert trained_texts(tok, ids, mask) == [want]
    # the earlier turn is rendered without its reasoning, as the template renders history
    assert "Add 0 and 3" not in tok.decode(ids)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_per_turn_gives_one_sequence_per_turn_as_the_template_renders_it(tmp_path, tokenizers, name):
    tok = ChatTokenizer(tokenizers[name])
    records = [thinking_conversation(i, turns=1 + i % 3) for i in range(12)]
    data = tmp_path / "think.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    outs = {}
    for backend, method in (("auto", "auto"), ("hf", "prefix")):
        out = str(tmp_path / f"out_{backend}")
        s = run(Config(inputs=[str(data)], output_prefix=out, tokenizer=tokenizers[name], pack_size=512,
                       loss_on="per-turn", verify_masks=100, progress=False, tokenizer_backend=backend,
                       span_method=method))
        assert s["conversations"] == sum(1 + i % 3 for i in range(12))
        assert s["verify_masks"]["checked"] == s["conversations"] and s["verify_masks"]["failures"] == 0
        outs[backend] = [open(out + suffix, "rb").read() for suffix in (".bin", ".loss.bin", ".seq.bin", ".idx")]
    assert outs["auto"] == outs["hf"]
    # every sequence is a prefix of some conversation rendered as ending at its turn
    ds = MMapIndexedDataset(str(tmp_path / "out_auto"))
    seen = set()
    for p in range(len(ds)):
        pack = ds[p]
        b = pack.seq_boundaries
        for k in range(len(b) - 1):
            ids, mask = np.asarray(pack.input_ids[b[k]:b[k + 1]]), np.asarray(pack.loss_mask[b[k]:b[k + 1]])
            seen.add(tok.decode(ids))
            assert len(trained_texts(tok, ids, mask)) == 1
    want = {tok.render(m[:j + 1]) for m in records for j in range(len(m)) if m[j]["role"] == "assistant"}
    assert seen == want


_texts = st.lists(st.sampled_from(list("ab <>/\n") + ["<think>", "</think>", "<|im_end|>", "é"]),
                  max_size=8).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_texts, _texts, _texts), min_size=1, max_size=3), st.sampled_from(sorted(TEMPLATES)))
def test_per_turn_batched_equals_reference(tokenizers, turns, name):
    messages = []
    for user, thought, answer in turns:
        messages += [{"role": "user", "content": user},
                     {"role": "assistant", "content": f"<think>{thought}</think>{answer}"}]
    opts = EncodeOptions(tokenizer_path=tokenizers[name], loss_on="per-turn", skip_bad=True)
    got = RecordEncoder(opts).encode_batch([(1, json.dumps({"messages": messages}))], "h.jsonl")
    tok = ChatTokenizer(tokenizers[name])
    want_ids, want_masks = [], []
    for k in [j for j, m in enumerate(messages) if m["role"] == "assistant"]:
        try:
            ids, mask = tok.encode_chat(messages[:k + 1], "last-turn", "h.jsonl", 1)
        except InputError:  # a record is written whole or not at all
            want_ids, want_masks = [], []
            break
        want_ids.append(ids)
        want_masks.append(mask)
    assert got.lengths.tolist() == [a.size for a in want_ids]
    if want_ids:
        assert np.array_equal(got.ids, np.concatenate(want_ids))
        assert np.array_equal(got.loss_mask, np.concatenate(want_masks))
