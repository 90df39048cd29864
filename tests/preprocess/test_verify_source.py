"""``--verify-masks`` checks the written sequences against the SOURCE record.

It passes on every shape and family done right, reports trained tokens per role, and -- the
point of it -- fails on each defect issue 20 found, re-introduced here by patching the mapping
or the mask rules the way the code before it behaved. The exact comparison with the reference
path agrees with the defective pipeline every time (both share its normalisation); only the
source check catches them.
"""

import json
import os

import pytest

from support.chat_families import with_template
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import tokenize as tokenize_stage
from megatron_sft_idx.preprocess.records import chat, encode, shapes as schemas, stops
from megatron_sft_idx.preprocess import Config, run
from support.sft_fixtures import alpaca, glaive, openai, reasoning, toolace, write_jsonl, xlam, xlam_raw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")


def go(tmp_path, records, tokenizer, name="ds", **kw):
    path = write_jsonl(tmp_path / f"{name}.jsonl", records)
    kw.setdefault("verify_masks", len(records))
    return run(Config(inputs=[path], output_prefix=str(tmp_path / "out" / name), tokenizer=tokenizer,
                      pack_size=2048, progress=False, tokenizer_backend="hf", span_method="prefix", **kw))


def fails(tmp_path, records, tokenizer, match, **kw):
    with pytest.raises(ShardError, match="fail the check against their source") as e:
        go(tmp_path, records, tokenizer, name="bad", **kw)
    message = str(e.value)
    assert match in message, message
    assert "differ from the reference" not in message  # the pipeline's own normalisation agrees with itself
    return message


# ---------------------------------------------------------------- done right, it passes and counts


@pytest.mark.parametrize("family,make", [("qwen25", glaive), ("qwen25", toolace), ("qwen25", xlam),
                                         ("qwen25", openai), ("deepseek", toolace), ("deepseek", openai),
                                         ("llama3", openai), ("mistral", lambda i: openai(i, with_system=False)),
                                         ("qwen25", xlam_raw), ("deepseek", xlam_raw)])
def test_tool_data_passes_and_counts_trained_tokens_per_role(tmp_path, families, family, make):
    s = go(tmp_path, [make(i) for i in range(6)], families[family])
    roles = s["verify_masks"]["trained_tokens_by_role"]
    assert s["verify_masks"]["checked"] == 6 and roles["tool_call"] > 0
    assert set(roles) <= {"assistant", "tool_call"}
    if make not in (xlam, xlam_raw):
        assert roles["assistant"] > 0


def test_alpaca_reasoning_and_plain_chat_pass(tmp_path, families):
    s = go(tmp_path, [alpaca(i, i % 2 == 0, system=True, history=i % 3 == 0) for i in range(8)], EXAMPLE_TOKENIZER,
           name="a")
    assert set(s["verify_masks"]["trained_tokens_by_role"]) == {"assistant"}
    s = go(tmp_path, [reasoning(i, inline=i % 2 == 0, turns=2) for i in range(6)], families["qwen3"], name="r",
           loss_on="per-turn", verify_masks=100)
    assert s["verify_masks"]["checked"] == 12 and s["verify_masks"]["trained_tokens_by_role"]["reasoning"] > 0
    s = go(tmp_path, [reasoning(i, turns=2) for i in range(6)], families["qwen3"], name="m", loss_on="per-turn",
           reasoning_loss="mask", verify_masks=100)
    assert "reasoning" not in s["verify_masks"]["trained_tokens_by_role"]


def test_reasoning_with_tools_passes_and_counts_reasoning(tmp_path, families):
    from support.sft_fixtures import glaive_reasoning

    for family, kw in (("qwen25", {}), ("qwen3", {"loss_on": "per-turn", "verify_masks": 20})):
        s = go(tmp_path, [glaive_reasoning(i) for i in range(5)], families[family], name=family, **kw)
        roles = s["verify_masks"]["trained_tokens_by_role"]
        assert roles["reasoning"] > 0 and roles["tool_call"] > 0 and roles["assistant"] > 0


def test_check_alone_verifies_a_sample_against_the_source(tmp_path, families):
    s = go(tmp_path, [glaive(i) for i in range(40)], families["qwen25"], verify_masks=0, check=True)
    assert s["verify_masks"]["checked"] == 16 and s["verify_masks"]["sample_of_check"]


# ---------------------------------------------------------------- each defect, re-introduced, fails

OLD_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                      "assistant": "assistant", "tool": "tool", "function": "tool"}
# renders every role it is given, as ChatML does: function_call / observation turns stay, untrained
EVERY_ROLE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# renders the roles it knows and skips the others: function_call / observation turns vanish
KNOWN_ROLES = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
               "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def old_sharegpt(mapper, record):
    """The mapping before issue 20: unknown ShareGPT roles passed through under their own names."""
    for i, t in enumerate(record["conversations"]):
        mapper.add({"role": OLD_SHAREGPT_ROLES.get(t["from"].lower(), t["from"]), "content": t["value"]},
                   f"conversations[{i}]")
    return mapper.done(None)


