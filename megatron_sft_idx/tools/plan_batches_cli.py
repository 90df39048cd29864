"""``plan-batches SHARD... --balance-for DP,MBS,GBS [...]``: balance packed data for a topology.

Reads the shards' sequence boundaries (``.idx``, ``.seq.idx``, ``.seq.bin``) and loss masks
(``.loss.bin``; tokens only with ``--eos-id``), prices every pack with the cost model, counts
every sequence's trained tokens, and plans balanced per-epoch pack orders for Megatron's
sampler: every step keeps the packs of the adapters' seeded shuffle; only which rank (and
micro-batch) trains which of them changes. Prints the predicted straggler overhead (max rank
cost / mean - 1 per step) of the plain shuffle and of the balanced order, and how even their
trained tokens are per step, rank and micro-batch; ``--out`` writes the order file that
training serves, with every step's trained-token denominators (``docs/BATCHING.md``),
``--plot`` draws the overhead (matplotlib, the ``tools`` extra). ``--no-counts`` reads the
index only (an order without denominators).

``--balance-labels`` evens out trained tokens per rank and micro-batch as well (per step too
with ``--exchange-window`` > 1, which changes step membership). ``--audit`` replays each
trainer's loss normalisation (Megatron-LM per-token and per-micro-batch with its CP split,
Megatron-Bridge's defaults, NeMo-RL token and sequence level, TRL / transformers) on the
planned steps -- of ``--order FILE``, or of the shuffle, the balanced and the label-balanced
orders -- and prints how far each token's weight is from the step's exact token mean.

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
from ..batching.audit import audit_order, format_audit
from ..batching.balance import DEFAULT_LABEL_SLACK, plan_order
from ..batching.cost import PRESETS, CostModel, shard_pack_costs
from ..batching.dynamic import plan_dynamic
from ..batching.layout import Topology
from ..batching.order import ALGORITHMS, Order
from ..batching.report import format_report, format_trained, order_reports, plot_report
from ..batching.trained import trained_counts
from ..errors import ShardError, ShardNotFoundError
from ..format import PAD_LAYOUTS, PAD_LAYOUT_STORED
from ..multi import MultiShardDataset
from ..preprocess.sequences import StoreSequences, sequence_lengths
from ..preprocess.store import read_once
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
    labels = p.add_argument_group("trained tokens (denominators, label balancing, the audit)")
    labels.add_argument("--eos-id", type=int, metavar="ID",
                        help="the tokenizer's EOS: count Megatron-Bridge 0.6's trained tokens too "
                             "(it zeroes EOS inputs)")
    labels.add_argument("--no-counts", action="store_true",
                        help="read the index only: no trained-token counts (an order without denominators)")
    labels.add_argument("--balance-labels", action="store_true",
                        help="even out trained tokens per rank and micro-batch too "
                             "(per step with --exchange-window > 1)")
    labels.add_argument("--label-slack", type=float, default=DEFAULT_LABEL_SLACK, metavar="FRACTION",
                        help="how far label balancing may move a rank's cost from the mean, a fraction "
                             f"(default {DEFAULT_LABEL_SLACK})")
    labels.add_argument("--audit", action="store_true",
                        help="replay each trainer's loss normalisation on the planned steps (docs/BATCHING.md)")
    labels.add_argument("--order", metavar="FILE|URL", help="with --audit: audit this order file instead of planning")
    labels.add_argument("--cp", type=int, default=1, metavar="N",
                        help="with --audit: the context-parallel size (default 1)")
    labels.add_argument("--seq-length", type=int, metavar="N",
                        help="with --audit: Megatron-LM's --seq-length (default: the packs' size)")
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
        if args.order and not any(v is not None for v in parts):
            return None   # --audit --order: the order's own
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
        if args.balance_labels or args.audit or args.eos_id is not None or args.no_counts:
            return "--balance-labels, --audit, --eos-id and --no-counts are for balanced orders, not --dynamic"
    elif args.store or args.max_tokens_per_microbatch is not None or args.sequence_length_round != 1:
        return "--store, --max-tokens-per-microbatch and --sequence-length-round go with --dynamic"
    elif not args.shards:
        return "give the shards to balance"
    elif args.no_counts and (args.balance_labels or args.audit or args.eos_id is not None):
        return "--balance-labels, --audit and --eos-id count trained tokens: drop --no-counts"
    elif (args.order or args.cp != 1 or args.seq_length is not None) and not args.audit:
        return "--order, --cp and --seq-length go with --audit"
    elif args.order and (args.out or args.balance_labels or args.plot):
        return "--audit --order audits an existing order: --out, --plot and --balance-labels plan a new one"
    elif args.cp < 1 or args.label_slack < 0:
        return "--cp must be >= 1 and --label-slack >= 0"
    elif args.balance_labels and args.algorithm == "shuffle":
        return "--balance-labels deals packs: use --algorithm kk or lpt"
    if (args.linear is None) != (args.attention is None):
        return "--linear and --attention go together"
    return local_only([("--plot", args.plot)]) or url_refusal([("--store", args.store, False)])


def _dynamic(args) -> int:
    """``--dynamic``: plan each epoch's dynamic micro-batches and print their statistics."""
    try:
        with read_once([args.store]):   # (a store URL's mirror on this node: gone after the lengths are read)
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
    try:
        source = MultiShardDataset.open(args.shards if len(args.shards) > 1 else args.shards[0])
    except ShardNotFoundError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if exc.path else 2
    topology = args.topology
    if topology is not None and (args.out or args.audit) and len(source) < topology.global_batch_size:
        print(f"{PROG}: error: {len(source):,} packs, fewer than one global batch of {topology.global_batch_size:,} "
              f"({topology.describe()}): an order would hold no step; no order "
              f"{'audited' if args.audit else 'written'} (train this data without one, or balance for a smaller "
              "global batch)", file=sys.stderr)
        return 2
    try:
        counts = None if args.no_counts else trained_counts(source, eos_id=args.eos_id)
        if args.order:
            return _audit_given(args, source, counts)
        orders = _plan(args, source, model, counts)
        order = orders["labels" if args.balance_labels else "shuffle" if args.algorithm == "shuffle" else "balanced"]
        if args.out:   # whole: a rename locally, one PUT to object storage (as a manifest is written)
            write_bytes(args.out, order.to_bytes())
        audits = ({name: audit_order(o, counts, cp=args.cp, source=source, seq_length=_seq_length(args, source))
                   for name, o in orders.items()} if args.audit else None)
    except ShardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if exc.path else 2
    _print_plan(args, order, orders, model, audits)
    return 0


