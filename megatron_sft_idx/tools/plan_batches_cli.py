"""``plan-batches SHARD... --balance-for DP,MBS,GBS [...]``: balance packed data for a topology.

Reads the shards' sequence boundaries (``.idx``, ``.seq.idx``, ``.seq.bin``; never tokens),
prices every pack with the cost model, and plans balanced per-epoch pack orders for Megatron's
sampler: every step keeps the packs of the adapters' seeded shuffle; only which rank (and
micro-batch) trains which of them changes. Prints the predicted straggler overhead (max rank
cost / mean - 1 per step) of the plain shuffle and of the balanced order; ``--out`` writes the
order file that training serves (``docs/BATCHING.md``), ``--plot`` draws the overhead
(matplotlib, the ``tools`` extra).

SHARD is a prefix, a directory or glob of shards, or a manifest; several are concatenated in
the order given (the pack ids the order permutes).

``--dynamic`` plans NeMo-RL-style dynamic micro-batches of unpacked sequences instead (a token
budget ``--max-tokens-per-microbatch``, widths rounded up to ``--sequence-length-round``), from
a sequence store (``--store DIR`` of preprocess-sft, its partitions verified first) or shards
whose every pack is one sequence, and prints per epoch the micro-batch count and the padding.

Exit codes: 0 planned, 1 a shard is corrupt, 2 usage error or nothing found.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .. import _cli
from ..batching.balance import plan_order
from ..batching.cost import PRESETS, CostModel, shard_pack_costs
from ..batching.dynamic import plan_dynamic
from ..batching.layout import Topology
from ..batching.order import ALGORITHMS
from ..batching.report import format_report, order_reports, plot_report
from ..errors import ShardError, ShardNotFoundError
from ..format import PAD_LAYOUTS, PAD_LAYOUT_STORED
from ..multi import MultiShardDataset
from ..preprocess.sequences import StoreSequences, sequence_lengths
from ..publishing import write_bytes
from ..storage.urls import local_only, url_refusal

PROG = "plan-batches"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="*", help="shard prefixes, directories, globs or manifests")
    dyn = p.add_argument_group("dynamic batching (unpacked sequences)")
    dyn.add_argument("--dynamic", action="store_true",
                     help="plan token-budget micro-batches of unpacked sequences (NeMo-RL's) instead of an order")
    dyn.add_argument("--store", metavar="DIR|URL", help="with --dynamic: a sequence store (preprocess-sft --store DIR|URL; a "
                     "URL's is mirrored on local disk and verified)")
    dyn.add_argument("--max-tokens-per-microbatch", type=int, metavar="N",
                     help="with --dynamic: rows x padded width of a micro-batch stays within N (required)")
    dyn.add_argument("--sequence-length-round", type=int, default=1, metavar="N",
                     help="with --dynamic: round widths up to a multiple of N (default: 1)")
    topo = p.add_argument_group("topology")
    topo.add_argument("--balance-for", metavar="DP,MBS,GBS",
                      help="the training topology: data-parallel size, packs per micro-batch, packs per optimizer "
                           "step (required; with --dynamic MBS is 1: the token budget forms the micro-batches)")
    topo.add_argument("--dp", type=int, metavar="N", help="alias: DP of --balance-for")
    topo.add_argument("--micro-batch-size", type=int, metavar="N", help="alias: MBS of --balance-for (default: 1)")
    topo.add_argument("--global-batch-size", type=int, metavar="N", help="alias: GBS of --balance-for")
    cost = p.add_argument_group("cost model")
    _cli.add_aliased(cost, "--cost-model", "--model", dest="cost_model", default=None,
                     metavar="PRESET|LINEAR,ATTENTION",
                     help=f"price of a pack: a model preset ({', '.join(sorted(PRESETS))}) or FLOPs per token and "
                          "per token squared (default: llama3-8b; --model is another name of it)")
    cost.add_argument("--linear", type=float, help="alias: LINEAR of --cost-model LINEAR,ATTENTION (with --attention)")
    cost.add_argument("--attention", type=float, help="alias: ATTENTION of --cost-model LINEAR,ATTENTION")
    cost.add_argument("--recompute", action="store_true", help="full activation recomputation (with a preset)")
    _cli.add_aliased(cost, "--pad-seq-to-mult", "--pad-multiple", dest="pad_seq_to_mult", type=int, default=1,
                     metavar="N",
                     help="the multiple the kernel pads each sequence to: the shards' pad_seq_to_mult, the CP/SP "
                          "multiple (default: 1; --pad-multiple is another name of it)")
    cost.add_argument("--pad-layout", default=PAD_LAYOUT_STORED, choices=list(PAD_LAYOUTS),
                      help="stored: the kernel sees L (Megatron-LM); runtime: L-1 (Bridge)")
    plan = p.add_argument_group("order")
    _cli.add_aliased(plan, "--balance-seed", "--seed", dest="balance_seed", type=int, default=1234, metavar="SEED",
                     help="the training run's data seed (default: 1234; --seed is another name of it)")
    _cli.add_aliased(plan, "--balance-epochs", "--epochs", dest="balance_epochs", type=int, default=1, metavar="N",
                     help="epochs to plan (default: 1; --epochs is another name of it)")
    plan.add_argument("--algorithm", default="kk", choices=list(ALGORITHMS),
                      help="kk (Karmarkar-Karp), lpt, or shuffle (no balancing) (default: kk)")
    plan.add_argument("--exchange-window", type=int, default=1,
                      help="steps whose packs may trade places (default 1; more CHANGES step membership)")
    p.add_argument("--out", help="write the order file here (*.order; a local path or an s3:// / msc:// URL)")
    p.add_argument("--plot", help="draw the per-step overhead into this PNG")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


#: ``--cost-model`` when neither it nor ``--linear``/``--attention`` is given
_DEFAULT_COST_MODEL = "llama3-8b"


class _Usage(Exception):
    """A usage problem found after parsing: reported as argparse reports its own (exit 2)."""


def _cost_model(args, parser):
    spec = args.cost_model or _DEFAULT_COST_MODEL
    if args.linear is not None:
        if args.cost_model is not None:   # (given, even as the default: two spellings of one setting)
            raise _Usage("--linear/--attention are another spelling of --cost-model LINEAR,ATTENTION: give one")
        spec = f"{args.linear!r},{args.attention!r}"
    return CostModel.parse(spec, pad_multiple=args.pad_seq_to_mult, pad_layout=args.pad_layout,
                           recompute=args.recompute)


def _topology(args, parser):
    """``--balance-for``, or its parts given as ``--dp``/``--micro-batch-size``/``--global-batch-size``."""
    parts = (args.dp, args.micro_batch_size, args.global_batch_size)
    if args.balance_for is not None:
        if any(v is not None for v in parts):
            raise _Usage("--dp, --micro-batch-size and --global-batch-size are the parts of --balance-for: give one")
        text = args.balance_for
    elif args.dp is None or args.global_batch_size is None:
        raise _Usage("give the topology: --balance-for DP,MBS,GBS")
    else:
        text = f"{args.dp},{1 if args.micro_batch_size is None else args.micro_batch_size},{args.global_batch_size}"
    try:
        topology = Topology.parse(text)
    except ShardError as exc:
        raise _Usage(f"--balance-for: {exc}") from None
    if args.dynamic and topology.micro_batch_size != 1:
        raise _Usage("--dynamic forms micro-batches by --max-tokens-per-microbatch: --balance-for DP,1,GBS")
    return topology


def _usage_problem(args) -> Optional[str]:
    if args.dynamic:
        if bool(args.store) == bool(args.shards):
            return "--dynamic plans from a sequence store (--store DIR) or from shards: give one of them"
        if args.max_tokens_per_microbatch is None:
            return "--dynamic needs --max-tokens-per-microbatch"
        if args.out or args.plot or args.exchange_window != 1 or args.algorithm != "kk":
            return "--out, --plot, --algorithm and --exchange-window are for balanced orders, not --dynamic"
    elif args.store or args.max_tokens_per_microbatch is not None or args.sequence_length_round != 1:
        return "--store, --max-tokens-per-microbatch and --sequence-length-round go with --dynamic"
    elif not args.shards:
        return "give the shards to balance"
    if (args.linear is None) != (args.attention is None):
        return "--linear and --attention go together"
    return local_only([("--plot", args.plot)]) or url_refusal([("--store", args.store, False)])


def _dynamic(args) -> int:
    """``--dynamic``: plan each epoch's dynamic micro-batches and print their statistics."""
    try:
        if args.store:
            source = StoreSequences(args.store)
        else:
            source = MultiShardDataset.open(args.shards if len(args.shards) > 1 else args.shards[0])
        lengths = sequence_lengths(source)
        topology = args.topology
        epochs = [plan_dynamic(lengths, global_batch_size=topology.global_batch_size,
                               data_parallel_size=topology.data_parallel_size,
                               max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                               sequence_length_round=args.sequence_length_round, seed=args.balance_seed,
                               epoch=e).stats()
                  for e in range(args.balance_epochs)]
    except ShardNotFoundError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if exc.path else 2
    if args.json:
        print(json.dumps({"sequences": int(lengths.shape[0]), "epochs": epochs}))
        return 0
    print(f"{lengths.shape[0]:,} sequences, DP {args.topology.data_parallel_size}, global batch "
          f"{args.topology.global_batch_size}, budget "
          f"{args.max_tokens_per_microbatch:,} tokens, widths rounded to {args.sequence_length_round}:")
    for e, s in enumerate(epochs):
        print(f"epoch {e}: {s['steps']:,} steps, {s['microbatches']:,} micro-batches per rank "
              f"({s['microbatches_per_step_mean']:.2f} per step, max {s['microbatches_per_step_max']}), "
              f"padding {100 * s['padding_share']:.2f} % of {s['padded_tokens']:,} padded tokens")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    try:
        problem = _usage_problem(args)
        if problem:
            raise _Usage(problem)
        args.topology = _topology(args, parser)
        model = None if args.dynamic else _cost_model(args, parser)
    except _Usage as exc:
        return _cli.usage_error(parser, str(exc))
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    if args.dynamic:
        return _dynamic(args)
    topology = args.topology
    try:
        source = MultiShardDataset.open(args.shards if len(args.shards) > 1 else args.shards[0])
    except ShardNotFoundError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if exc.path else 2
    if args.out and len(source) < topology.global_batch_size:   # an order with no step: nothing to write
        print(f"{PROG}: error: {len(source):,} packs, fewer than one global batch of {topology.global_batch_size:,} "
              f"({topology.describe()}): an order would hold no step; no order written (train this data "
              "without one, or balance for a smaller global batch)", file=sys.stderr)
        return 2
    try:
        costs = shard_pack_costs(source, model)
        order = plan_order(costs, topology, model, seed=args.balance_seed, epochs=args.balance_epochs,
                           algorithm=args.algorithm,
                           exchange_window=args.exchange_window,
                           source={"shards": list(source.prefixes), "packs": [int(c) for c in source.counts]})
        if args.out:   # whole: a rename locally, one PUT to object storage (as a manifest is written)
            write_bytes(args.out, order.to_bytes())
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if exc.path else 2
    reports = order_reports(order)
    notes = reports["balanced"].warnings() if args.exchange_window == 1 else []
    if args.plot:
        plot_report(reports, args.plot)
    if args.json:
        print(json.dumps({"topology": topology.to_dict(), "cost_model": model.to_dict(), "packs": order.num_packs,
                          "epochs": order.epochs, "out": args.out, "warnings": notes,
                          **{k: r.summary for k, r in reports.items()}}))
    else:
        print(f"{order.num_packs:,} packs, {topology.describe()}, cost model {model.name}; predicted straggler "
              "overhead per step (max rank cost / mean - 1):")
        print(format_report(reports, notes))
        if args.out:
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
