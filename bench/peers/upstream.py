"""Upstream megatron-core (the real PyPI package): pretrain ``.bin/.idx``, tokens only.

Written with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``
(``add_item`` + ``end_document`` per pack: one sequence and one document per pack,
the layout our ``.idx`` uses), read with ``IndexedDataset(prefix)[i]``. It stores no
loss mask and no sequence starts, so it is the lower bound of what reading a pack
costs in the Megatron ecosystem, not an SFT format.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

NAME = "upstream"
LABEL = "upstream megatron-core bin/idx (tokens only)"
TOUCHES = (0, 1)


def _prefix(out_dir) -> str:
    return str(Path(out_dir) / "upstream")


def write(corpus, out_dir) -> dict:
    prefix = _prefix(out_dir)
    dtype = np.uint16 if corpus.vocab_size < 65500 else np.int32  # upstream's own rule
    t0 = time.perf_counter()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids, _, _ in corpus.iter_packs():
        builder.add_item(torch.from_numpy(ids.astype(np.int32)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return {"write_s": time.perf_counter() - t0}


def files(out_dir):
    return [_prefix(out_dir) + ".bin", _prefix(out_dir) + ".idx"]


def open_reader(out_dir):
    return IndexedDataset(_prefix(out_dir))


def touch(tokens):
    return (tokens.shape[0], int(tokens.sum()), 0, 0)


def touch_tokens(tokens):
    return int(tokens.sum())


def as_arrays(tokens):
    return np.array(tokens), None, None


def get(reader, i):
    return reader.get(i)
