"""Upstream megatron-core carrying SFT data: three pretrain ``.bin/.idx`` datasets side by side.

What a user of the upstream format alone would do to keep a loss mask and sequence
boundaries: ``tokens`` (uint16/int32), ``loss`` (uint8, one item per pack, token-aligned)
and ``starts`` (int32 ``seq_start_id`` per pack), each written with the installed
``IndexedDatasetBuilder`` and read with ``IndexedDataset(prefix)[i]``; a record is the
three arrays. It reads the same bytes as ours with the same consumer work, so the
all-arrays comparison against it is like for like (``bench.hotpath``); it has none of
our checks (no metadata, no checksums, no cross-file consistency).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

NAME = "upstream_sft"
LABEL = "upstream megatron-core bin/idx x3 (tokens, loss mask, starts)"
TOUCHES = (0, 1, 2, 3)
PARTS = ("tokens", "loss", "starts")


def _prefix(out_dir, part: str) -> str:
    return str(Path(out_dir) / f"upstream_sft_{part}")


def write(corpus, out_dir) -> dict:
    dtypes = {"tokens": np.uint16 if corpus.vocab_size < 65500 else np.int32, "loss": np.uint8,
              "starts": np.int32}
    t0 = time.perf_counter()
    builders = {p: IndexedDatasetBuilder(_prefix(out_dir, p) + ".bin", dtype=dtypes[p]) for p in PARTS}
    for record in corpus.iter_packs():
        for part, values in zip(PARTS, record):
            builders[part].add_item(torch.from_numpy(np.asarray(values).astype(np.int32)))
            builders[part].end_document()
    for part, builder in builders.items():
        builder.finalize(_prefix(out_dir, part) + ".idx")
    return {"write_s": time.perf_counter() - t0}


def files(out_dir):
    return [_prefix(out_dir, p) + s for p in PARTS for s in (".bin", ".idx")]


class ThreeDatasets:
    """``ds[i] -> (tokens, loss, starts)`` from three upstream datasets."""

    def __init__(self, out_dir) -> None:
        self.tokens, self.loss, self.starts = (IndexedDataset(_prefix(out_dir, p)) for p in PARTS)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.loss[i], self.starts[i]

    def get(self, i):
        return self.tokens.get(i), self.loss.get(i), self.starts.get(i)


def open_reader(out_dir):
    return ThreeDatasets(out_dir)


def touch(record):
    ids, loss, starts = record
    return (ids.shape[0], int(ids.sum()), int(loss.sum()), int(starts.sum()))


def touch_tokens(record):
    return int(record[0].sum())


def as_arrays(record):
    return tuple(np.array(a) for a in record)


def get(reader, i):
    return reader.get(i)
