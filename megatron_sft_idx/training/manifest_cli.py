"""``write_manifest OUT.json SHARD... [--absolute] [--json]``: list shards once, open them in one read.

Each SHARD is a prefix, a directory of shards or a glob. The manifest records
every shard's pack count and packing statistics, so a dataset over a thousand
shards opens with one file read; give its path wherever a shard prefix goes
(``data_path`` blends, ``open_packed``, ``PackedSFTDataset``).

Exit codes: 0 written, 1 a shard is corrupt, 2 usage error or nothing found.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from ..errors import ShardError, ShardNotFoundError
from .multi import write_manifest

log = logging.getLogger("write_manifest")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="write_manifest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="manifest path to write (*.json)")
    p.add_argument("shards", nargs="+", help="shard prefixes, directories or globs")
    p.add_argument("--absolute", action="store_true",
                   help="store absolute prefixes (default: relative to the manifest)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.out.endswith(".json"):
        print("write_manifest: the manifest path must end in .json", file=sys.stderr)
        return 2
    try:
        manifest = write_manifest(args.out, args.shards, relative=not args.absolute)
    except ShardNotFoundError as exc:
        print(f"write_manifest: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:
        print(f"write_manifest: {exc}", file=sys.stderr)
        return 1
    shards = manifest["shards"]
    summary = {"manifest": args.out, "shards": len(shards), "packs": sum(s["packs"] for s in shards)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {summary['shards']} shards, {summary['packs']} packs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
