"""Loss policies for what modern data holds: reasoning (train, mask, drop), the empty reasoning
blocks templates insert, tool calls (train, mask), truncation inside reasoning; recorded in the
store, so a resumed run with another policy is refused."""

import json

import numpy as np
import pytest

from support.chat_families import QWEN3, with_template
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.inputs import parse_record
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.policy import LossPolicy
from megatron_sft_idx.reader import MMapIndexedDataset
from support.sft_fixtures import openai, reasoning, write_jsonl, xlam

EOT = "<|im_end|>"


def conversation(record):
    return parse_record(json.dumps(record), "r.jsonl", 1, "auto", "prompt", "completion")[1]


def runs(tok, ids, mask):
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


def per_turn(tok, record, **policy):
    """(rendering, trained runs) of each per-turn sequence of ``record``."""
    p = LossPolicy(**policy)
    out = []
    for text, spans in tok.turn_texts_and_spans(conversation(record), "r.jsonl", 1, p):
        enc = tok.backend.encode(text, add_special_tokens=False)
        starts = np.asarray(enc.offsets)[:, 0]
        trained = np.zeros(len(enc.ids), dtype=np.uint8)
        for a, b in spans:
            trained[np.searchsorted(starts, a):np.searchsorted(starts, b)] = 1
        mask = np.zeros_like(trained)
        mask[:-1] = trained[1:]
        out.append((text, runs(tok, np.asarray(enc.ids), mask)))
    return out


@pytest.mark.parametrize("inline", [True, False])
def test_qwen3_trains_each_turn_with_its_reasoning_and_drops_it_from_history(families, inline):
    tok = ChatTokenizer(families["qwen3"])
    (first, r1), (second, r2) = per_turn(tok, reasoning(2, inline=inline, turns=2))
    assert r1 == ["<think>\nI add 2 and 5 to get 7.\n</think>\n\nThe sum is 7." + EOT]
    assert r2 == ["<think>\nI add 3 and 5 to get 8.\n</think>\n\nThe sum is 8." + EOT]
    assert "I add 2 and 5" not in second and "The sum is 7." in second  # history: the answer only


def test_reasoning_masked_is_rendered_not_trained(families):
    tok = ChatTokenizer(families["qwen3"])
    (text, trained), = per_turn(tok, reasoning(2), reasoning="mask")
    assert "<think>\nI add 2 and 5 to get 7.\n</think>" in text and trained == ["The sum is 7." + EOT]


def test_reasoning_dropped_is_gone_and_the_inserted_empty_block_masked(families):
    tok = ChatTokenizer(families["qwen3"])
    (text, trained), = per_turn(tok, reasoning(2), reasoning="drop")
    assert "I add" not in text and "<think>\n\n</think>\n\nThe sum is 7." in text
    assert trained == ["The sum is 7." + EOT]


def test_empty_blocks_a_template_inserts_are_masked_by_default(families):
    tok = ChatTokenizer(families["qwen3"])
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    (text, trained), = per_turn(tok, plain)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello." + EOT + "\n")
    assert trained == ["Hello." + EOT]
    (_, trained), = per_turn(tok, plain, empty_reasoning="train")
    assert trained == ["<think>\n\n</think>\n\nHello." + EOT]


# a thinking template whose generation prompt opens the block (as DeepSeek-R1's updated one does)
OPENED = QWEN3.replace("{{ '<|im_start|>assistant\\n' }}{% if enable_thinking",
                       "{{ '<|im_start|>assistant\\n<think>\\n' }}{% if enable_thinking")


def test_a_block_opened_by_the_generation_prompt_is_found(tmp_path, families):
    tok = ChatTokenizer(with_template(str(tmp_path / "opened"), families["qwen3"], OPENED))
    assert tok.render([{"role": "user", "content": "q"}], True).endswith("<think>\n")
    (_, trained), = per_turn(tok, reasoning(2), reasoning="mask")
    assert trained == ["The sum is 7." + EOT]
    (_, trained), = per_turn(tok, reasoning(2))
    assert trained == ["I add 2 and 5 to get 7.\n</think>\n\nThe sum is 7." + EOT]


