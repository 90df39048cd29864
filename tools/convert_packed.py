#!/usr/bin/env python3
"""Convert packed formats: ``tools/convert_packed.py INPUT OUTPUT [--to parquet] [--pack-size N]``.

Thin wrapper; the CLI lives in :mod:`megatron_sft_idx.tools.convert_cli` (console script ``convert-packed``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    # Run through the console entry point, which imports the tool itself: a Ctrl-C while it is
    # still importing then ends it with one line and exit 130, never a traceback.
    from megatron_sft_idx._console import run  # noqa: E402  (a missing extra: one line, exit 2)

    sys.exit(run("convert-packed"))

from megatron_sft_idx.tools.convert_cli import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]
