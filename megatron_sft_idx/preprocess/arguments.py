"""The flags ``preprocess-sft`` and ``repack-sft`` share, defined once, and how a run is reported.

Each flag group is added by one function and read into its settings by one: the packing flags
(:func:`add_packing_arguments` -> :class:`~.config.PackSettings` by :func:`pack_settings_of`), the
balanced order (:func:`add_balance_arguments` -> :func:`balance_settings_of`), execution, checks
and reporting (:func:`add_run_arguments` -> :func:`run_settings_of`). :func:`usage_problem` judges
a combination of flags before anything runs; :func:`run_and_report` runs the driver and prints its
summary or its one-line error, with the exit codes of both commands. The commands themselves are
:mod:`.cli` (``preprocess-sft``) and :mod:`.repack_cli` (``repack-sft``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .._cli import percent, positive_int, seconds, size_arg
from .._extras import MissingExtraError
from .._progress import DEFAULT_LOG_INTERVAL, Progress, add_verbosity_arguments
from .._signals import Terminated, exit_code, tool_scope
from ..errors import ShardError
from ..packing import ALGORITHMS, DEFAULT_ALGORITHM, FP8_BLOCK
from ..storage.urls import local_only, url_refusal
from .config import BalanceSettings, PackSettings, RunSettings
from .engines import ENGINES
from .mixreport import plot_mixture
from .summary import decision_warnings, format_summary


def _split(text: str):
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated weights like 98,1,1, got {text!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise argparse.ArgumentTypeError("takes 1-3 non-negative weights (train,valid,test) with a positive sum")
    return parts


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