def test_masking_reasoning_a_rendering_does_not_delimit_is_refused(families):
    tok = ChatTokenizer(families["qwen3"])
    with pytest.raises(InputError, match="cannot mask the reasoning of messages\\[2\\]") as e:
        tok.turn_texts_and_spans(conversation(reasoning(2)), "r.jsonl", 1,
                                 LossPolicy(reasoning="mask", tags=("<reason>", "</reason>")))
    assert e.value.reason == "reasoning_not_located"


def test_tool_calls_masked_train_the_answers_only(families):
    tok = ChatTokenizer(families["qwen25"])
    mask_calls = LossPolicy(tool_calls="mask")
    ids, mask = tok.encode_chat(conversation(openai(1)), "assistant", "r.jsonl", 1, mask_calls)
    assert runs(tok, ids, mask) == ["No, it is dry." + EOT]
    with pytest.raises(InputError, match="--tool-call-loss mask masks all 1 assistant turns") as e:
        tok.encode_chat(conversation(xlam(1)), "assistant", "r.jsonl", 1, mask_calls)
    assert e.value.reason == "only_masked_tool_calls" and "--skip-bad" in str(e.value)


def test_policies_in_the_pipeline_summary_and_shard(tmp_path, families):
    path = write_jsonl(tmp_path / "r.jsonl", [reasoning(i, turns=2) for i in range(5)])
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / "m"), tokenizer=families["qwen3"],
                   loss_on="per-turn", reasoning_loss="mask", progress=False, verify_masks=10))
    assert s["loss_policy"]["reasoning"] == "mask" and s["verify_masks"]["checked"] == 10
    assert MMapIndexedDataset(s["outputs"][0]).metadata.extra["loss_policy"] == {"reasoning": "mask"}
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / "d"), tokenizer=families["qwen3"],
                   loss_on="per-turn", progress=False))
    assert "loss_policy" not in MMapIndexedDataset(s["outputs"][0]).metadata.extra  # defaults: absent


def test_resume_with_another_policy_is_refused(tmp_path, families):
    path = write_jsonl(tmp_path / "r.jsonl", [reasoning(i) for i in range(5)])
    store = str(tmp_path / "store")
    base = dict(inputs=[path], tokenizer=families["qwen3"], loss_on="per-turn", progress=False, store=store)
    run(Config(output_prefix=str(tmp_path / "o" / "a"), **base))
    with pytest.raises(ShardError, match="made with other tokenizer and encoding settings"):
        run(Config(output_prefix=str(tmp_path / "o" / "b"), resume=True, reasoning_loss="mask", **base))


@pytest.mark.parametrize("cut_loss", ["keep", "drop"])
def test_truncation_inside_reasoning_follows_truncated_turn_loss(tmp_path, families, cut_loss):
    long_thought = " ".join(f"step {i} adds one more." for i in range(80))
    records = [{"messages": [{"role": "user", "content": "Count."},
                             {"role": "assistant", "content": "Done.", "reasoning_content": long_thought}]},
               reasoning(1)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    s = run(Config(inputs=[path], output_prefix=str(tmp_path / "o" / cut_loss), tokenizer=families["qwen3"],
                   loss_on="last-turn", pack_size=128, overlong="truncate", truncated_turn_loss=cut_loss,
                   progress=False))
    tok = ChatTokenizer(families["qwen3"])
    ds = MMapIndexedDataset(s["outputs"][0])
    seqs = []
    for p in range(len(ds)):
        pack = ds[p]
        b = list(pack.seq_start_id) + [len(pack.input_ids)]
        seqs += [(np.asarray(pack.input_ids[b[k]:b[k + 1]]), np.asarray(pack.loss_mask[b[k]:b[k + 1]]))
                 for k in range(len(b) - 1)]
    cut = [(ids, mask) for ids, mask in seqs if ids.size == 128]
    if cut_loss == "keep":
        (ids, mask), = cut
        trained = runs(tok, ids, mask)
        assert len(trained) == 1 and trained[0].startswith("<think>\nstep 0") and "</think>" not in trained[0]
        assert s["truncated_turns_cut"] == 1
    else:  # the cut reply is masked whole; nothing else trained: the conversation is dropped and counted
        assert not cut and s["skipped"] == {"overlong_untrainable_after_truncation": 1}