def old_chat_message(mapper, m, where):
    """The mapping before issue 20: role and content only (tool_calls and tools lost)."""
    mapper.add({"role": m["role"], "content": m.get("content") or ""}, where)


def old_alpaca(mapper, record):
    """``--prompt-key instruction --completion-key output`` before issue 20: the input lost."""
    mapper.add({"role": "user", "content": record["instruction"]}, "instruction")
    mapper.add({"role": "assistant", "content": record["output"]}, "output")
    return mapper.done(None)


def glaive_without_system(i):
    record = glaive(i)
    del record["system"], record["tools"]  # (the code before issue 20 lost these too; here: the turns alone)
    return record


def test_sharegpt_tool_turns_kept_but_untrained_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(schemas.sharegpt, "to_conversation", old_sharegpt)
    tok = with_template(str(tmp_path / "every"), EXAMPLE_TOKENIZER, EVERY_ROLE)
    fails(tmp_path, [glaive_without_system(i) for i in range(4)], tok,
          "conversations[1].value[0].name (tool call) is not trained, but the settings train it")


def test_sharegpt_system_and_tools_lost_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(schemas.sharegpt, "to_conversation", old_sharegpt)
    tok = with_template(str(tmp_path / "every"), EXAMPLE_TOKENIZER, EVERY_ROLE)
    fails(tmp_path, [glaive(i) for i in range(4)], tok, "system (system content 'You can look up the weather.') "
                                                        "is nowhere in the rendering")


def test_sharegpt_tool_turns_that_vanish_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(schemas.sharegpt, "to_conversation", old_sharegpt)
    monkeypatch.setattr(chat, "check_rendered", lambda *a, **k: None)  # the pipeline before its own check
    monkeypatch.setattr(encode, "check_rendered", lambda *a, **k: None)
    tok = with_template(str(tmp_path / "known"), EXAMPLE_TOKENIZER, KNOWN_ROLES)
    fails(tmp_path, [glaive_without_system(i) for i in range(4)], tok,
          "conversations[1].value[0].name (tool call 'get_weather') is nowhere in the rendering")


def test_openai_tool_calls_lost_before_rendering_fail(tmp_path, monkeypatch, families):
    monkeypatch.setattr(schemas.chat, "message", old_chat_message)
    records = [openai(i) for i in range(4)]
    for r in records:
        r["messages"][2]["content"] = ""
    # tools kept: the call's name is found in the tool definitions only, before the turn that made it
    fails(tmp_path, records, families["qwen25"], "messages[2].tool_calls[0].name (tool call 'get_weather') is out "
                                                  "of order in the rendering")
    monkeypatch.setattr(schemas.Mapper, "tools", lambda self, value, where: None)  # and the tools list lost
    fails(tmp_path, records, families["qwen25"], "messages[2].tool_calls[0].name (tool call 'get_weather') is "
                                                  "nowhere in the rendering")


def test_alpaca_input_lost_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(schemas.alpaca, "to_conversation", old_alpaca)
    fails(tmp_path, [alpaca(i, with_input=True) for i in range(4)], EXAMPLE_TOKENIZER,
          "input (user content 'The cat number 0 sleeps.') is nowhere in the rendering")


def gpteacher_without_context(mapper, record):
    """An Alpaca mapping that reads ``response`` but loses Dolly's ``context`` (the input)."""
    mapper.add({"role": "user", "content": record["instruction"]}, "instruction")
    mapper.add({"role": "assistant", "content": record["response"]}, "response")
    return mapper.done(None)


def test_alpaca_context_lost_or_response_mistrained_fails(tmp_path, monkeypatch):
    records = [{"instruction": f"Who wrote {i}?", "context": f"Ada wrote {i}.", "response": f"Ada {i}."}
               for i in range(4)]
    monkeypatch.setattr(schemas.alpaca, "to_conversation", gpteacher_without_context)
    fails(tmp_path, records, EXAMPLE_TOKENIZER, "context (user content 'Ada wrote 0.') is nowhere in the rendering")
    monkeypatch.setattr(schemas.alpaca, "to_conversation",   # the reply replaced by the instruction
                        lambda mapper, record: gpteacher_without_context(mapper, dict(
                            record, instruction=record["instruction"] + "\n" + record["context"],
                            response=record["instruction"])))
    fails(tmp_path, records, EXAMPLE_TOKENIZER, "response.content (assistant content 'Ada 0.') is nowhere in the "
                                                "rendering")


def keep_first_call(mapper, record):
    """An xLAM mapping that loses parallel calls: only the first of ``answers`` is kept."""
    calls = json.loads(record["answers"])[:1]
    mapper.add({"role": "user", "content": record["query"]}, "query")
    mapper.add({"role": "assistant", "content": "", "tool_calls": [mapper.tool_call(c, "answers[0]") for c in calls]},
               "answers")
    return mapper.done(mapper.tools(record.get("tools"), "tools"))