def _seq_length(args, source) -> int:
    return args.seq_length if args.seq_length is not None else int(source.summary.capacity)


def _plan(args, source, model, counts) -> dict:
    """The order asked for, and with ``--audit`` the ones it is compared with: ``{"shuffle",
    "balanced", "labels"}`` (those planned)."""
    costs = shard_pack_costs(source, model)
    common = dict(seed=args.balance_seed, epochs=args.balance_epochs, exchange_window=args.exchange_window,
                  source={"shards": list(source.prefixes), "packs": [int(c) for c in source.counts]},
                  trained=counts, label_slack=args.label_slack)
    wanted = {"shuffle"} if args.algorithm == "shuffle" else {"labels"} if args.balance_labels else {"balanced"}
    if args.audit:
        wanted = {"shuffle", "balanced", "labels"}
    algorithm = "kk" if args.algorithm == "shuffle" else args.algorithm
    out = {}
    for name in ("shuffle", "balanced", "labels"):
        if name in wanted:
            out[name] = plan_order(costs, args.topology, model, algorithm="shuffle" if name == "shuffle" else algorithm,
                                   balance_labels=name == "labels", **common)
    return out


def _audit_given(args, source, counts) -> int:
    """``--audit --order FILE``: the order, proven to be this data's, audited for its topology
    (or the one given)."""
    order = Order.load(args.order)
    order.check_costs(shard_pack_costs(source, order.cost_model), path=args.order)
    if order.trained is not None:
        order.check_trained(counts, path=args.order)
    audits = {"order": audit_order(order, counts, topology=args.topology, cp=args.cp, source=source,
                                   seq_length=_seq_length(args, source))}
    if args.json:
        print(json.dumps({"order": args.order, "topology": (args.topology or order.topology).to_dict(), "cp": args.cp,
                          "audit": {k: [r.summary() for r in v] for k, v in audits.items()}}))
    else:
        print(f"{args.order}: {order.num_packs:,} packs, {(args.topology or order.topology).describe()}, CP "
              f"{args.cp}; each token's weight against its step's exact token mean (|w * N - 1|):")
        print(format_audit(audits))
    return 0


def _print_plan(args, order, orders, model, audits) -> None:
    topology = args.topology
    reports = order_reports(order)
    notes = reports["balanced"].warnings() if args.exchange_window == 1 else []
    if args.plot:
        plot_report(reports, args.plot)
    trained = order.stats.get("trained")
    if audits is not None:
        trained = {"rule": trained["rule"], **{name: o.stats["trained"]["balanced"] for name, o in orders.items()}}
    if args.json:
        print(json.dumps({"topology": topology.to_dict(), "cost_model": model.to_dict(), "packs": order.num_packs,
                          "epochs": order.epochs, "out": args.out, "warnings": notes,
                          **{k: r.summary for k, r in reports.items()}, "trained": trained,
                          **({"cp": args.cp, "audit": {k: [r.summary() for r in v] for k, v in audits.items()}}
                             if audits is not None else {})}))
        return
    print(f"{order.num_packs:,} packs, {topology.describe()}, cost model {model.name}; predicted straggler "
          "overhead per step (max rank cost / mean - 1):")
    print(format_report(reports, notes))
    if trained is not None:
        print(f"trained tokens ({trained['rule']!r} rule) per step, and their spread (max - min) / mean over ranks "
              "and micro-batches:")
        print(format_trained({k: v for k, v in trained.items() if k != "rule"}))
    if audits is not None:
        print(f"each trainer's loss normalisation, CP {args.cp}: each token's weight against its step's exact token "
              "mean (|w * N - 1|, mean and max over steps):")
        print(format_audit(audits))
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
