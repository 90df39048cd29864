#!/usr/bin/env python3
"""Balance packed shards for a training topology:
``tools/plan_batches.py SHARD... --balance-for DP,MBS,GBS [--out X.order] [--plot X.png]``.

Thin wrapper; the CLI lives in :mod:`megatron_sft_idx.tools.plan_batches_cli` (console script ``plan-batches``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sft_idx.tools.plan_batches_cli import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    from megatron_sft_idx._console import run  # noqa: E402  (a missing extra: one line, exit 2)

    sys.exit(run("plan-batches"))
