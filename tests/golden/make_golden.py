"""Write the tiny golden shard whose bytes ``tests/test_golden.py`` pins.

Run it only when the format version changes (into a new ``v<major>_<minor>``
directory); the files of every released version stay committed unchanged, so
a reader change that breaks old shards fails the golden test::

    python tests/golden/make_golden.py            # writes tests/golden/v1_1/tiny.*
    python tests/golden/make_golden.py --sources  # writes tests/golden/v1_2/tiny.* (each sequence's source)

A shard without sources is still written as 1.1 (the v1_1 files are today's bytes); 1.2 adds the
source ids, so its golden shard is the same packs with :data:`SOURCES` and :data:`SOURCE_IDS`.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PREFIX = os.path.join(HERE, "v1_1", "tiny")
SOURCES_PREFIX = os.path.join(HERE, "v1_2", "tiny")
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


#: Format 1.2: the sources the golden shard's sequences come from, and each pack's source ids.
SOURCES = [{"name": "chat", "store_id": "0" * 32}, {"name": "math", "store_id": "f" * 32}]
SOURCE_IDS = [[0, 1], [1], [0, 0, 1]]


def build(prefix: str, overwrite: bool = False, sources: bool = False):
    """Write the golden packs to ``prefix`` (uint16 tokens), with ``sources`` each sequence's
    source (format 1.2), and return the shard metadata."""
    from megatron_sft_idx import IndexedDatasetBuilder

    metadata = dict(METADATA, sources=SOURCES) if sources else METADATA
    with IndexedDatasetBuilder(prefix, dtype=np.uint16, vocab_size=VOCAB_SIZE, pack_size=PACK_SIZE,
                               metadata=metadata, overwrite=overwrite) as builder:
        for (ids, loss, starts), src in zip(PACKS, SOURCE_IDS):
            builder.add_packed(np.array(ids), np.array(loss, np.uint8), np.array(starts),
                               source_ids=np.array(src) if sources else None)
    return builder.metadata


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=None, help="shard prefix to write (default: the version's golden)")
    parser.add_argument("--sources", action="store_true", help="record each sequence's source (format 1.2)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing golden shard")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    prefix = args.prefix or (SOURCES_PREFIX if args.sources else DEFAULT_PREFIX)
    build(prefix, overwrite=args.overwrite, sources=args.sources)
    print(prefix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
