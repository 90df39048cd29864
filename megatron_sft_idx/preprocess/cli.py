"""``preprocess-sft``'s command line (:func:`main`): conversations in, a sequence store and shards out.

The flags it shares with ``repack-sft`` (:mod:`.repack_cli`) are :mod:`.arguments`'; here are the
input, tokenizing and loss flags, read into a :class:`~.config.TokenizeSettings`. The driver
(:mod:`.driver`) runs the configuration.

Example (the bundled example, offline)::

    python tools/preprocess_sft.py --input examples/conversations.jsonl \\
        --tokenizer examples/tokenizer --output-prefix /tmp/sft/example \\
        --pack-size 2048 --workers 2 --check --verify-masks 20
"""

from __future__ import annotations

import argparse
import os

from .. import _cli
from .._moved import moved_getattr
from .._cli import positive_int, size_arg
from ..errors import ShardError
from ..jsondoc import parse_json
from .arguments import (add_balance_arguments, add_mix_argument, add_packing_arguments, add_run_arguments,
                        add_staging_argument, balance_settings_of, pack_settings_of, run_and_report,
                        run_settings_of, usage_problem)
from .config import Config, TokenizeSettings
from .records.chat import LOSS_MODES
from .records.encode import PROMPT_ONLY, PROMPT_ONLY_DROPPED, SPAN_METHODS
from .records.fast_tokenizer import BACKENDS
from .records.inputs import INPUT_FORMATS
from .records.partitions import DEFAULT_MAX_RECORD_BYTES
from .records.policy import EMPTY_REASONING_LOSS, REASONING_LOSS, TOOL_CALL_LOSS

PROG = "preprocess-sft"
DESCRIPTION = """\
Conversations (or pre-tokenized samples) in, packed SFT shards out.

Example, the bundled example offline:

  preprocess-sft --input examples/conversations.jsonl --tokenizer examples/tokenizer \\
      --output-prefix /tmp/sft/example --pack-size 2048 --workers 2 --check --verify-masks 20

Sizes take K, M, G, T suffixes (powers of 1024; KB, MB, GB are powers of 1000), e.g. 64M.
Exit status: 0 done, 1 bad input or a failed check (nothing published), 2 usage error,
130 / 143 interrupted (rerun with --resume to continue).
"""

