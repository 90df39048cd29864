#!/usr/bin/env python3
"""Inspect shards: ``tools/inspect_idx.py PREFIX [--pack N] [--sql QUERY] [--plot OUT.png] [--json]``.

Thin wrapper; the CLI lives in :mod:`megatron_sft_idx.tools.inspect_cli` (console script ``inspect-idx``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sft_idx.tools.inspect_cli import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    from megatron_sft_idx._console import run  # noqa: E402  (a missing extra: one line, exit 2)

    sys.exit(run("inspect-idx"))
