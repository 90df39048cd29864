"""``repack-sft``'s command line (:func:`repack_main`): new shards from a sequence store, no tokenizing.

The flags it shares with ``preprocess-sft`` (:mod:`.cli`) are :mod:`.arguments`'; here are the
store, the consumer (``--for``: our shards, Megatron-LM #5017's bin/idx pair, NeMo-RL #3380's
JSONL beside the shards) and their refusals.

Example::

    python tools/repack_sft.py --store /data/sft/store --output-prefix /data/sft/cp4/chat \\
        --pack-size 8192 --cp 4 --split 98,1,1 --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import _cli
from .._signals import tool_scope
from ..errors import ShardError
from ..storage.urls import local_only
from .arguments import (add_balance_arguments, add_mix_argument, add_packing_arguments, add_run_arguments,
                        add_staging_argument, balance_settings_of, pack_settings_of, run_and_report,
                        run_settings_of, usage_problem)
from .config import RepackConfig
from .conversations import MEGATRON_LM_5017, write_conversations
from .nemo_rl import NEMO_RL_3380, write_nemo_rl_jsonl
from .store import SequenceStore
from .summary import format_plan_summary, format_summary

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