def _tags(text: str):
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip() for p in parts) or parts[0] == parts[1]:
        raise argparse.ArgumentTypeError(f"expected two different tags like <think>,</think>, got {text!r}")
    return parts[0].strip(), parts[1].strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input and output")
    io.add_argument("--input", nargs="+", metavar="PATH",
                    help="input files, globs or directories: .jsonl, .json, .parquet, .arrow [.gz|.zst], saved "
                         "datasets; or s3:// / msc:// URLs of objects, prefixes (s3://b/data/) or globs "
                         "(s3://b/data/*.jsonl), read with ranged GETs (required unless --mix)")
    add_mix_argument(io, "tokenized into its store (a store already made from them is reused once it "
                         "verifies), or whose store is given")
    io.add_argument("--output-prefix", required=True,
                    help="output shard prefix; shards are PREFIX[_train|_valid|_test][_000000...]; "
                         "s3://bucket/dir/NAME or msc://profile/dir/NAME uploads them (see --staging-dir)")
    io.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                    help="record shape (docs/INPUTS.md); auto detects per record: messages (chat), conversations "
                         "(sharegpt), input_ids (tokens), the prompt key (prompt), instruction (alpaca), query and "
                         "answers (xlam), input (a list) and output (nemotron: Llama-Nemotron's post-training rows) "
                         "(default: auto)")
    io.add_argument("--prompt-key", default="prompt", help="prompt key of prompt/completion records (default: prompt)")
    io.add_argument("--completion-key", default="completion",
                    help="completion key of prompt/completion records (default: completion)")
    io.add_argument("--prompt-format", choices=("chat", "raw"), default="chat",
                    help="prompt/completion strings: chat renders them as a user and an assistant turn through "
                         "the chat template; raw encodes [BOS] prompt completion [EOS] exactly as written, with no "
                         "separator inserted (the data carries its own, as in TRL's standard format) "
                         "(default: chat)")
    io.add_argument("--ignore-field", action="append", default=[], metavar="NAME",
                    help="a record-level key or message field that carries nothing the model should see; other "
                         "keys a shape does not use are refused when they hold text (documented metadata such as id "
                         "excepted), never dropped silently; the summary counts what each rule ignored "
                         "(repeatable; default: none)")
    io.add_argument("--skip-report", metavar="FILE",
                    help="write every skipped record's file, line and reason to FILE, one JSON object a line, "
                         "and every conversation the plan drops as overlong, with its length (with --skip-bad; "
                         "the summary counts them by file and reason) (default: none)")
    io.add_argument("--store", metavar="DIR|URL",
                    help="keep the sequence store (every conversation tokenized once) in DIR, to repack it "
                         "later with repack-sft; an s3:// URL keeps it in the bucket, locked while the run "
                         "writes it, its partitions written by the tasks (default: a temporary store, removed "
                         "after the run)")
    io.add_argument("--max-record-bytes", type=size_arg, default=DEFAULT_MAX_RECORD_BYTES, metavar="SIZE",
                    help="longest input record (JSONL line) accepted; longer ones are an error, or skipped "
                         "and counted with --skip-bad, never read into memory whole. Tokenizing a chat record "
                         "takes ~330x its size in memory, so this bounds a worker's peak (default: 2M)")
    io.add_argument("--partition-bytes", type=_partition_bytes, default=None, metavar="SIZE|auto",
                    help="input bytes per unit of tokenization work (a resumed run redoes at most one unit per "
                         "worker); auto: the inputs' size cut into 64 equal units, each 8M..64M (fewer units "
                         "under 512M of input: a unit's fixed cost stays ~2%% of its work), so workers have "
                         "units to take; never changes the output's bytes (default: auto)")
    add_staging_argument(io)
    tk = p.add_argument_group("tokenization")
    tk.add_argument("--tokenizer", metavar="PATH|URL|NAME",
                    help="Hugging Face tokenizer: a local directory or tokenizer.json, an s3:// / msc:// URL of a "
                         "directory holding tokenizer.json, or a hub name (org/name: the local HF cache; the hub "
                         "with HF_HUB_OFFLINE=0); a URL or name is read once and shipped to the workers (required unless every "
                         "record is pre-tokenized)")
    tk.add_argument("--chat-template", metavar="FILE|NAME",
                    help="the chat template to render conversations with: a Jinja file, or the name of one of "
                         "the tokenizer's named templates (default: the tokenizer's own)")
    tk.add_argument("--template-date", metavar="YYYY-MM-DD",
                    help="the date a chat template that reads the clock (strftime_now, as Llama 3.1/3.2's print "
                         "today's date) renders, so the bytes do not depend on the day or the time zone "
                         "(default: the UTC date the run started, recorded in the store and shards and reused "
                         "by --resume; templates that do not read the clock ignore it)")
    tk.add_argument("--template-arg", metavar="NAME=VALUE", type=template_arg, action="append", default=[],
                    help="a switch the chat template reads, given to every rendering (repeatable): "
                         "enable_thinking=false (Qwen3, Qwen3.5), thinking=true (DeepSeek-V3.1), "
                         "thinking_mode=enabled (MiniMax-M3); VALUE is JSON (true, 3, \"x\") or else text. "
                         "Recorded in the store and shards, reused by --resume, repack-sft and --verify-masks")
    tk.add_argument("--vocab-size", type=positive_int,
                    help="vocabulary size (default: the tokenizer's; required for pre-tokenized input "
                         "without --tokenizer)")
    tk.add_argument("--loss-on", choices=LOSS_MODES, default="assistant",
                    help="tokens trained: assistant (every assistant turn); last-turn (the last one, history as "
                         "the template renders it); per-turn (one training sequence per assistant turn, each "
                         "rendered as the template renders a conversation ending at that turn, loss on that "
                         "turn: for thinking templates that drop <think> from the history); or all (every "
                         "token, prompts included) (default: assistant)")
    tk.add_argument("--prompt-only", choices=PROMPT_ONLY, default="error",
                    help="a record with no trained token (no assistant turn, or every one untrained): error (a "
                         "bad record: stop, or skip and count it with --skip-bad); keep (store it with an all-zero "
                         "mask, for schedulers that expect prompt-only sequences); drop (skip and count it as "
                         f"{PROMPT_ONLY_DROPPED}, no --skip-bad needed). The metadata records keep and drop "
                         "(default: error)")
    tk.add_argument("--tool-call-loss", choices=TOOL_CALL_LOSS, default="train",
                    help="an assistant turn with tool calls: train it as assistant output, or mask it whole "
                         "(tool results, system and user turns are never trained) (default: train)")
    tk.add_argument("--reasoning-loss", choices=REASONING_LOSS, default="train",
                    help="the reasoning of a trained turn: train it, mask it (rendered, not trained), or drop it "
                         "before rendering (the answer is trained alone) (default: train)")
    tk.add_argument("--empty-reasoning-loss", choices=EMPTY_REASONING_LOSS, default="mask",
                    help="a reasoning block holding only whitespace (Qwen3-style templates insert one in the final "
                         "turn): mask it or train it (default: mask)")
    tk.add_argument("--reasoning-tags", type=_tags, default=("<think>", "</think>"), metavar="OPEN,CLOSE",
                    help="what delimits reasoning in the data and in the rendering (default: <think>,</think>)")
    tk.add_argument("--tokenizer-backend", choices=BACKENDS, default="auto",
                    help="gigatoken (batched, checked against tokenizers at start and on a sample of every "
                         "batch), hf (tokenizers only), or auto: gigatoken when installed and it agrees "
                         "(default: auto)")
    tk.add_argument("--span-method", choices=SPAN_METHODS, default="auto",
                    help="assistant spans from one rendering where the template proves it gives the prefix-render "
                         "spans (auto), or from prefix renders always (prefix) (default: auto)")
    tk.add_argument("--batch-size", type=positive_int, default=256, help="records per worker batch (default: 256)")
    add_packing_arguments(p)
    add_balance_arguments(p)
    add_run_arguments(p, "worker processes for tokenizing and writing (local engine) (default: 1)")
    return p



