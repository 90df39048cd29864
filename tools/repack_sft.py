#!/usr/bin/env python3
"""New packed shards from an existing sequence store, without re-tokenizing: ``tools/repack_sft.py --help``.

Thin wrapper; the CLI lives in :mod:`megatron_sft_idx.preprocess.cli` (console script
``repack-sft``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sft_idx.preprocess.repack_cli import build_repack_parser as build_parser, repack_main as main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    from megatron_sft_idx._console import run  # noqa: E402  (a missing extra: one line, exit 2)

    sys.exit(run("repack-sft"))
