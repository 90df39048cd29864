"""Qwen3's template under the default loss (``--loss-on assistant``).

Qwen3 renders ``<think>\\n\\n</think>\\n\\n`` in the final assistant turn when it has no reasoning,
and nothing in the same turn once another turn follows it, so every multi-turn conversation
rendered prefixes that were not prefixes of the whole. That block is never trained (the default
``--empty-reasoning-loss mask``), so the prefix rule allows exactly it: every turn is trained from
one rendering, as ``per-turn`` trains it, in one sequence instead of one per turn. A non-empty
reasoning block the template drops from the history is not trained: the turn is trained as the
one rendering shows it (``per-turn`` trains each turn with its reasoning).
"""

import json

import numpy as np
import pytest

from support.sft_fixtures import reasoning, write_jsonl
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.policy import LossPolicy


def talk(i, turns=3, final_thought=None):
    messages = [{"role": "system", "content": "Be kind."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {i}.{t}?"},
                     {"role": "assistant", "content": f"Answer {i}.{t}."}]
    if final_thought:
        messages[-1]["reasoning_content"] = final_thought
    return messages


def trained_texts(tok, ids, mask):
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


def test_every_turn_is_trained_and_the_final_empty_block_is_not(families):
    tok = ChatTokenizer(families["qwen3"])
    ids, mask = tok.encode_chat(talk(1), "assistant", "q.jsonl", 1)
    text = tok.decode(ids)
    assert text.count("<think>\n\n</think>") == 1 and text.rstrip().endswith("Answer 1.2.<|im_end|>")
    assert trained_texts(tok, ids, mask) == ["Answer 1.0.<|im_end|>", "Answer 1.1.<|im_end|>",
                                             "Answer 1.2.<|im_end|>"]
    # the final turn's own reasoning: trained with it, the earlier turns as before
    ids, mask = tok.encode_chat(talk(1, final_thought="Be short."), "assistant", "q.jsonl", 1)
    assert trained_texts(tok, ids, mask)[-1] == "<think>\nBe short.\n</think>\n\nAnswer 1.2.<|im_end|>"


def test_reasoning_the_history_drops_is_not_trained_and_the_rest_is(families):
    """The history rule: a turn whose reasoning the template drops once a user turn follows is
    trained as the one rendering shows it (its answer), never rendered per turn."""
    tok = ChatTokenizer(families["qwen3"])
    with_history = talk(2)
    with_history[2]["reasoning_content"] = "A thought the history drops."
    ids, mask = tok.encode_chat(with_history, "assistant", "q.jsonl", 3)
    assert "A thought" not in tok.decode(ids)
    assert trained_texts(tok, ids, mask) == ["Answer 2.0.<|im_end|>", "Answer 2.1.<|im_end|>",
                                             "Answer 2.2.<|im_end|>"]
    # empty blocks trained on purpose: the history's turns were not written with one, so no rule applies
    with pytest.raises(InputError, match="not render conversation prefixes"):
        tok.encode_chat(talk(2), "assistant", "q.jsonl", 3, LossPolicy(empty_reasoning="train"))


def test_the_pipeline_stores_each_turn_once_and_the_source_check_agrees(tmp_path, families):
    records = [{"messages": talk(i, turns=1 + i % 3)} for i in range(9)] + [reasoning(i) for i in range(3)]
    path = write_jsonl(tmp_path / "q.jsonl", records)
    tokens = {}
    for loss_on in ("assistant", "per-turn"):
        s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / loss_on), tokenizer=families["qwen3"],
                       pack_size=1024, progress=False, loss_on=loss_on, verify_masks=100))
        assert s["verify_masks"]["failures"] == 0 and not s["skipped"]
        tokens[loss_on] = s["tokens"]
        if loss_on == "assistant":
            assert s["conversations"] == len(records)
            assert s["verify_masks"]["trained_tokens_by_role"]["reasoning"] > 0
    assert tokens["assistant"] < tokens["per-turn"]
