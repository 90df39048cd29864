"""``inspect-idx PREFIX...`` (also ``tools/inspect_idx.py``): what shards hold, one pack, or SQL.

Modes: a summary (default; ``--plot OUT.png`` also draws its histograms), ``--pack N``
(one pack with its boundaries and trained spans, detokenized when the recorded tokenizer
is available), ``--sql "SELECT ... FROM packs"`` (DuckDB over the shards, zero-copy),
``--order [FILE|auto]`` (a balanced order's straggler report next to the shuffle's:
:mod:`.order_view`; ``--plot`` draws it), ``--consumers`` (positions each consumer trains:
Megatron-LM, Megatron-Bridge 0.6 and next, TRL padding-free; :mod:`.inspect_consumers`).
Exit status: 0 done; 1 a shard is corrupt or the query failed; 2 usage error, a missing
shard or a missing optional dependency.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import List, Optional

from .. import _cli
from ..errors import ShardError, ShardSetError
from ..storage.urls import local_only
from .plot import plot_summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inspect-idx",
        description="Summarise megatron_sft_idx shards, show one pack with its trained spans, or query them "
                    "with SQL (table 'packs'). Exit 0 = done, 1 = corrupt shard or failed query, 2 = usage error.")
    p.add_argument("shards", nargs="+", metavar="PREFIX",
                   help="shard prefix, glob, directory or manifest .json (several are read as one dataset)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--pack", type=int, default=None, metavar="N", help="show pack N (global index; -1 = last)")
    mode.add_argument("--sql", default=None, metavar="QUERY",
                      help="run QUERY over the table 'packs' (columns: pack, packed_len, num_sequences, "
                           "trainable_tokens, input_ids, loss_mask, seq_start_id, shard (its prefix), shard_index) "
                           "or 'sequences' (shard, shard_index, pack, sequence, length, trainable_tokens, source, "
                           "source_id: a mixture's, GROUP BY source); needs duckdb")
    mode.add_argument("--order", nargs="?", const="auto", default=None, metavar="FILE|auto",
                      help="report a balanced pack order for this data next to the shuffled order (default "
                           "auto: PREFIX.order beside a shard or manifest)")
    p.add_argument("--balance-for", default=None, metavar="DP,MBS,GBS",
                   help="with --order: the topology to report for (default: the order's)")
    mode.add_argument("--consumers", action="store_true",
                      help="count the positions each consumer trains (Megatron-LM, Megatron-Bridge 0.6 and "
                           "next, TRL padding-free); reads .bin and .loss.bin")
    p.add_argument("--eos-id", type=int, default=None, metavar="ID",
                   help="with --consumers: the tokenizer's EOS id (default: the one a conversion recorded, else the "
                        "recorded tokenizer's)")
    p.add_argument("--dp", type=int, default=None, metavar="N",
                   help="alias: DP of --balance-for (the others the order's)")
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="N",
                   help="alias: MBS of --balance-for (the others the order's)")
    p.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help="alias: GBS of --balance-for (the others the order's)")
    p.add_argument("--seq", type=int, default=None, metavar="K", help="with --pack: show only sequence K's text")
    p.add_argument("--tokenizer", default=None, metavar="PATH|URL|NAME",
                   help="with --pack: detokenize with this tokenizer directory or tokenizer.json (or an s3:// / "
                        "msc:// URL of one, or a Hugging Face name) "
                        "(default: the one the metadata records, if its files are unchanged)")
    p.add_argument("--no-text", action="store_true", help="with --pack: token ids only, no detokenizing")
    p.add_argument("--max-chars", type=int, default=1200, metavar="N",
                   help="with --pack: characters of text shown per sequence (default 1200)")
    p.add_argument("--max-rows", type=int, default=40, metavar="N", help="with --sql: rows printed (default 40)")
    p.add_argument("--bins", type=int, default=12, metavar="N", help="histogram bins (default 12)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw the summary's histograms to a PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("-v", "--verbose", action="store_true", help="log which files are read")
    return p


def _usage_problem(args) -> Optional[str]:
    if args.seq is not None and args.pack is None:
        return "--seq needs --pack"
    if args.eos_id is not None and not args.consumers:
        return "--eos-id goes with --consumers"
    if args.plot and (args.pack is not None or args.sql or args.consumers):
        return "--plot draws the summary (or with --order the order's report): use it without --pack/--sql"
    topology = (args.dp, args.micro_batch_size, args.global_batch_size)
    if args.balance_for is not None:
        if any(v is not None for v in topology):
            return "--dp, --micro-batch-size and --global-batch-size are the parts of --balance-for: give one"
        from ..batching.layout import Topology   # (start-up: numpy; --help and usage errors load only argparse)

        try:
            t = Topology.parse(args.balance_for)
        except ShardError as exc:
            return f"--balance-for: {exc}"
        args.dp, args.micro_batch_size, args.global_batch_size = topology = (
            t.data_parallel_size, t.micro_batch_size, t.global_batch_size)
    if args.order is None and any(v is not None for v in topology):
        return "--balance-for (or --dp, --micro-batch-size, --global-batch-size) goes with --order"
    if any(v is not None and v <= 0 for v in topology):
        return "--dp, --micro-batch-size and --global-batch-size must be positive"
    for flag in ("max_chars", "max_rows", "bins"):
        if getattr(args, flag) <= 0:
            return f"--{flag.replace('_', '-')} must be positive"
    return local_only([("--plot", args.plot)]) or None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    problem = _usage_problem(args)
    if problem:
        return _cli.usage_error(parser, problem)
    return _cli.run(parser.prog, lambda: _run(args))


def _run(args) -> int:
    from .merge_plan import resolve_sets   # (start-up: numba, as each mode's modules below; --help never)

    if args.sql:
        return _sql(args)
    if args.order is not None:
        from .order_view import format_order_view, order_view   # (start-up: the batching kernels)

        view = order_view(args.shards, args.order, dp=args.dp, micro_batch_size=args.micro_batch_size,
                          global_batch_size=args.global_batch_size, plot=args.plot)
        reports = view.pop("reports")
        _cli.emit(json.dumps(view, indent=1) if args.json else format_order_view(dict(view, reports=reports)))
        return _cli.EXIT_OK
    sets = resolve_sets(args.shards)
    if len(sets) > 1:
        if args.pack is None and not args.consumers and not args.plot:
            return _summaries(args, sets)
        raise ShardSetError(
            f"this directory holds {len(sets)} whole sets ("
            + ", ".join(s.describe() for s, _ in sets) + "); --pack, --consumers and --plot read one",
            path=args.shards[0], field="set", expected="one set", actual=f"{len(sets)} sets",
            hint=f"give one set's manifest or a glob of its shards (e.g. {_manifest_of(sets[0][1][0])}); "
                 "without a mode, inspect-idx summarizes each set")
    prefixes = sets[0][1]
    if args.consumers:
        from .inspect_consumers import consumer_audit, format_consumer_audit   # (start-up: this mode only)

        audit = consumer_audit(prefixes, args.eos_id)
        _cli.emit(json.dumps(audit, indent=1) if args.json else format_consumer_audit(audit))
        return _cli.EXIT_OK
    if args.pack is not None:
        from .pack_view import describe_pack, format_pack   # (start-up: this mode only)

        view = describe_pack(prefixes, args.pack, args.tokenizer, detokenize=not args.no_text)
        _cli.emit(json.dumps(view, indent=1) if args.json else format_pack(view, args.seq, args.max_chars))
        return _cli.EXIT_OK
    from .inspect import format_summary, summarize   # (start-up: this mode only)

    summary = summarize(prefixes, bins=args.bins)
    if args.plot:
        summary["plot"] = plot_summary(summary, args.plot)
    text = json.dumps(summary, indent=1) if args.json else format_summary(summary)
    if args.plot and not args.json:
        text += f"\nplot written to {summary['plot']}"
    _cli.emit(text)
    return _cli.EXIT_OK


def _manifest_of(prefix: str) -> str:
    """``BASE.json``, the manifest a producer writes beside the shards ``BASE_NNNNNN`` of a set."""
    return re.sub(r"_\d{6}$", "", prefix) + ".json"


def _summaries(args, sets) -> int:
    """One summary per set of a directory holding several (the splits of one run), each named."""
    from .inspect import format_summary, summarize   # (start-up: this mode only)

    out = [{"set": {"id": s.id, "name": s.name, "shards": s.count}, "summary": summarize(prefixes, bins=args.bins)}
           for s, prefixes in sets]
    if args.json:
        _cli.emit(json.dumps({"source": args.shards[0], "sets": out}, indent=1))
        return _cli.EXIT_OK
    head = (f"{args.shards[0]}: {len(sets)} sets ("
            + ", ".join(f"{s.name} {len(p)} shard{'s' if len(p) > 1 else ''}" for s, p in sets) + ")")
    blocks = [f"== {s.describe()}, {s.count} shard{'s' if s.count > 1 else ''}\n{format_summary(o['summary'])}"
              for (s, _), o in zip(sets, out)]
    _cli.emit("\n\n".join([head] + blocks))
    return _cli.EXIT_OK


def _sql(args) -> int:
    from .sql import query, query_text   # (start-up: duckdb and pyarrow, this mode only)

    spec = list(args.shards)
    if args.json:
        table = query(spec, args.sql)
        _cli.emit(json.dumps(table.to_pylist(), default=str))
    else:
        _cli.emit(query_text(spec, args.sql, max_rows=args.max_rows))
    return _cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
