"""Pinned outputs of the input shapes issue 20 added (tool calls, reasoning, Alpaca, text parts,
JSON arrays), rendered by the template families on the bundled example tokenizer (committed, so
the bytes are the same on every machine), written by the reference path (``hf``/``prefix``).
The batched path must reproduce them byte for byte. Regenerate only when the bytes are *meant*
to change:

    PYTHONPATH=.:tests python tests/support/shapes_identity.py --write [CASE ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from support.chat_families import FAMILIES, with_template
from support.preprocess_identity import EXAMPLE_TOKENIZER, shard_digest
from support.sft_fixtures import alpaca, glaive, openai, parts, reasoning, toolace, xlam

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGESTS = os.path.join(ROOT, "tests", "golden", "shapes_digests.json")


def records(family: str) -> list:
    out = [openai(i, with_system=family != "mistral") for i in range(12)] + [alpaca(i, i % 2 == 0, i % 3 == 0, i % 4 == 0)
                                                                           for i in range(12)] + [parts(i) for i in range(6)]
    if family in ("qwen25", "qwen3", "deepseek"):
        out += [glaive(i) for i in range(8)] + [toolace(i) for i in range(8)] + [xlam(i) for i in range(4)]
    if family == "qwen3":
        out += [reasoning(i, inline=i % 2 == 0, turns=1 + i % 2) for i in range(10)]
    return out


CASES = {"qwen25": dict(loss_on="assistant"), "qwen3": dict(loss_on="per-turn"),
         "qwen3_mask": dict(loss_on="per-turn", reasoning_loss="mask", tool_call_loss="mask"),
         "deepseek": dict(loss_on="assistant"), "llama3": dict(loss_on="last-turn"),
         "mistral": dict(loss_on="last-turn"), "qwen25_all": dict(loss_on="all")}


#: Families whose end of turn is no token of the example tokenizer: the copy gets it as a special
#: token, so every trained reply ends with a stop the model can emit (the per-record stop check,
#: docs/INPUTS.md "Stops"; their digests were pinned again when that check came).
OWN_STOP = {"llama3", "deepseek", "mistral"}


def _with_stop(directory: str, token: str) -> None:
    from tokenizers import AddedToken, Tokenizer

    path = os.path.join(directory, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    if tok.token_to_id(token) is None:
        tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        tok.save(path)


def run_case(base: str, name: str, **extra) -> dict:
    from megatron_sft_idx.preprocess import Config, run

    family = name.split("_")[0]
    stop = {"eos_token": FAMILIES[family]["eos"]} if family in OWN_STOP else {}
    tok = with_template(os.path.join(base, f"tok_{family}"), EXAMPLE_TOKENIZER, FAMILIES[family]["template"],
                        bos_token="<|endoftext|>", **stop)  # (the families' templates open with a BOS)
    if stop:
        _with_stop(tok, stop["eos_token"])
    data = os.path.join(base, f"{name}.json")
    with open(data, "w", encoding="utf-8") as f:  # a JSON array: the array reader is pinned too
        json.dump(records(family), f, indent=1)
    out = os.path.join(base, "out", name)
    kw = dict(CASES[name])
    kw.update(extra)
    summary = run(Config(inputs=[data], output_prefix=out, tokenizer=tok, pack_size=4096, skip_bad=True,
                         progress=False, overwrite=True, batch_size=16, partition_bytes=16384, **kw))
    return {"digest": shard_digest(out), "conversations": summary["conversations"], "skipped": summary["skipped"],
            "tokens": summary["tokens"], "trainable_tokens": summary["trainable_tokens"]}


def main(argv) -> int:
    if "--write" not in argv:
        print(__doc__)
        return 2
    only = [a for a in argv if a in CASES] or list(CASES)   # (e.g. --write llama3: pin that case again)
    with open(DIGESTS, encoding="utf-8") as f:
        results = json.load(f)
    with tempfile.TemporaryDirectory() as base:
        for name in only:
            results[name] = run_case(base, name, tokenizer_backend="hf", span_method="prefix")
            print(name, results[name])
    with open(DIGESTS, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
