"""Pinned outputs of the preprocessing main job: shard digests built by the reference path.

The digests in ``golden/preprocess_digests.json`` were produced by the prefix-render /
per-conversation ``encode`` path (the code before the batched encoder existed); the
batched encoder must reproduce them byte for byte. Regenerate only when the bytes
are *meant* to change:

    PYTHONPATH=. python tests/support/preprocess_identity.py --write

Each case is (inputs, chat template, loss mode); the digest covers ``.bin``,
``.loss.bin``, ``.seq.bin`` and ``.idx`` (the ``.seq.idx`` holds paths and versions,
so its metadata is compared through its statistics instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
EXAMPLE_INPUTS = [os.path.join(ROOT, "examples", "conversations.jsonl"),
                  os.path.join(ROOT, "examples", "conversations_sharegpt.jsonl")]
DIGESTS = os.path.join(ROOT, "tests", "golden", "preprocess_digests.json")

NO_MARKERS = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a default system prompt injected when none is given: prefixes still render consistently
DEFAULT_SYSTEM = (
    "{% if messages and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}" + NO_MARKERS
)
# Llama-2 style: the system prompt folded into the first user turn, a space before answers
FOLDED_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set sys = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if m['role'] == 'user' %}{{ '<|im_start|>[INST] ' + (sys + ' ' if loop.first and sys else '') + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
)
# the generation prompt ends in a space, so the first answer token may straddle the span start;
# used with a ByteLevel post-processor that trims offsets (as many production tokenizers have)
SPACE_PROMPT = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant: ' }}{% endif %}"
)
TEMPLATES = {"markers": None, "no_markers": NO_MARKERS, "default_system": DEFAULT_SYSTEM,
             "folded_system": FOLDED_SYSTEM, "space_prompt_trim": SPACE_PROMPT}
TRIM_POST_PROCESSOR = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

_ALPHABET = (list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|")
             + [" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "é", "ß", "日本", "中文", "😀", "👍🏽", "ñ", "\u00a0",
                "\u200b", "Ω", "ﬁ", "e\u0301", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>",
                "</think>", "assistant", "user", "\x1c", "İ"])


def adversarial_text(rng: random.Random, max_len: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, max_len)))


def adversarial_conversations(seed: int, count: int):
    """Seeded conversations with whitespace, unicode, special tokens and empty contents."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": adversarial_text(rng, 12)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": adversarial_text(rng, 20)})
            messages.append({"role": "assistant", "content": adversarial_text(rng, 30)})
        if rng.random() < 0.15:
            messages = messages[1:] if messages[0]["role"] == "system" else messages
            messages = [m for m in messages if m["role"] == "assistant"][:1] + messages
        out.append({"messages": messages})
    return out


def tokenizer_dir(base: str, name: str) -> str:
    """The example tokenizer, or a copy of it with another chat template."""
    template = TEMPLATES[name]
    if template is None:
        return EXAMPLE_TOKENIZER
    out = os.path.join(base, name)
    if not os.path.isdir(out):
        shutil.copytree(EXAMPLE_TOKENIZER, out)
        path = os.path.join(out, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["chat_template"] = template
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        if name.endswith("_trim"):
            path = os.path.join(out, "tokenizer.json")
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            spec["post_processor"] = TRIM_POST_PROCESSOR
            with open(path, "w", encoding="utf-8") as f:
                json.dump(spec, f)
    return out


def write_adversarial(path: str, seed: int = 11, count: int = 300) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in adversarial_conversations(seed, count):
            f.write(json.dumps(record) + "\n")
    return path


CASES = [(inputs, template, loss)
         for inputs in ("example", "adversarial")
         for template in TEMPLATES
         for loss in ("assistant", "last-turn", "all")]


def shard_digest(prefix: str) -> str:
    h = hashlib.sha256()
    for suffix in (".bin", ".loss.bin", ".seq.bin", ".idx"):
        with open(prefix + suffix, "rb") as f:
            h.update(suffix.encode() + b"\0" + hashlib.sha256(f.read()).hexdigest().encode())
    return h.hexdigest()


def run_case(base: str, inputs: str, template: str, loss: str, **extra) -> dict:
    from megatron_sft_idx.preprocess import Config, run

    files = EXAMPLE_INPUTS if inputs == "example" else [write_adversarial(os.path.join(base, "adv.jsonl"))]
    out = os.path.join(base, "out", f"{inputs}_{template}_{loss}")
    summary = run(Config(inputs=files, output_prefix=out, tokenizer=tokenizer_dir(base, template),
                         pack_size=2048, loss_on=loss, skip_bad=True, progress=False, overwrite=True,
                         batch_size=64, **extra))
    return {"digest": shard_digest(out), "conversations": summary["conversations"],
            "skipped": summary["skipped"], "tokens": summary["tokens"],
            "trainable_tokens": summary["trainable_tokens"]}


def main(argv) -> int:
    if "--write" not in argv:
        print(__doc__)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as base:
        for inputs, template, loss in CASES:
            results[f"{inputs}/{template}/{loss}"] = run_case(base, inputs, template, loss)
            print(inputs, template, loss, results[f"{inputs}/{template}/{loss}"])
    with open(DIGESTS, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
