"""``preprocess_sft``: conversations (or pre-tokenized samples) in, packed shards out.

Example (the bundled example, offline)::

    python tools/preprocess_sft.py --input examples/conversations.jsonl \\
        --tokenizer examples/tokenizer --output-prefix /tmp/sft/example \\
        --pack-size 2048 --workers 2 --check --verify-masks 20
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ..errors import ShardError
from ..packing import ALGORITHMS, DEFAULT_ALGORITHM
from .chat import LOSS_MODES
from .encode import SPAN_METHODS
from .fast_tokenizer import BACKENDS
from .inputs import INPUT_FORMATS
from .partitions import DEFAULT_MAX_RECORD_BYTES, DEFAULT_PARTITION_BYTES


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _split(text: str):
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated weights like 98,1,1, got {text!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise argparse.ArgumentTypeError("--split takes 1-3 non-negative weights (train,valid,test) with a positive sum")
    return parts


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count like 8M or 65536, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_packing_arguments(p: argparse.ArgumentParser) -> None:
    """The packing flags, shared by preprocess_sft and repack_sft."""
    pk = p.add_argument_group("packing")
    pk.add_argument("--pack-size", type=_positive, default=4096, help="tokens per pack (default: 4096)")
    pk.add_argument("--packing-algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM,
                    help=f"bin-packing algorithm (default: {DEFAULT_ALGORITHM})")
    pk.add_argument("--seed", type=int, default=1234,
                    help="seed of the split, first_fit_shuffle and --verify-masks sampling (default: 1234)")
    pk.add_argument("--overlong", choices=("truncate", "drop", "error"), default="truncate",
                    help="sequences longer than --pack-size: cut, skip and count, or stop (default: truncate)")
    pk.add_argument("--pad-seq-to-mult", type=_positive, default=1,
                    help="pad every sequence to a multiple of this (combined by lcm with --cp/--tp/--sp; default: 1)")
    pk.add_argument("--pad-layout", choices=("stored", "runtime"), default="stored",
                    help="which length the pad multiple applies to: 'stored' (each stored sequence: "
                         "Megatron-LM) or 'runtime' (stored length minus one: Megatron-Bridge) (default: stored)")
    pk.add_argument("--cp", type=_positive, default=1, help="context-parallel size to pad for (default: 1)")
    pk.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size to pad for (default: 1)")
    pk.add_argument("--sp", action="store_true",
                    help="sequence parallelism: pad to lcm(2*CP, CP*TP) instead of 2*CP (default: off)")
    pk.add_argument("--pad-id", type=int, help="pad token id (default: the tokenizer's pad, else its EOS)")
    pk.add_argument("--split", type=_split, metavar="W[,W[,W]]",
                    help="seeded split of conversations into PREFIX_train/_valid/_test, e.g. 98,1,1 (default: none)")
    pk.add_argument("--max-packs-per-shard", type=_positive,
                    help="split each output into PREFIX_000000, ... of at most this many packs (default: one shard)")
    pk.add_argument("--max-shard-bytes", type=_positive,
                    help="split each output into shards of about at most this many bytes (default: one shard)")


def add_run_arguments(p: argparse.ArgumentParser, workers_help: str) -> None:
    """Engine, resume, checks and reporting flags, shared by preprocess_sft and repack_sft."""
    ex = p.add_argument_group("execution")
    ex.add_argument("--workers", type=_positive, default=1, help=workers_help)
    ex.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local: this machine's processes; ray: Ray tasks on a cluster (RAY_ADDRESS or "
                         "--ray-address joined; needs the [ray] extra and paths every node sees) (default: local)")
    ex.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join (default: RAY_ADDRESS, else a "
                                                          "local one-node cluster)")
    ex.add_argument("--resume", action="store_true",
                    help="continue an interrupted run with the same settings from its completed units "
                         "(default: start over, clearing a previous run's leftovers)")
    ex.add_argument("--overwrite", action="store_true", help="replace existing outputs (default: refuse)")
    qa = p.add_argument_group("checks and reporting")
    qa.add_argument("--skip-bad", action="store_true",
                    help="skip and count bad records instead of stopping at the first (default: stop)")
    qa.add_argument("--check", action="store_true", help="run the gate on every output before publishing it")
    qa.add_argument("--verify-masks", type=int, default=0, metavar="N",
                    help="decode N random conversations from the output and check their trained spans (default: 0)")
    qa.add_argument("--summary-json", metavar="PATH", help="also write the summary as JSON to PATH")
    qa.add_argument("--quiet", action="store_true", help="no progress bars and no summary table")
    qa.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    qa.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")


def add_staging_argument(group) -> None:
    """``--staging-dir``, shared by preprocess_sft and repack_sft (an s3:// / msc:// output)."""
    group.add_argument("--staging-dir", metavar="DIR",
                       help="s3:// and msc:// output prefixes: the local directory where the run works and "
                            "stages the shards before uploading them (needs room for the output; give the same "
                            "one to --resume) (default: the system's temporary directory)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess_sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input and output")
    io.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="input files, globs or directories: .jsonl, .jsonl.gz, .jsonl.zst, .parquet")
    io.add_argument("--output-prefix", required=True,
                    help="output shard prefix; shards are PREFIX[_train|_valid|_test][_000000...]; "
                         "s3://bucket/dir/NAME or msc://profile/dir/NAME uploads them (see --staging-dir)")
    io.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                    help="record kind; auto detects messages / conversations / input_ids / prompt key "
                         "per record (default: auto)")
    io.add_argument("--prompt-key", default="prompt", help="prompt key of prompt/completion records (default: prompt)")
    io.add_argument("--completion-key", default="completion",
                    help="completion key of prompt/completion records (default: completion)")
    io.add_argument("--store", metavar="DIR",
                    help="keep the sequence store (every conversation tokenized once) in DIR, to repack it "
                         "later with repack-sft (default: a temporary store, removed after the run)")
    io.add_argument("--max-record-bytes", type=_size, default=DEFAULT_MAX_RECORD_BYTES, metavar="BYTES",
                    help="longest input record (JSONL line) accepted; longer ones are an error, or skipped "
                         "and counted with --skip-bad, never read into memory whole. Tokenizing a chat record "
                         "takes ~330x its size in memory, so this bounds a worker's peak (default: 2M)")
    io.add_argument("--partition-bytes", type=_size, default=DEFAULT_PARTITION_BYTES, metavar="BYTES",
                    help="input bytes per unit of tokenization work (a resumed run redoes at most one "
                         "unit per worker) (default: 64M)")
    add_staging_argument(io)
    tk = p.add_argument_group("tokenization")
    tk.add_argument("--tokenizer", metavar="PATH",
                    help="local Hugging Face tokenizer directory or tokenizer.json (required unless every "
                         "record is pre-tokenized)")
    tk.add_argument("--vocab-size", type=_positive,
                    help="vocabulary size (default: the tokenizer's; required for pre-tokenized input "
                         "without --tokenizer)")
    tk.add_argument("--loss-on", choices=LOSS_MODES, default="assistant",
                    help="tokens trained: every assistant turn; the last one (history as the template renders "
                         "it); per-turn: one training sequence per assistant turn, each rendered as the template "
                         "renders a conversation ending at that turn, loss on that turn (for thinking templates "
                         "that drop <think> from the history); or all (default: assistant)")
    tk.add_argument("--tokenizer-backend", choices=BACKENDS, default="auto",
                    help="gigatoken (batched, checked against tokenizers at start and on a sample of every "
                         "batch), hf (tokenizers only), or auto: gigatoken when installed and it agrees "
                         "(default: auto)")
    tk.add_argument("--span-method", choices=SPAN_METHODS, default="auto",
                    help="assistant spans from one rendering where the template proves it gives the prefix-render "
                         "spans (auto), or from prefix renders always (prefix) (default: auto)")
    tk.add_argument("--batch-size", type=_positive, default=256, help="records per worker batch (default: 256)")
    add_packing_arguments(p)
    add_run_arguments(p, "worker processes for tokenizing and writing (local engine) (default: 1)")
    return p