def _partition_bytes(text: str):
    """``--partition-bytes``: a size, or ``auto`` (None: :func:`.records.partitions.auto_partition_bytes`)."""
    return None if text == "auto" else size_arg(text)

def template_arg(text: str):
    """``--template-arg NAME=VALUE`` -> ``(NAME, value)``: VALUE read as JSON (``true``, ``3``) when it
    is JSON, else as text.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or an empty name.
    """
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. enable_thinking=false)")
    try:
        parsed = parse_json(value, what="--template-arg value", max_depth=1)
    except ShardError:
        parsed = value
    return name.strip(), parsed if isinstance(parsed, (bool, int, float, str)) or parsed is None else value


def _config(args) -> Config:
    tokenize = TokenizeSettings(
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, loss_on=args.loss_on, input_format=args.input_format,
        prompt_key=args.prompt_key, completion_key=args.completion_key, prompt_format=args.prompt_format,
        chat_template=args.chat_template, template_date=args.template_date, ignore_fields=tuple(args.ignore_field),
        template_args=tuple(args.template_arg), prompt_only=args.prompt_only,
        tool_call_loss=args.tool_call_loss, reasoning_loss=args.reasoning_loss,
        empty_reasoning_loss=args.empty_reasoning_loss, reasoning_tags=tuple(args.reasoning_tags),
        tokenizer_backend=args.tokenizer_backend, span_method=args.span_method, batch_size=args.batch_size,
        partition_bytes=args.partition_bytes, max_record_bytes=args.max_record_bytes, skip_report=args.skip_report)
    return Config(args.input or [], args.output_prefix, store=args.store, mix=args.mix, tokenize=tokenize,
                  pack=pack_settings_of(args), run=run_settings_of(PROG, args), balance=balance_settings_of(args))


def main(argv=None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    if not args.input and not args.mix:
        return _cli.usage_error(parser, "--input is required (or --mix FILE, whose sources name their inputs)")
    if not args.tokenizer and args.input_format not in ("tokens",) and args.vocab_size is None:
        return _cli.usage_error(parser, "--tokenizer is required (or --input-format tokens with --vocab-size)")
    if args.chat_template and not args.tokenizer:
        return _cli.usage_error(parser, "--chat-template needs --tokenizer")
    problem = usage_problem(args)
    if problem:
        return _cli.usage_error(parser, problem)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .driver import run   # (start-up: the driver, after HF_HUB_OFFLINE is set)

    return run_and_report(PROG, run, _config(args), args)


__getattr__ = moved_getattr(__name__)   # repack-sft's names moved to .repack_cli
