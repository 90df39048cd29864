"""``check_idx``: the promotion gate's command line (also ``tools/check_idx.py``).

Exit status: 0 every shard passed, 1 a shard failed (or its promotion did),
2 usage error or unreadable input (no shard matched, a file cannot be read),
130 / 143 interrupted by SIGINT / SIGTERM (a promotion under way is rolled back:
its temporaries are removed and nothing that opens is left at the destination).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import List, Optional

from .. import _cli
from .._cli import EXIT_FAIL, EXIT_OK, EXIT_USAGE  # noqa: F401  (the exit codes, named here as before)
from .._signals import Terminated  # noqa: F401  (re-exported: SIGTERM's exception, as before)
from .._signals import INTERRUPTS, exit_code, raise_if_signalled, signal_name, signals_raise
from ..errors import ShardError
from ..format import METADATA_FIELD_RANGES
from ..storage.destination import destination_for
from ..storage.urls import url_refusal
from .checks import check
from .promote import promote_report

EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="check-idx",
        description="Check megatron_sft_idx shards (and upstream .bin/.idx) before promotion to training "
                    "storage. Exit 0 = pass, 1 = fail, 2 = usage error or unreadable input.")
    p.add_argument("prefixes", nargs="+", metavar="PREFIX",
                   help="shard prefix (path without .idx), glob, directory, or one of a shard's files")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--fast", dest="level", action="store_const", const="fast",
                       help="skip the CRC-32 pass over the data files (the report says so)")
    level.add_argument("--deep", dest="level", action="store_const", const="deep",
                       help="read every pack back through MMapIndexedDataset (default: a sample)")
    p.set_defaults(level="standard")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="every token id must be < N (default: the vocab size recorded in the metadata)")
    p.add_argument("--strict", action="store_true", help="warnings (e.g. an all-zero loss mask) fail the shard")
    p.add_argument("--allow-pretrain", action="store_true",
                   help="let a .bin/.idx-only (upstream pretrain) shard pass")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="shards checked in parallel (processes)")
    p.add_argument("--sample", type=int, default=64, metavar="N",
                   help="packs read back at the standard level, besides the first and last (default 64)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the report as JSON (for pipelines)")
    out.add_argument("-q", "--quiet", action="store_true", help="print only the overall verdict line")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show info findings and the passes run, and log each shard's time")
    p.add_argument("--promote", metavar="DEST", default=None,
                   help="after a pass, move the five files into directory DEST atomically (.idx last); "
                        "DEST may be s3://bucket/dir or msc://profile/dir (uploaded, .idx last)")
    p.add_argument("--link", action="store_true", help="with --promote: hard-link instead of moving")
    _cli.add_aliased(p, "--overwrite", "--replace", dest="overwrite", action="store_true",
                     help="with --promote: replace a shard of the same name at DEST (its .idx goes first; "
                          "--replace is another name of it)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):  # argparse already printed the usage message
        return args
    problem = _usage_problem(args)
    if problem:  # one line naming the options (argparse's own errors print the usage too)
        print(f"check-idx: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with signals_raise():
            report = check(args.prefixes, level=args.level, vocab_size=args.vocab_size, strict=args.strict,
                           allow_pretrain=args.allow_pretrain, sample=args.sample, workers=args.workers)
            raise_if_signalled()
            if args.promote is not None and report.exit_code != EXIT_USAGE:
                promote_report(report, args.promote, link=args.link, replace=args.overwrite, inputs=args.prefixes)
            raise_if_signalled()
    except ShardError as exc:
        print(f"check-idx: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except INTERRUPTS as exc:
        print(f"check-idx: interrupted by {signal_name(exc)}; each shard was promoted completely or not at all",
              file=sys.stderr)
        return exit_code(exc)
    if args.json:
        text = report.to_json()
    elif args.quiet:
        text = report.verdict_line()
    else:
        text = report.format_text(verbose=args.verbose)
    _cli.emit(text)  # piped into `head`: the verdict is the exit status
    return report.exit_code


def _usage_problem(args) -> Optional[str]:
    if (args.link or args.overwrite) and args.promote is None:
        return "--link and --overwrite need --promote DEST"
    if args.link and not destination_for(args.promote).moves:
        return "--link needs a local destination (hard links cannot point into object storage); drop --link to upload"
    refused = url_refusal([("--promote", args.promote, True)])
    if refused:
        return refused
    if args.workers < 1:
        return "--workers must be >= 1"
    if args.sample < 0:
        return "--sample must be >= 0"
    low, high = METADATA_FIELD_RANGES["vocab_size"]
    if args.vocab_size is not None and not low <= args.vocab_size <= high:
        return f"--vocab-size must be in {low}..{high}"
    return None


if __name__ == "__main__":
    sys.exit(main())