def _config(args):
    from .pipeline import Config

    return Config(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        pack_size=args.pack_size, workers=args.workers, seed=args.seed, algorithm=args.packing_algorithm,
        loss_on=args.loss_on, input_format=args.input_format, prompt_key=args.prompt_key,
        completion_key=args.completion_key, pad_seq_to_mult=args.pad_seq_to_mult,
        pad_layout=args.pad_layout, cp=args.cp, tp=args.tp,
        sp=args.sp, pad_id=args.pad_id, overlong=args.overlong, skip_bad=args.skip_bad, overwrite=args.overwrite,
        split=args.split, max_packs_per_shard=args.max_packs_per_shard, max_shard_bytes=args.max_shard_bytes,
        batch_size=args.batch_size, check=args.check, verify_masks=args.verify_masks,
        tokenizer_backend=args.tokenizer_backend, span_method=args.span_method,
        progress=not args.quiet and sys.stderr.isatty(), store=args.store, resume=args.resume,
        engine=args.engine, ray_address=args.ray_address, partition_bytes=args.partition_bytes,
        max_record_bytes=args.max_record_bytes, staging_dir=args.staging_dir)


def format_summary(s: dict) -> str:
    lines = [
        f"inputs              {len(s['inputs'])} file(s), {s['records_read']} records",
        f"conversations       {s['conversations']} kept, skipped {sum(s['skipped'].values())} "
        f"{s['skipped'] or ''}".rstrip(),
        f"truncated           {s['truncated']}",
        f"sequences / packs   {s['sequences']} / {s['packs']} (pack size {s['pack_size']}, "
        f"pad multiple {s['pad_seq_to_mult']}, {s['algorithm']})",
        f"tokens              {s['tokens']} ({s['padding_tokens']} padding), trainable "
        f"{s['trainable_tokens']} ({100 * s['trainable_share']:.1f}%)",
        f"packing efficiency  {100 * s['packing_efficiency']:.2f}%",
    ]
    for name, sp in s["splits"].items():
        lines.append(f"split {name:<13} {sp['conversations']} conv -> {sp['packs']} packs in "
                     f"{len(sp['shards'])} shard(s): {sp['shards'][0]}{' ...' if len(sp['shards']) > 1 else ''}")
    if s.get("empty_splits"):
        lines.append(f"empty splits        {', '.join(s['empty_splits'])} (too few conversations; not written)")
    if s.get("verify_masks"):
        lines.append(f"verify-masks        {s['verify_masks']['checked']} conversations OK")
    if s.get("check"):
        lines.append(f"check               gate passed on {s['check']['shards']} shard(s)")
    if s.get("manifests"):
        lines.append(f"manifests           {', '.join(s['manifests'])}")
    if s.get("store"):
        lines.append(f"sequence store      {s['store']} (repack with repack-sft --store)")
    resumed = {k: v for k, v in (s.get("resumed_units") or {}).items() if v}
    if resumed:
        lines.append("resumed             " + ", ".join(f"{k} {v}" for k, v in resumed.items()) + " unit(s) done before")
    lines.append("seconds             " + ", ".join(f"{k} {v:.2f}" for k, v in s["seconds"].items()))
    rss = s["peak_rss_mib"]
    lines.append(f"peak RSS            main {rss['main']:.0f} MiB, workers {rss['workers_max']:.0f} MiB")
    return "\n".join(lines)


def run_and_report(prog: str, run, cfg, args, formatter=None) -> int:
    """Run, print the summary (``formatter``, default :func:`format_summary`) or the one-line
    error; the exit codes of both CLIs."""
    from .._signals import tool_scope

    with tool_scope():
        return _report(prog, run, cfg, args, formatter)


def _report(prog: str, run, cfg, args, formatter) -> int:
    from .._signals import Terminated, exit_code

    try:
        summary = run(cfg)
    except ShardError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as exc:
        if getattr(exc, "publishing", False):
            what = "interrupted while publishing; no manifest was written (rerun with --resume to finish)"
        else:
            what = ("interrupted; nothing was published (rerun with --resume to continue from the completed "
                    "units, or without it to start over)")
        print(f"{prog}: {what}", file=sys.stderr)
        return exit_code(exc)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    elif not args.quiet:
        print((formatter or format_summary)(summary))
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.tokenizer and args.input_format not in ("tokens",) and args.vocab_size is None:
        parser.error("--tokenizer is required (or --input-format tokens with --vocab-size)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .pipeline import run

    return run_and_report("preprocess_sft", run, _config(args), args)