def test_xlam_parallel_call_lost_fails(tmp_path, monkeypatch, families):
    monkeypatch.setattr(schemas.xlam, "to_conversation", keep_first_call)
    fails(tmp_path, [xlam_raw(i) for i in range(4)], families["qwen25"], "answers[1]")


def test_tool_results_trained_fail(tmp_path, monkeypatch, families):
    real = chat.ChatTokenizer.prefix_spans

    def and_tool_results(self, conv, turns, full, path, line, *rest):  # a pipeline that trains tool results too
        spans = real(self, conv, turns, full, path, line)
        m, tools = conv.template_messages, conv.tools
        spans += [(len(self.render(m[:k], False, tools)), len(self.render(m[:k + 1], False, tools)))
                  for k in range(len(m)) if m[k]["role"] == "tool"]
        return sorted(spans)

    monkeypatch.setattr(chat.ChatTokenizer, "prefix_spans", and_tool_results)
    monkeypatch.setattr(chat, "refine_spans", lambda text, spans, *a, **k: list(spans))
    monkeypatch.setattr(stops.Stops, "check", lambda *a: None)   # (the source check, on its own)
    fails(tmp_path, [openai(i) for i in range(4)], families["qwen25"],
          "messages[3].content (tool result) is trained, but the settings never train it")


def test_template_inserted_empty_reasoning_trained_fails(tmp_path, monkeypatch, families):
    monkeypatch.setattr(chat, "refine_spans", lambda text, spans, *a, **k: list(spans))
    plain = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Hello {i}."}]}
             for i in range(4)]
    fails(tmp_path, plain, families["qwen3"], "an empty reasoning block is trained", loss_on="per-turn")


def test_reasoning_trained_under_mask_fails(tmp_path, monkeypatch, families):
    monkeypatch.setattr(chat, "refine_spans", lambda text, spans, *a, **k: list(spans))
    fails(tmp_path, [reasoning(i) for i in range(4)], families["qwen3"],
          "messages[2].reasoning (reasoning) is trained, but the settings never train it",
          loss_on="per-turn", reasoning_loss="mask")


def test_generation_prompt_trained_fails(tmp_path, monkeypatch):
    real = chat.ChatTokenizer.prefix_spans

    def early(self, conv, turns, full, path, line, *rest):
        return [(max(0, a - len("<|im_start|>assistant\n")), b) for a, b in real(self, conv, turns, full, path, line)]

    monkeypatch.setattr(chat.ChatTokenizer, "prefix_spans", early)
    records = [json.loads(line) for line in open(os.path.join(ROOT, "examples", "conversations.jsonl"))][:6]
    fails(tmp_path, records, EXAMPLE_TOKENIZER, "is trained")


def test_end_of_turn_untrained_fails(tmp_path, monkeypatch):
    real = chat.ChatTokenizer.prefix_spans

    def short(self, conv, turns, full, path, line, *rest):
        return [(a, b - len("<|im_end|>")) for a, b in real(self, conv, turns, full, path, line)]

    monkeypatch.setattr(chat.ChatTokenizer, "prefix_spans", short)
    monkeypatch.setattr(chat, "_LOADED", {})   # (a tokenizer an earlier test loaded learned its one-render spans unpatched)
    monkeypatch.setattr(tokenize_stage, "_ENCODERS", {})   # (and so did an encoder an earlier run kept)
    records = [json.loads(line) for line in open(os.path.join(ROOT, "examples", "conversations.jsonl"))][:6]
    with pytest.raises(ShardError, match="not a stop token"):   # every record's own stop check, first
        run(Config(inputs=[write_jsonl(tmp_path / "bad.jsonl", records)], output_prefix=str(tmp_path / "o1"),
                   tokenizer=EXAMPLE_TOKENIZER, pack_size=4096, progress=False))
    monkeypatch.setattr(stops.Stops, "check", lambda *a: None)   # and the source check, on its own
    fails(tmp_path, records, EXAMPLE_TOKENIZER, "does not end with an end-of-turn token")


def test_a_template_dropping_reasoning_is_refused_before_verify(tmp_path, families):
    """DeepSeek-R1's template strips reasoning from every turn: refused by name (or dropped on purpose)."""
    from megatron_sft_idx.preprocess.records.errors import InputError

    with pytest.raises(InputError, match="renders the reasoning of messages\\[2\\] nowhere"):
        go(tmp_path, [reasoning(i) for i in range(3)], families["deepseek"], name="r1")
    s = go(tmp_path, [reasoning(i) for i in range(3)], families["deepseek"], name="r1d", reasoning_loss="drop")
    assert "reasoning" not in s["verify_masks"]["trained_tokens_by_role"]
