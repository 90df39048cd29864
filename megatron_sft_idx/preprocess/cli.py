"""The two commands' CLIs: ``preprocess-sft`` (:func:`main`) and ``repack-sft`` (:func:`repack_main`).

Each flag group the commands share is defined once: the packing flags
(:func:`add_packing_arguments`, read into a :class:`~.config.PackSettings` by
:func:`pack_settings_of`) and the execution, check and reporting flags
(:func:`add_run_arguments`, read into a :class:`~.config.RunSettings` by :func:`run_settings_of`).
The driver (:mod:`.driver`) runs the configuration; :func:`run_and_report` prints its summary
or its one-line error, with the exit codes of both commands.

Example (the bundled example, offline)::

    python tools/preprocess_sft.py --input examples/conversations.jsonl \\
        --tokenizer examples/tokenizer --output-prefix /tmp/sft/example \\
        --pack-size 2048 --workers 2 --check --verify-masks 20
    python tools/repack_sft.py --store /data/sft/store --output-prefix /data/sft/cp4/chat \\
        --pack-size 8192 --cp 4 --split 98,1,1 --workers 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .. import _cli
from .._extras import MissingExtraError
from .._cli import percent, positive_int, seconds, size_arg
from .._progress import DEFAULT_LOG_INTERVAL, Progress, add_verbosity_arguments
from .._signals import Terminated, exit_code, tool_scope
from ..errors import ShardError
from ..jsondoc import parse_json
from ..packing import ALGORITHMS, DEFAULT_ALGORITHM, FP8_BLOCK
from ..storage.urls import local_only, url_refusal
from .records.chat import LOSS_MODES
from .config import BalanceSettings, Config, PackSettings, RepackConfig, RunSettings, TokenizeSettings
from .records.encode import PROMPT_ONLY, PROMPT_ONLY_DROPPED, SPAN_METHODS
from .engines import ENGINES
from .records.fast_tokenizer import BACKENDS
from .records.inputs import INPUT_FORMATS
from .records.policy import EMPTY_REASONING_LOSS, REASONING_LOSS, TOOL_CALL_LOSS
from .records.partitions import DEFAULT_MAX_RECORD_BYTES
from .conversations import MEGATRON_LM_5017, write_conversations
from .mixreport import plot_mixture
from .nemo_rl import NEMO_RL_3380, write_nemo_rl_jsonl
from .store import SequenceStore
from .summary import decision_warnings, format_plan_summary, format_summary

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

def _split(text: str):
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated weights like 98,1,1, got {text!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise argparse.ArgumentTypeError("takes 1-3 non-negative weights (train,valid,test) with a positive sum")
    return parts


def _tags(text: str):
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip() for p in parts) or parts[0] == parts[1]:
        raise argparse.ArgumentTypeError(f"expected two different tags like <think>,</think>, got {text!r}")
    return parts[0].strip(), parts[1].strip()


def add_packing_arguments(p: argparse.ArgumentParser) -> None:
    """The packing flags, shared by preprocess_sft and repack_sft."""
    pk = p.add_argument_group("packing")
    pk.add_argument("--pack-size", type=positive_int, default=4096, metavar="TOKENS",
                    help="tokens per pack (default: 4096)")
    pk.add_argument("--packing-algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM,
                    help=f"bin-packing algorithm (default: {DEFAULT_ALGORITHM})")
    pk.add_argument("--seed", type=int, default=1234,
                    help="seed of the split, first_fit_shuffle and --verify-masks sampling (default: 1234)")
    pk.add_argument("--overlong", choices=("truncate", "drop", "error"), default="truncate",
                    help="conversations longer than --pack-size: truncate (cut to the pack size; one that then "
                         "trains nothing is dropped and counted), drop (skip and count), or error (stop at the "
                         "first; not combinable with --skip-bad) (default: truncate)")
    pk.add_argument("--truncated-turn-loss", choices=("keep", "drop"), default="keep",
                    help="an assistant reply cut by truncation: keep its loss on the tokens before the cut, or "
                         "drop it (mask the whole cut reply; a conversation left with nothing trained is dropped "
                         "and counted). keep is the default: those tokens are the reply as written, and no "
                         "end-of-turn is ever trained at the cut, so the model is not taught to stop there; "
                         "drop never trains a reply the model sees unfinished. The summary counts cut replies "
                         "(default: keep)")
    pk.add_argument("--pad-seq-to-mult", type=positive_int, default=1,
                    help="pad every sequence to a multiple of this (combined by lcm with --cp/--tp/--sp; default: 1)")
    pk.add_argument("--pad-layout", choices=("stored", "runtime"), default="stored",
                    help="which length the pad multiple applies to: 'stored' (each stored sequence: "
                         "Megatron-LM) or 'runtime' (stored length minus one: Megatron-Bridge) (default: stored)")
    pk.add_argument("--cp", type=positive_int, default=1, help="context-parallel size to pad for (default: 1)")
    pk.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size to pad for (default: 1)")
    pk.add_argument("--sp", action="store_true",
                    help="sequence parallelism: pad to lcm(2*CP, CP*TP) instead of 2*CP (default: off)")
    pk.add_argument("--fp8", choices=sorted(FP8_BLOCK), metavar="RECIPE",
                    help="Megatron's --fp8-recipe to pad for too: each sequence a multiple of the recipe's block "
                         "(16; mxfp8 32; blockwise 128) times 2*CP (CP > 1) times TP (with --sp), so every "
                         f"rank's share of a pack is whole blocks; one of {', '.join(sorted(FP8_BLOCK))} "
                         "(default: none)")
    pk.add_argument("--pad-id", type=int, help="pad token id (default: the tokenizer's pad, else its EOS)")
    pk.add_argument("--split", type=_split, metavar="W[,W[,W]]",
                    help="seeded split of conversations into PREFIX_train/_valid/_test, e.g. 98,1,1 (default: none)")
    pk.add_argument("--max-packs-per-shard", type=positive_int, metavar="N",
                    help="split each output into PREFIX_000000, ... of at most this many packs (default: one shard)")
    pk.add_argument("--max-shard-bytes", type=size_arg, metavar="SIZE",
                    help="split each output into shards of at most about this size, e.g. 1G (default: one shard)")


def _topology(text: str):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected DP,MBS,GBS (three positive integers), not {text!r}")
    return values


def add_balance_arguments(p: argparse.ArgumentParser) -> None:
    """The balanced-order flags of both commands (:class:`~.config.BalanceSettings`)."""
    bl = p.add_argument_group("balanced order (docs/BATCHING.md)")
    bl.add_argument("--balance-for", type=_topology, metavar="DP,MBS,GBS",
                    help="also write OUT.order beside the shards: each step's packs dealt to the data-parallel ranks "
                         "and micro-batches of this topology so they cost the same (default: no order)")
    bl.add_argument("--cost-model", default="llama3-8b", metavar="PRESET|LINEAR,ATTENTION",
                    help="price of a pack: a model preset (llama3-8b, llama3-70b, llama3.2-1b, qwen2.5-7b, "
                         "qwen2.5-72b) or FLOPs per token and per token squared (default: llama3-8b)")
    bl.add_argument("--balance-epochs", type=positive_int, default=1, metavar="N",
                    help="epochs the order covers; plan as many as the run trains (default: 1)")
    bl.add_argument("--balance-seed", type=int, metavar="SEED",
                    help="the training run's data seed (Megatron-LM --seed, Bridge's dataset seed), which the "
                         "order must start from (default: --seed)")
    bl.add_argument("--exchange-window", type=positive_int, default=1, metavar="W",
                    help="let W neighbouring steps trade packs; above 1 this CHANGES step membership (default: 1)")
    bl.add_argument("--balance-labels", action="store_true",
                    help="also even out trained tokens per rank and micro-batch (per step with --exchange-window > 1)")
    bl.add_argument("--step-size", type=positive_int, metavar="GBS",
                    help="with --mix and without --balance-for: packs per training step (the global batch size); "
                         "writes OUT.order, the mixture's packs interleaved so every window of steps holds the "
                         "shares, not dealt to ranks (any data-parallel size) (default: none)")


def balance_settings_of(args) -> BalanceSettings:
    """The balanced-order flags (:func:`add_balance_arguments`) as settings."""
    return BalanceSettings(balance_for=args.balance_for, cost_model=args.cost_model,
                           balance_epochs=args.balance_epochs, balance_seed=args.balance_seed,
                           exchange_window=args.exchange_window, step_size=args.step_size,
                           balance_labels=args.balance_labels)


def add_run_arguments(p: argparse.ArgumentParser, workers_help: str) -> None:
    """Engine, resume, checks and reporting flags, shared by preprocess_sft and repack_sft."""
    ex = p.add_argument_group("execution")
    ex.add_argument("--workers", type=positive_int, default=1, help=workers_help)
    ex.add_argument("--engine", choices=ENGINES, default="local",
                    help="local: this machine's processes; ray: Ray tasks on a cluster (RAY_ADDRESS or "
                         "--ray-address joined; needs the [ray] extra and paths every node sees) (default: local)")
    ex.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join (default: RAY_ADDRESS, else a "
                                                          "local one-node cluster)")
    ex.add_argument("--resume", action="store_true",
                    help="continue an interrupted run with the same settings from its completed units "
                         "(default: start over, clearing a previous run's leftovers)")
    ex.add_argument("--overwrite", action="store_true", help="replace existing outputs (default: refuse)")
    qa = p.add_argument_group("checks")
    qa.add_argument("--skip-bad", action="store_true",
                    help="skip and count bad records (unparsable, rejected by the template, nothing trained) "
                         "instead of stopping at the first (default: stop)")
    qa.add_argument("--check", action="store_true", help="run the gate on every output before publishing it")
    qa.add_argument("--verify-masks", type=int, default=0, metavar="N",
                    help="decode N random conversations from the output and check their trained spans; "
                         "truncated ones are not sampled, so fewer may be checked (the summary says why) "
                         "(default: 0)")
    qa.add_argument("--warn-above", type=percent, default=1.0, metavar="PERCENT",
                    help="warn when more than this share of conversations is truncated, or dropped or "
                         "skipped (default: 1)")
    rp = p.add_argument_group("reporting")
    rp.add_argument("--summary-json", metavar="PATH", help="also write the summary as JSON to PATH")
    rp.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    rp.add_argument("--log-interval", type=seconds, default=DEFAULT_LOG_INTERVAL, metavar="SECONDS",
                    help="when stderr is not a terminal: seconds between progress lines, instead of bars "
                         f"(default: {DEFAULT_LOG_INTERVAL:g})")
    add_verbosity_arguments(p, group=rp,
                            quiet_help="errors only: no progress, warnings or summary (--json still prints)",
                            verbose_help="also log each phase's time and the decisions taken")


def add_mix_argument(group, sources: str) -> None:
    """``--mix FILE`` (both commands) and ``--mix-plot``."""
    group.add_argument("--mix", metavar="FILE",
                       help="a mixture file (JSON, or YAML with PyYAML; docs/PREPROCESSING.md \"Mixtures\"): "
                            f"sources, each with inputs {sources}, and their weights in trained tokens (default), "
                            "tokens, sequences or epochs; the packs hold them at those shares per split, every "
                            "sequence's source recorded; the summary reports target and realised shares against "
                            "a data_path blend of the same weights (default: no mixture)")
    group.add_argument("--mix-plot", metavar="PNG",
                       help="with --mix: also plot the target, realised and data_path shares per split and "
                            "source to PNG (matplotlib) (default: none)")


def add_staging_argument(group) -> None:
    """``--staging-dir``, shared by preprocess_sft and repack_sft (an s3:// / msc:// output)."""
    group.add_argument("--staging-dir", metavar="DIR",
                       help="s3:// and msc:// output prefixes: the local directory where the run works and "
                            "stages the shards before uploading them (needs room for the output; give the same "
                            "one to --resume; with --engine ray, one every node mounts at the same path) "
                            "(default: the system's temporary directory; with --engine ray, the bucket: the work "
                            "directory is .NAME.preprocess/ beside the output, written by the tasks)")


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

def pack_settings_of(args) -> PackSettings:
    """The packing flags (:func:`add_packing_arguments`, and ``--skip-bad``) as settings."""
    return PackSettings(
        pack_size=args.pack_size, algorithm=args.packing_algorithm, seed=args.seed, overlong=args.overlong,
        truncated_turn_loss=args.truncated_turn_loss, pad_seq_to_mult=args.pad_seq_to_mult,
        pad_layout=args.pad_layout, cp=args.cp, tp=args.tp, sp=args.sp, fp8=args.fp8, pad_id=args.pad_id, split=args.split,
        max_packs_per_shard=args.max_packs_per_shard, max_shard_bytes=args.max_shard_bytes,
        skip_bad=args.skip_bad)


def run_settings_of(prog: str, args) -> RunSettings:
    """The execution and check flags (:func:`add_run_arguments`) and ``--staging-dir`` as settings."""
    return RunSettings(workers=args.workers, engine=args.engine, ray_address=args.ray_address, resume=args.resume,
                       overwrite=args.overwrite, check=args.check, verify_masks=args.verify_masks,
                       progress=progress_of(prog, args), staging_dir=args.staging_dir)


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


def progress_of(prog: str, args) -> Progress:
    """Bars on a terminal, periodic lines otherwise, nothing with -q."""
    return Progress(prog, "off" if args.quiet else "auto", args.log_interval)


#: Options of preprocess-sft and repack-sft that take a local path only (docs/TOOLS.md "URLs").
LOCAL_ONLY_FLAGS = ("--staging-dir", "--summary-json", "--plan-only", "--mix", "--mix-plot", "--skip-report",
                    "--chat-template")


def usage_problem(args) -> str:
    """A combination of flags that cannot mean what it says, as one line naming the options ('' if none);
    first, a URL given to an option that takes a local path only (before anything else is judged)."""
    remote = local_only((flag, getattr(args, flag[2:].replace("-", "_"), None)) for flag in LOCAL_ONLY_FLAGS)
    if remote:
        return remote
    if args.overlong == "error" and args.skip_bad:
        return ("--overlong error stops at the first overlong conversation, but --skip-bad would skip it: "
                "pass --overlong drop --skip-bad to skip and count overlong ones, or drop --skip-bad")
    if args.verify_masks < 0:
        return "--verify-masks takes a count >= 0"
    mix = getattr(args, "mix", None)
    if mix and (getattr(args, "input", None) or getattr(args, "store", None)):
        return ("--mix names each source's inputs and store itself: give it without "
                + ("--input" if getattr(args, "input", None) else "--store"))
    if mix and args.verify_masks:
        return ("--verify-masks checks the sources' stores one at a time: run it on each source's store "
                "(preprocess-sft --input ... --store DIR --verify-masks N), not on a mixture")
    if getattr(args, "mix_plot", None) and not mix:
        return "--mix-plot plots a mixture's shares: give --mix"
    if args.step_size is not None and (args.balance_for is not None or not getattr(args, "mix", None)):
        return ("--step-size orders a mixture's packs by steps without a topology: give it with --mix and "
                "without --balance-for (which holds the global batch size)")
    if args.balance_for is None and args.step_size is None and (
            args.balance_seed is not None or args.exchange_window != 1 or args.balance_epochs != 1
            or args.cost_model != "llama3-8b"):
        return "--cost-model, --balance-epochs, --balance-seed and --exchange-window shape the order of --balance-for: give it"
    if args.balance_for is None and args.balance_labels:
        return "--balance-labels evens out the trained tokens of each rank of --balance-for's topology: give it"
    if (args.balance_for is not None or args.step_size is not None) and getattr(args, "plan_only", None):
        return "--balance-for writes an order beside shards; --plan-only writes none (plan-batches plans one for them)"
    if args.balance_for is not None:
        try:
            balance = balance_settings_of(args)
            balance.topology()
            balance.model(1, "stored")
        except ShardError as exc:
            return f"--balance-for/--cost-model: {exc}"
    store, output = getattr(args, "store", None) or "", getattr(args, "output_prefix", None) or ""
    refused = url_refusal([("--store", store, False), ("--output-prefix", output, False),
                           ("--input", getattr(args, "input", None), True),
                           ("--tokenizer", getattr(args, "tokenizer", None), True)])
    if refused:
        return refused
    if store.startswith("msc://") and getattr(args, "input", None):
        return (f"--store {store}: a store written in object storage is locked by conditional writes, which "
                "msc:// does not offer; give its s3:// URL (repack-sft reads an msc:// store)")
    if output.startswith("msc://") and args.engine == "ray" and not args.staging_dir:
        return (f"--output-prefix {output}: with --engine ray the work directory goes beside it, locked by "
                "conditional writes, which msc:// does not offer; give its s3:// URL, or --staging-dir DIR "
                "on a filesystem every node mounts")
    return ""


def run_and_report(prog: str, run, cfg, args, formatter=None) -> int:
    """Run, print the summary (``formatter``, default ``summary.format_summary``) or the one-line
    error; the exit codes of both CLIs. Warnings above ``--warn-above`` go to stderr first."""
    with tool_scope():
        return _report(prog, run, cfg, args, formatter)


def _report(prog: str, run, cfg, args, formatter) -> int:
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
    for line in decision_warnings(summary, getattr(args, "warn_above", 1.0)):
        logging.getLogger("megatron_sft_idx.preprocess").warning(line)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
    if getattr(args, "mix_plot", None) and summary.get("mixture"):
        try:
            plot_mixture(summary["mixture"], args.mix_plot)
        except (ShardError, MissingExtraError) as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    elif not args.quiet:
        print((formatter or format_summary)(summary))
    return 0


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


# --------------------------------------------------------------------------- repack-sft


REPACK_PROG = "repack-sft"
REPACK_DESCRIPTION = """\
New packed shards from a sequence store kept by preprocess-sft --store, without tokenizing again.

A new pack size, pad multiple (--cp/--tp/--sp), algorithm, seed, split or shard size only
plans and writes again; the shards are byte-identical to those of a fresh preprocess-sft with
the same inputs and settings. --plan-only PATH writes just the pack plan, to serve packs
virtually (VirtualPackedDataset) without writing any token. --for megatron-lm-5017 writes
instead one upstream .bin/.idx pair, one sequence per conversation, for Megatron-LM's
SFTDataset of PR #5017, which packs and masks at run time (docs/TRAINING.md says what it
trains differently); --pack-size is then only its --seq-length, to count what it will drop.
--for nemo-rl-3380 writes the shards and, beside each, P.nemo_rl.jsonl: one row of text
messages per pack for NeMo-RL's MegatronSFTPackedDataset (PR #3380) under its identity
prompt format, each sequence checked to re-tokenize to its stored ids (no CP padding: NeMo-RL
pads itself).

Example:

  repack-sft --store /data/sft/store --output-prefix /data/sft/cp4/chat \\
      --pack-size 8192 --cp 4 --split 98,1,1 --workers 8
  repack-sft --store /data/sft/store --for megatron-lm-5017 --output-prefix /data/sft/lm/chat \\
      --pack-size 8192
  repack-sft --store /data/sft/store --for nemo-rl-3380 --output-prefix /data/sft/rl/chat \\
      --pack-size 8192
"""


def build_repack_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=REPACK_PROG, description=REPACK_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input and output")
    io.add_argument("--store", metavar="DIR|URL",
                    help="a sequence store kept by preprocess-sft --store DIR|URL (complete); a URL's is "
                         "mirrored on each node's disk and verified (required unless --mix)")
    add_mix_argument(io, "already tokenized into its store (repack-sft never tokenizes)")
    io.add_argument("--output-prefix", help="output shard prefix, as preprocess-sft's (required unless "
                                            "--plan-only)")
    io.add_argument("--plan-only", metavar="PATH",
                    help="write only the pack plan to PATH (for VirtualPackedDataset); no shards")
    io.add_argument("--for", dest="consumer", choices=("shards", MEGATRON_LM_5017, NEMO_RL_3380), default="shards",
                    help="shards (default): packed shards of this project; megatron-lm-5017: one .bin/.idx "
                         "pair, a sequence per conversation, for Megatron-LM's SFTDataset (PR #5017); "
                         "nemo-rl-3380: the shards and a JSONL of text rows beside each, for NeMo-RL's "
                         "MegatronSFTPackedDataset (PR #3380, identity prompt format)")
    io.add_argument("--tokenizer", metavar="PATH|URL|NAME",
                    help="tokenizer for --verify-masks, as preprocess-sft takes it, and the tokenizer.json "
                         "--for nemo-rl-3380 decodes with (default: where the store found it)")
    add_staging_argument(io)
    add_packing_arguments(p)
    add_balance_arguments(p)
    add_run_arguments(p, "worker processes for writing shards (local engine) (default: 1)")
    return p


def _repack_config(args) -> RepackConfig:
    return RepackConfig(args.store, args.output_prefix, plan_only=args.plan_only, mix=args.mix,
                        tokenizer=args.tokenizer, pack=pack_settings_of(args), run=run_settings_of(REPACK_PROG, args),
                        balance=balance_settings_of(args))


def repack_main(argv=None) -> int:
    parser = build_repack_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    if not args.output_prefix and not args.plan_only:
        return _cli.usage_error(parser, "--output-prefix is required (or --plan-only PATH)")
    if not args.store and not args.mix:
        return _cli.usage_error(parser, "--store is required (or --mix FILE, whose sources name their stores)")
    if args.consumer == MEGATRON_LM_5017:
        return _conversations_main(parser, args)
    if args.consumer == NEMO_RL_3380:
        refused = _nemo_rl_refusal(args)
        if refused:
            return _cli.usage_error(parser, refused)
    problem = usage_problem(args)
    if problem:
        return _cli.usage_error(parser, problem)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .driver import repack   # (start-up: the driver, after HF_HUB_OFFLINE is set)

    formatter = format_plan_summary if args.plan_only else None
    if args.consumer == NEMO_RL_3380:
        return run_and_report(REPACK_PROG, _with_nemo_rl_jsonl(repack, _nemo_rl_tokenizer(args), args.overwrite),
                              _repack_config(args), args, _format_nemo_rl)
    return run_and_report(REPACK_PROG, repack, _repack_config(args), args, formatter)


def _nemo_rl_refusal(args) -> str:
    """Why ``--for nemo-rl-3380`` cannot run with these arguments ('' when it can)."""
    if args.plan_only:
        return f"--for {NEMO_RL_3380} writes shards and their JSONL: give --output-prefix, not --plan-only"
    if args.cp > 1 or args.tp > 1 or args.sp or args.fp8 or (args.pad_seq_to_mult or 1) > 1:
        return (f"--for {NEMO_RL_3380} writes unpadded sequences: NeMo-RL pads each itself "
                "(megatron_sft_context_parallel_size); drop --cp/--tp/--sp/--fp8/--pad-seq-to-mult")
    if args.mix and not args.tokenizer:
        return f"--for {NEMO_RL_3380} with --mix needs --tokenizer (the tokenizer.json to decode with)"
    return local_only([("--output-prefix", args.output_prefix)])   # the JSONL is written locally


def _nemo_rl_tokenizer(args) -> str:
    return args.tokenizer or SequenceStore(args.store).tokenizer_path


def _with_nemo_rl_jsonl(repack, tokenizer: str, overwrite: bool):
    """``repack``, then each output shard's JSONL (``summary["nemo_rl_3380"]``, one entry a shard)."""
    def run(cfg) -> dict:
        summary = repack(cfg)
        summary[NEMO_RL_3380] = [write_nemo_rl_jsonl(p, tokenizer, overwrite=overwrite)
                                 for p in summary["outputs"]]
        return summary
    return run


def _format_nemo_rl(summary: dict) -> str:
    lines = [format_summary(summary)]
    for out in summary[NEMO_RL_3380]:
        lines.append(f"wrote {out['path']}: {out['rows']:,} rows, {out['sequences']:,} sequences, {out['tokens']:,} "
                     f"tokens, each re-tokenized to its ids; NeMo-RL: megatron_sft_prompt_format identity, "
                     f"max_input_seq_length {out['max_seq_length']}, megatron_sft_pad_token {out['pad_token']!r}")
    return "\n".join(lines)


def _conversations_main(parser, args) -> int:
    """``repack-sft --for megatron-lm-5017``: the store's conversations as one bin/idx pair."""
    if args.mix or args.plan_only:
        return _cli.usage_error(parser, f"--for {MEGATRON_LM_5017} writes one store's conversations: "
                                        "give --store and --output-prefix, not --mix or --plan-only")
    refused = local_only([("--output-prefix", args.output_prefix)])   # the pair is written locally
    if refused:
        return _cli.usage_error(parser, refused)
    with tool_scope():
        try:
            out = write_conversations(args.store, args.output_prefix, overwrite=args.overwrite,
                                      seq_length=args.pack_size)
        except ShardError as exc:
            print(f"{REPACK_PROG}: error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif not args.quiet:
        print(f"wrote {out['paths'][0]} and .idx: {out['conversations']:,} conversations, {out['tokens']:,} "
              f"tokens ({out['dtype']}) from store {out['store_id'][:12]}; {out['longer_than_seq_length']:,} "
              f"longer than --pack-size {out['seq_length']:,}, which SFTDataset drops at that --seq-length")
    return 0
