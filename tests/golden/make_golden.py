"""Write the tiny golden shard whose bytes ``tests/test_golden.py`` pins.

Run it only when the format version changes (into a new ``v<major>_<minor>``
directory); the files of every released version stay committed unchanged, so
a reader change that breaks old shards fails the golden test::

    python tests/golden/make_golden.py            # writes tests/golden/v1_1/tiny.*
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PREFIX = os.path.join(HERE, "v1_1", "tiny")
PACK_SIZE = 8
VOCAB_SIZE = 32
METADATA = {"tokenizer": {"name": "golden"}, "pad_seq_to_mult": 1}

#: (input_ids, loss_mask, seq_start_id) of each pack: a full pack of two sequences,
#: a one-sequence pack, and a pack with single-token sequences and the largest id.
PACKS: List[Tuple[List[int], List[int], List[int]]] = [
    ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 1, 1, 1, 0], [0, 4]),
    ([9, 10, 11], [1, 1, 0], [0]),
    ([31, 0, 5, 5, 12], [0, 0, 1, 1, 0], [0, 1, 2]),
]


def build(prefix: str, overwrite: bool = False):
    """Write the golden packs to ``prefix`` (uint16 tokens) and return the shard metadata."""
    from megatron_sft_idx import IndexedDatasetBuilder

    with IndexedDatasetBuilder(prefix, dtype=np.uint16, vocab_size=VOCAB_SIZE, pack_size=PACK_SIZE,
                               metadata=METADATA, overwrite=overwrite) as builder:
        for ids, loss, starts in PACKS:
            builder.add_packed(np.array(ids), np.array(loss, np.uint8), np.array(starts))
    return builder.metadata


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="shard prefix to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing golden shard")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    build(args.prefix, overwrite=args.overwrite)
    print(args.prefix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
