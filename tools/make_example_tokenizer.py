#!/usr/bin/env python3
"""Train the bundled example tokenizer: a small byte-level BPE made for the example conversations.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML chat template
with ``{% generation %}`` markers, ``<|im_end|>`` as end of turn / EOS,
``<|endoftext|>`` as pad) into ``--out-dir``. Training is single-threaded and
seeded by the input order, so the same conversations give the same files.

    python tools/make_example_tokenizer.py --input examples/conversations.jsonl --out-dir examples/tokenizer
"""

from __future__ import annotations

import argparse
import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('role ' ~ message['role'] ~ ' is not supported; use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] ~ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _texts(paths):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                for m in record.get("messages") or record.get("conversations") or []:
                    yield m.get("content", m.get("value", ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=["examples/conversations.jsonl"],
                   help="conversation JSONL files to train on (default: examples/conversations.jsonl)")
    p.add_argument("--out-dir", default="examples/tokenizer", help="output directory (default: examples/tokenizer)")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size (default: 1024)")
    return p


def main(argv=None) -> int:
    os.environ["RAYON_NUM_THREADS"] = "1"  # single-threaded training: reproducible merges
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    args = build_parser().parse_args(argv)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(_texts(args.input)), trainer=trainer)
    os.makedirs(args.out_dir, exist_ok=True)
    tok.save(os.path.join(args.out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>"],
        "chat_template": CHAT_TEMPLATE,
        "name_or_path": "megatron_sft_idx-example-bpe-1k",
    }
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
