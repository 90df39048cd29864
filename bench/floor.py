"""The main job's floor: render each conversation once, encode the rendering once, on the same corpus.

Issue 45's measure of how close the main job (``preprocess-sft``) is to the work it cannot avoid:
every conversation rendered once with the tokenizer's chat template (the pipeline's own compiled
template, :meth:`ChatTokenizer.render_conversation`) and that text encoded once by the encoder the
pipeline uses (gigatoken through :class:`FastTokenizer` when installed, else ``tokenizers``). The
floor's rate is tokens per CPU-second of render + encode; the main job's is the same tokens per
CPU-second of the whole one-worker run, its process and any worker (it renders and encodes every
conversation whole, then truncates what is longer than the pack size: the tokens it writes are
fewer); the report gives the main job as a fraction of the floor (issue 45 asks for >= 30 %).

Everything runs in one warm process: the records are parsed and mapped to conversations before
the clock starts (JSON decoding and the shape mapping are reported beside, as their own rates,
not in the floor); then ``--rounds`` rounds, each timing render, encode and the main job
(``run``, 1 worker, the default ``--partition-bytes``) with the process's CPU clock; each figure
is the median over the rounds. That ``warm`` job reuses the process's loaded tokenizer and
compiled kernels; the ``cold`` job is ``preprocess-sft`` as a user runs it, a fresh process
(its start, imports and tokenizer load included: what the issue measured from outside), timed
by its user + system time.

Corpora (:func:`bench.preprocess_speed.make_corpus`): ``realistic`` (plain multi-turn chat, a
128k+ production tokenizer), ``example`` (the bundled generator and 1k BPE), ``tools``.

``--input FILE.jsonl --tokenizer DIR`` measures your own conversations with your model's
tokenizer instead (the row ``yours``): the rate the README quotes depends on the vocabulary
(the encoder's cost per token), the text (tokens per character, turn lengths) and how much of
it is tool calls or reasoning; this is the command that gives it for your data.

    python -m bench.floor                              # realistic and example, 20k conversations
    python -m bench.floor --corpora realistic,tools --count 5000 --rounds 5
    python -m bench.floor --input /data/chat.jsonl --tokenizer /models/your-tokenizer
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench._common import chosen_corpora, format_table, run_child, write_json
from bench.preprocess_speed import make_corpus

CORPORA = ("realistic", "example", "tools")


def _conversations(path: str, tok, policy):
    """Every chat record of ``path`` parsed and adapted to the template, as the pipeline does."""
    from megatron_sft_idx.preprocess.records.inputs import parse_record
    from megatron_sft_idx.preprocess.records.shapes import SchemaOptions

    schema = SchemaOptions()
    convs, parse_s = [], time.process_time()
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            kind, payload = parse_record(raw, path, line, "auto", schema.prompt_key, schema.completion_key, schema, {})
            if kind == "chat":
                convs.append(tok.prepare(payload, policy, path, line))
    return convs, time.process_time() - parse_s


def child_floor(path: str, tokenizer: str, out: str, rounds: int) -> dict:
    """Render once + encode once against the main job, in this one process (``rounds`` each)."""
    import megatron_sft_idx.preprocess as entry
    from megatron_sft_idx.preprocess.records.chat import load_chat_tokenizer
    from megatron_sft_idx.preprocess.records.fast_tokenizer import FastTokenizer
    from megatron_sft_idx.preprocess.records.policy import DEFAULT_POLICY

    tok = load_chat_tokenizer(tokenizer)
    fast = FastTokenizer.load(tok, "auto")
    convs, parse_s = _conversations(path, tok, DEFAULT_POLICY)

    def encode(texts):
        if fast is not None:
            return int(fast.encode(texts)[1][-1])
        return sum(len(e.ids) for e in tok.backend.encode_batch(texts, add_special_tokens=False))

    def job() -> dict:
        c = time.process_time()
        s = entry.run(entry.Config(inputs=[path], output_prefix=out, tokenizer=tokenizer, pack_size=4096,
                                   workers=1, progress=False, overwrite=True))
        return {"cpu_s": time.process_time() - c, "tokens": s["tokens"]}

    job()   # warm-up: numba's caches, the page cache
    runs = []
    for r in range(rounds):
        c = time.process_time()
        texts = [tok.render_conversation(conv) for conv in convs]
        render_s = time.process_time() - c
        c = time.process_time()
        tokens = encode(texts)
        encode_s = time.process_time() - c
        runs.append({"render_s": render_s, "encode_s": encode_s, "floor_tokens": tokens, "job": job(),
                     "cold_s": cold_job(path, tokenizer, out)})
    render_s = statistics.median(r["render_s"] for r in runs)
    encode_s = statistics.median(r["encode_s"] for r in runs)
    job_s = statistics.median(r["job"]["cpu_s"] for r in runs)
    cold_s = statistics.median(r["cold_s"] for r in runs)
    tokens, job_tokens = runs[0]["floor_tokens"], runs[0]["job"]["tokens"]
    floor_rate = tokens / (render_s + encode_s)
    # The job is rated on the tokens it tokenized (the floor's), not the ones it wrote: a conversation
    # longer than the pack size is rendered and encoded whole, then truncated.
    job_rate, cold_rate = tokens / job_s, tokens / cold_s
    return {"conversations": len(convs), "encoder": "gigatoken" if fast is not None else "tokenizers",
            "vocab_size": tok.vocab_size, "floor_tokens": tokens, "job_tokens": job_tokens,
            "parse_map_s": parse_s, "render_s": render_s, "encode_s": encode_s, "job_cpu_s": job_s,
            "cold_cpu_s": cold_s, "render_rate": tokens / render_s, "encode_rate": tokens / encode_s,
            "floor_rate": floor_rate, "parse_map_rate": tokens / parse_s, "job_rate": job_rate,
            "fraction": job_rate / floor_rate, "cold_rate": cold_rate, "cold_fraction": cold_rate / floor_rate,
            "runs": runs}


def cold_job(path: str, tokenizer: str, out: str) -> float:
    """CPU-seconds (user + system) of ``preprocess-sft`` in a fresh process, 1 worker, defaults."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import sys; from megatron_sft_idx._console import preprocess_sft; "
                    "sys.argv[0] = 'preprocess-sft'; sys.exit(preprocess_sft())", "--input", path,
                    "--tokenizer", tokenizer, "--output-prefix", out + "_cold", "--pack-size", "4096",
                    "--workers", "1", "--overwrite"], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000, help="conversations per corpus (default: 20000)")
    p.add_argument("--corpora", default="realistic,example",
                   help=f"comma-separated, of {', '.join(CORPORA)} (default: realistic,example)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians over them (default: 3)")
    p.add_argument("--input", default=None, metavar="FILE.jsonl",
                   help="your conversations (one local JSONL file of chat records), measured instead of the corpora")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --input: your model's tokenizer (a directory or a Hugging Face name)")
    return p


