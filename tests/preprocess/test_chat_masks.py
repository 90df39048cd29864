"""Assistant loss masks: every loss mode, templates with and without {% generation %} markers."""

import json
import os
import shutil

import numpy as np
import pytest

from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.masks import encode_tokens, label_aligned, label_aligned_all
from megatron_sft_idx.preprocess.records.errors import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
EOT = "<|im_end|>"


def conversations(n=40):
    with open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8") as f:
        return [json.loads(next(f))["messages"] for _ in range(n)]


def tokenizer_variant(tmp_path, name, template):
    """A copy of the example tokenizer with another chat template."""
    out = tmp_path / name
    shutil.copytree(EXAMPLE_TOKENIZER, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ChatTokenizer(str(out))


NO_MARKERS = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a default system prompt injected when none is given: prefixes still render consistently
DEFAULT_SYSTEM = (
    "{% if messages and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}"
    + NO_MARKERS
)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(EXAMPLE_TOKENIZER)


def trained_runs(tok, ids, mask):
    """Decoded contiguous runs of target tokens (label-aligned: mask[j] trains token j+1)."""
    assert mask[-1] == 0
    targets = np.flatnonzero(mask) + 1
    runs = np.split(targets, np.flatnonzero(np.diff(targets) != 1) + 1) if targets.size else []
    return [tok.decode(ids[r]) for r in runs]


def expected_runs(messages, loss_on):
    contents = [m["content"] + EOT for m in messages if m["role"] == "assistant"]
    return contents[-1:] if loss_on == "last-turn" else contents


@pytest.mark.parametrize("loss_on", ["assistant", "last-turn"])
@pytest.mark.parametrize("template", ["markers", "no_markers", "default_system"])
def test_trained_text_is_exactly_assistant_content_plus_eot(tmp_path, tok, loss_on, template):
    t = tok if template == "markers" else tokenizer_variant(
        tmp_path, template, NO_MARKERS if template == "no_markers" else DEFAULT_SYSTEM)
    for i, messages in enumerate(conversations()):
        ids, mask = t.encode_chat(messages, loss_on, "conv.jsonl", i + 1)
        assert ids.dtype == np.int64 and mask.dtype == np.uint8 and ids.shape == mask.shape
        assert trained_runs(t, ids, mask) == expected_runs(messages, loss_on)


def test_masks_agree_with_hf_generation_markers(tok):
    """Cross-check with transformers' own {% generation %} assistant mask (token-aligned)."""
    for messages in conversations(25):
        ids, mask = tok.encode_chat(messages, "assistant", "c", 1)
        hf = tok.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        assert ids.tolist() == list(hf["input_ids"])
        hf_mask = np.asarray(hf["assistant_masks"], dtype=np.uint8)
        assert np.array_equal(mask[:-1], hf_mask[1:])


def test_loss_on_all_trains_every_next_token(tok):
    messages = conversations(1)[0]
    ids, mask = tok.encode_chat(messages, "all", "c", 1)
    assert mask[:-1].all() and mask[-1] == 0
    assert tok.decode(ids) == tok.render(messages)


def test_rejected_role_is_an_input_error_with_file_and_line(tok):
    messages = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(InputError, match=r"^data.jsonl:17: the chat template rejected") as e:
        tok.encode_chat(messages, "assistant", "data.jsonl", 17)
    assert e.value.reason == "template_error"


def test_conversation_without_assistant_turn_is_refused(tok):
    with pytest.raises(InputError, match="all zero") as e:
        tok.encode_chat([{"role": "user", "content": "hi"}], "assistant", "d.jsonl", 3)
    assert e.value.reason == "no_trainable_tokens" and e.value.path == "d.jsonl:3"


def test_prompt_completion_trains_completion_and_eos(tok):
    ids, mask = tok.encode_prompt("Question: why? Answer:", " Because.", "p.jsonl", 1)
    assert trained_runs(tok, ids, mask) == [" Because." + EOT]


def test_pretokenized_masks_are_shifted_to_label_alignment():
    ids, mask = encode_tokens([5, 6, 7, 8], None, 2, 10, "t.jsonl", 1)
    assert mask.tolist() == [0, 1, 1, 0]  # predicting tokens 2 and 3
    ids, mask = encode_tokens([5, 6, 7, 8], [0, 0, 0, 1], None, 10, "t.jsonl", 1)
    assert mask.tolist() == [0, 0, 1, 0]
    with pytest.raises(InputError, match="outside the vocabulary") as e:
        encode_tokens([5, 12], None, 1, 10, "t.jsonl", 9)
    assert e.value.path == "t.jsonl:9" and e.value.reason == "token_out_of_vocab"
    with pytest.raises(InputError, match="all zero"):
        encode_tokens([5, 6], [1, 0], None, 10, "t.jsonl", 2)


def test_tokenizer_identity_is_stable_and_hashes_template(tmp_path, tok):
    a = tok.identity()
    assert a == ChatTokenizer(EXAMPLE_TOKENIZER).identity()
    assert a["vocab_size"] == 1024 and a["pad_id"] == 0 and a["eos_id"] == 2
    other = tokenizer_variant(tmp_path, "other", NO_MARKERS).identity()
    assert other["chat_template_sha256"] != a["chat_template_sha256"]
    assert other["files_sha256"] != a["files_sha256"]
    # a bare tokenizer.json path loads too
    assert ChatTokenizer(os.path.join(EXAMPLE_TOKENIZER, "tokenizer.json")).vocab_size == 1024


def test_batch_stop_check_and_label_alignment_equal_each_texts_own(tok):
    """A batch's stop flags (``Stops.unstopped``) and label-aligned masks (``label_aligned_all``)
    are each text's own ``Stops.check`` refusal and ``label_aligned`` mask (or refusal), on random
    batches holding empty texts, one-token texts, runs ending on a stop, on another token, and at
    a text's end."""
    rng = np.random.default_rng(45)
    stops = tok.stops
    special, plain = sorted(stops.ids), [i for i in range(5, 400) if i not in stops.ids]
    for _ in range(200):
        sizes = rng.choice([0, 1, 2, 5, 17], size=rng.integers(1, 9))
        offsets = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        ids = np.where(rng.random(offsets[-1]) < 0.3, rng.choice(special, offsets[-1]),
                       rng.choice(plain, offsets[-1])).astype(np.int64)
        trained = (rng.random(offsets[-1]) < 0.5).astype(np.uint8)
        flags = stops.unstopped(ids, trained, offsets)
        masks, untrained = label_aligned_all(trained, offsets)
        for k in range(sizes.size):
            a, b = offsets[k], offsets[k + 1]
            try:
                stops.check(ids[a:b], trained[a:b], "b.jsonl", k, tok.decode)
                refused = False
            except InputError as err:
                refused = err.reason == "template_error"
            assert bool(flags[k]) == refused
            try:
                want = label_aligned(trained[a:b], "b.jsonl", k)
            except InputError as err:
                assert untrained[k] and err.reason == "no_trainable_tokens"
            else:
                assert not untrained[k] and masks.dtype == np.uint8 and np.array_equal(masks[a:b], want)
