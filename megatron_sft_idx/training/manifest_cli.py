"""Write a manifest (OUT.json) listing shards, so that they open as one dataset with one read.

Usage: ``write-sft-manifest OUT.json SHARD... [--absolute] [--json]``. OUT.json and each
SHARD may be local or an ``s3://`` / ``msc://`` URL.

Each SHARD is a prefix, a directory of shards, a glob or a manifest. The manifest records
every shard's pack count, packing statistics and identity (tokenizer, padding,
the set it belongs to), so a dataset over a thousand shards opens with one file
read; give its path wherever a shard prefix goes (``data_path`` blends,
``open_packed``, ``PackedSFTDataset``). Shards that disagree (tokenizer, chat
template, vocabulary, padding) or do not form whole sets are refused: a manifest
a reader would refuse is never written.

Exit codes: 0 written, 1 a shard is corrupt or the shards cannot be read as one,
2 usage error or nothing found.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from .. import _cli
from ..errors import ShardError, ShardNotFoundError
from .._units import plural
from ..publishing import write_manifest

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="write-sft-manifest", description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="manifest path to write (*.json)")
    p.add_argument("shards", nargs="+", help="shard prefixes, directories or globs")
    p.add_argument("--absolute", action="store_true",
                   help="store absolute prefixes (default: relative to the manifest)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="errors only: print nothing on success")
    g.add_argument("-v", "--verbose", action="store_true", help="log each shard found")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    if not args.out.endswith(".json"):
        print("write-sft-manifest: error: the manifest path must end in .json", file=sys.stderr)
        return 2
    try:
        manifest = write_manifest(args.out, args.shards, relative=not args.absolute)
    except ShardNotFoundError as exc:
        print(f"write-sft-manifest: error: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:
        print(f"write-sft-manifest: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"write-sft-manifest: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    shards = manifest["shards"]
    summary = {"manifest": args.out, "shards": len(shards), "packs": sum(s["packs"] for s in shards)}
    if args.json:
        print(json.dumps(summary))
    elif not args.quiet:
        print(f"wrote {args.out}: {plural(summary['shards'], 'shard')}, {plural(summary['packs'], 'pack')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