def _corpora(args, tmp: str):
    """``(name, path, tokenizer, description)`` of each corpus measured: yours, or the generated ones."""
    if args.input is not None:
        if not args.tokenizer or not os.path.isfile(args.input) or not args.input.endswith(".jsonl"):
            raise SystemExit("--input takes one local .jsonl file, with --tokenizer DIR")
        return [("yours", args.input, args.tokenizer, f"{args.input} with {args.tokenizer}")]
    if args.tokenizer is not None:
        raise SystemExit("--tokenizer goes with --input")
    corpora = chosen_corpora(args.corpora, CORPORA)
    return [(kind, *make_corpus(kind, os.path.join(tmp, f"{kind}.jsonl"), args.count, tmp)) for kind in corpora]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    results = {"count": args.count, "rounds": args.rounds, "corpora": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, path, tok, desc in _corpora(args, tmp):
            r = run_child("bench.floor:child_floor", path=path, tokenizer=tok, out=os.path.join(tmp, kind, "out"),
                          rounds=args.rounds)
            r["corpus"] = desc
            results["corpora"][kind] = r
            rows.append([kind, f"{r['vocab_size']:,}", r["encoder"], r["floor_tokens"],
                         f"{r['render_rate'] / 1e6:.2f}M", f"{r['encode_rate'] / 1e6:.2f}M",
                         f"{r['floor_rate'] / 1e6:.2f}M", f"{r['job_rate'] / 1e6:.2f}M",
                         f"{100 * r['fraction']:.1f}%", f"{r['cold_rate'] / 1e6:.2f}M",
                         f"{100 * r['cold_fraction']:.1f}%", f"{r['parse_map_rate'] / 1e6:.2f}M"])
    print(format_table(["corpus", "vocab", "encoder", "tokens", "render tok/CPU-s", "encode tok/CPU-s",
                        "floor (render+encode) tok/CPU-s", "job, warm, tok/CPU-s", "warm / floor",
                        "job, cold process, tok/CPU-s", "cold / floor", "parse+map alone tok/CPU-s"], rows))
    print("wrote", write_json("floor", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
