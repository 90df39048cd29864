"""``merge-shards OUT IN...`` (also ``tools/merge_shards.py``): many shards -> one.

Exit status: 0 merged and published; 1 refused (incompatible or corrupt inputs, an output
that failed the gate: nothing published); 2 usage error, a missing input or an existing output;
130 / 143 interrupted by SIGINT / SIGTERM (nothing published, unless the signal came after
the commit point: then the output is complete and the message says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from .. import _cli
from .._progress import Progress, _isatty
from .._units import human_bytes, plural
from ..format import ALL_SUFFIXES
from ..storage.urls import local_only, url_refusal
from .merge import MergeResult, merge_shards

log = logging.getLogger("megatron_sft_idx.tools.merge")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="merge-shards",
        description="Merge megatron_sft_idx shards into one shard holding all their packs in order. "
                    "Streaming (memory flat in packs and inputs), data copied in the kernel, checked by "
                    "the promotion gate before it is published atomically. Exit 0 = merged, "
                    "1 = refused or failed (nothing published), 2 = usage error or missing input.")
    p.add_argument("output", metavar="OUT", help="output shard prefix (path without .idx), or s3://bucket/... / "
                   "msc://profile/... (merged and gated locally, then uploaded .idx last)")
    p.add_argument("inputs", nargs="+", metavar="IN",
                   help="input shard prefix, glob, directory of shards or manifest .json (in this order); "
                        "s3:// and msc:// inputs are downloaded one at a time into the staging directory")
    p.add_argument("--widen", action="store_true",
                   help="allow uint16 and int32 inputs together: the output stores int32 tokens")
    p.add_argument("--pack-size", type=int, default=None, metavar="N",
                   help="pack size recorded in the output (default: the inputs' largest)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard at OUT")
    p.add_argument("--staging-dir", default=None, metavar="DIR",
                   help="where an s3:// or msc:// OUT is merged before its upload (default: the system's "
                        "temporary directory; needs room for the whole output)")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--fast", dest="level", action="store_const", const="fast",
                       help="gate the output without its CRC pass")
    level.add_argument("--deep", dest="level", action="store_const", const="deep",
                       help="gate the output reading every pack back")
    p.set_defaults(level="standard")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the result as JSON (for pipelines)")
    out.add_argument("-q", "--quiet", action="store_true", help="errors only: print nothing on success")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress per input and the gate's time")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    if args.pack_size is not None and args.pack_size <= 0:
        return _cli.usage_error(parser, "--pack-size must be positive")
    if args.output.endswith(ALL_SUFFIXES):
        return _cli.usage_error(parser, f"OUT is a prefix: drop the file suffix from {args.output!r}")
    problem = (local_only([("--staging-dir", args.staging_dir)])
               or url_refusal([("OUT", args.output, False), ("IN", args.inputs, True)]))
    if problem:
        return _cli.usage_error(parser, problem)

    # periodic lines when stderr is not a terminal (a batch job's log), per input with -v
    progress = Progress(parser.prog, "off" if args.quiet or _isatty(sys.stderr) else "log")

    def body() -> int:
        with progress.phase("merge", len(args.inputs), unit="inputs") as phase:
            def on_input(done: int, total: int) -> None:
                phase.total = total
                phase.update(done - phase.done)
                _progress(done, total)

            result = merge_shards(args.output, args.inputs, widen=args.widen, pack_size=args.pack_size,
                                  overwrite=args.overwrite, check_level=args.level, progress=on_input,
                                  staging_dir=args.staging_dir)
        with _cli.published(result.prefix):
            if args.json:
                _cli.emit(json.dumps(_to_dict(result), indent=2, sort_keys=True))
            elif not args.quiet:
                _cli.emit(format_result(result))
        return _cli.EXIT_OK

    return _cli.run(parser.prog, body)


def _progress(done: int, total: int) -> None:
    if done == total or done % 100 == 0:
        log.info("%d of %d inputs merged", done, total)


def _to_dict(result: MergeResult) -> dict:
    files = result.metadata.files
    return {"output": result.prefix, "inputs": result.inputs, "seconds": round(result.seconds, 3),
            "gate_seconds": round(result.gate_seconds, 3), "copy_methods": dict(result.copy_methods),
            "bytes": sum(d.size for d in files.values()), "notes": result.notes,
            "metadata": result.metadata.to_dict()}


def format_result(result: MergeResult) -> str:
    s = result.metadata.stats
    size = sum(d.size for d in result.metadata.files.values())
    methods = ", ".join(f"{name} x{count}" for name, count in sorted(result.copy_methods.items()))
    lines = [f"merged {plural(result.inputs, 'shard')} -> {result.prefix}",
             f"  packs       {s.pack_count:,} ({s.sequence_count:,} sequences, {s.token_count:,} tokens, "
             f"{result.metadata.token_dtype})",
             f"  size        {human_bytes(size)} (data copied by {methods or 'nothing'})",
             f"  gate        passed in {result.gate_seconds:.2f} s; published atomically (.idx last)",
             f"  time        {result.seconds:.2f} s"]
    lines += [f"  note        {note}" for note in result.notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
