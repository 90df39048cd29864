"""One-render spans (``--span-method auto``) are qualified on every feature the data holds.

The plain probes (roles, system prompts, awkward contents, empty replies) qualify a template;
tool definitions, tool calls (single and parallel), tool results and reasoning are qualified on
their own probes, and a conversation holding a feature that did not qualify is spanned by the
reference (prefix renders). So ``auto`` gives the bytes ``prefix`` gives on every shape of input
and every template family, by either tokenizer backend -- including a template that picks a
tool-call turn's end token by looking at the next message (``loop.nextitem``), which the plain
probes alone trusted and left that end token untrained.
"""

import json
import os

import numpy as np
import pytest

from support.chat_families import FAMILIES, with_template
from support.sft_fixtures import (alpaca, glaive, glaive_reasoning, openai, parts, reasoning, toolace, xlam,
                                  xlam_raw)
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.records import spans
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.spans import SpanLocator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")

# ChatML with tools, prefix-stable, whose tool-call turn ends with <|endoftext|> unless a non-tool
# message follows: the end token is printed after the template looked at the next message.
NEXTITEM = r"""
{%- if tools %}{{ '<|im_start|>system\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}
{%- for m in messages %}
  {%- if m.role == 'assistant' and m.tool_calls is defined %}
    {{- '<|im_start|>assistant\n' + m.content }}
    {%- for c in m.tool_calls %}{{ '<tool_call>' + c.function.name + ' ' + c.function.arguments | tojson + '</tool_call>' }}{% endfor %}
    {%- if loop.nextitem is defined and loop.nextitem.role != 'tool' %}{{ '<|im_end|>' }}{% else %}{{ '<|endoftext|>' }}{% endif %}
    {{- '\n' }}
  {%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""


@pytest.fixture(scope="module")
def nextitem(tmp_path_factory):
    return with_template(str(tmp_path_factory.mktemp("nextitem") / "tok"), EXAMPLE_TOKENIZER, NEXTITEM)


def corpus():
    """Every input shape the mapping reads, with and without tools, reasoning and system prompts."""
    plain = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Hi {i}."},
                           {"role": "assistant", "content": f"Hello {i}."}, {"role": "user", "content": "Bye."},
                           {"role": "assistant", "content": "" if i % 2 else "Bye."}]} for i in range(3)]
    out = plain + [glaive(i) for i in range(3)] + [glaive_reasoning(i) for i in range(2)]
    out += [xlam(i) for i in range(2)] + [xlam_raw(i) for i in range(2)] + [toolace(i) for i in range(2)]
    out += [openai(i, with_system=i % 2 == 0) for i in range(3)]
    out += [reasoning(i, inline=i % 2 == 0, turns=1 + i % 2) for i in range(4)]
    out += [alpaca(i, i % 2 == 0, system=i % 3 == 0, history=i % 2 == 1) for i in range(3)] + [parts(i) for i in range(2)]
    return [(i + 1, json.dumps(r)) for i, r in enumerate(out)]


def encode(tok_dir, loss_on, method, backend, records):
    enc = RecordEncoder(EncodeOptions(tokenizer_path=tok_dir, vocab_size=None, loss_on=loss_on, input_format="auto",
                                      prompt_key="prompt", completion_key="completion", skip_bad=True,
                                      tokenizer_backend=backend, span_method=method))
    got = enc.encode_batch(records, "corpus.jsonl")
    return (got.ids.tobytes(), got.loss_mask.tobytes(), got.lengths.tolist(), got.lines.tolist(), got.skipped), enc


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["example", "nextitem"])
@pytest.mark.parametrize("loss_on", ["assistant", "last-turn"])
def test_auto_equals_prefix_on_every_shape_and_family(families, nextitem, family, loss_on):
    tok_dir = {"example": EXAMPLE_TOKENIZER, "nextitem": nextitem}.get(family) or families[family]
    records = corpus()
    want, _ = encode(tok_dir, loss_on, "prefix", "hf", records)
    assert want[2], "the family encodes part of the corpus at least"
    for method, backend in (("auto", "auto"), ("auto", "hf"), ("prefix", "auto")):
        got, enc = encode(tok_dir, loss_on, method, backend, records)
        assert got == want, (family, loss_on, method, backend)
        if backend == "auto":   # the batched tokenizer's own path, not a fallback to the reference
            assert enc.stats["fast_tokens"] > 0
        if method == "auto" and family in ("llama3", "qwen25", "example", "nextitem"):
            assert enc.stats["one_render"] > 0   # (and the features not qualified went to prefix renders,
            # or to the main-pass method where it qualifies them: records/main_pass.py)
            assert enc.stats["prefix_render"] > 0 or family == "example" or enc.locator.wider is not None


def trained_texts(tok, ids, mask):
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


def test_a_next_message_end_token_disqualifies_tool_calls_only(nextitem, monkeypatch):
    locator = SpanLocator(ChatTokenizer(nextitem))
    assert locator.enabled                       # plain conversations still take one render
    assert "calls" not in locator.qualified and "reasoning" in locator.qualified
    records = [(i + 1, json.dumps(openai(i, with_system=False))) for i in range(4)]
    records += [(9, json.dumps({"messages": [{"role": "user", "content": "Hi."},
                                             {"role": "assistant", "content": "Hello."}]}))]
    got, enc = encode(nextitem, "assistant", "auto", "hf", records)
    assert enc.stats["one_render"] == 1 and enc.stats["prefix_render"] == 4
    assert got == encode(nextitem, "assistant", "prefix", "hf", records)[0]
    ids = np.frombuffer(got[0], dtype=np.int64)[:got[2][0]]
    mask = np.frombuffer(got[1], dtype=np.uint8)[:got[2][0]]
    call_turn = trained_texts(enc.tok, ids, mask)[0]
    assert call_turn.startswith("<tool_call>get_weather") and call_turn.endswith("</tool_call><|endoftext|>")

    # the defect: every feature trusted on the plain probes -> the end token is left untrained,
    # and the conversations the sample does not check are written that way
    monkeypatch.setattr(spans, "features", lambda *a: frozenset())
    with pytest.raises(ShardError, match="one-render assistant spans differ"):
        encode(nextitem, "assistant", "auto", "hf", records)
    monkeypatch.setattr("megatron_sft_idx.preprocess.records.encode.SAMPLE_EVERY", 1 << 30)
    bad, _ = encode(nextitem, "assistant", "auto", "hf", [(0, json.dumps({"messages": [{"role": "user", "content": "x"}]}))] + records)
    assert bad[1] != got[1]


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["example"])
def test_the_feature_probes_are_adapted_to_each_template(families, family):
    tok = ChatTokenizer(EXAMPLE_TOKENIZER if family == "example" else families[family])
    locator = SpanLocator(tok)
    for feature in spans.FEATURES:
        probes = locator._feature_probes(feature)
        if feature in locator.qualified:
            assert "agrees" in {locator._agrees(m, t) for m, t in probes}
        for messages, tools in probes:   # every probe holds its feature, as the template is given it
            assert feature in spans.features(messages, tools, "<think>")


def test_a_plain_conversations_features_are_found_without_walking_its_keys():
    """``features(..., plain=True)`` (a conversation of role/content messages as given, no tools)
    equals the full walk on every plain conversation the mapping makes of the corpus, one with
    reasoning written inside a reply among them; a conversation that is not plain is never told so."""
    inline = {"messages": [{"role": "user", "content": "Why?"},
                           {"role": "assistant", "content": "Because <think>so</think> it is."}]}
    records = corpus() + [(99, json.dumps(inline))]
    kinds = {True: 0, False: 0}
    for line, raw in records:
        kind, conv = parse_record(raw, "corpus.jsonl", line, "auto", "prompt", "completion")
        if kind != "chat":
            continue
        kinds[conv.plain] += 1
        full = spans.features(conv.messages, conv.tools, "<think>")
        if conv.plain:
            assert spans.features(conv.messages, conv.tools, "<think>", plain=True) == full
            assert all(set(m) == {"role", "content"} for m in conv.messages) and not conv.tools
    assert kinds[True] >= 3 and kinds[False] >= 10
    assert spans.features(json.loads(json.dumps(inline))["messages"], None, "<think>", plain=True) == {"reasoning"}
