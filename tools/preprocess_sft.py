#!/usr/bin/env python3
"""Conversations in, packed SFT shards out. See ``--help`` or megatron_sft_idx/preprocess/cli.py."""

import sys

from megatron_sft_idx.preprocess.cli import main

if __name__ == "__main__":
    sys.exit(main())
