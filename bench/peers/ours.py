"""This project: ``IndexedDatasetBuilder`` streaming writes, ``MMapIndexedDataset(prefix)[i]`` reads."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.format import ShardPaths

NAME = "ours"
LABEL = "ours (.bin/.idx + SFT companions)"
TOUCHES = (0, 1, 2, 3)


def _prefix(out_dir) -> str:
    return str(Path(out_dir) / "shard")


def prepare_writer() -> None:
    """Import what the writer needs before the writer's RSS baseline is taken.

    Imported here, not at the top: the builder brings numba (~100 MiB of LLVM), which
    a reader process never needs.
    """
    import megatron_sft_idx.builder  # noqa: F401


def write(corpus, out_dir) -> dict:
    from megatron_sft_idx import IndexedDatasetBuilder

    t0 = time.perf_counter()
    first_pack_s = None
    with IndexedDatasetBuilder(_prefix(out_dir), vocab_size=corpus.vocab_size, pack_size=corpus.pack_size,
                               overwrite=True) as builder:
        for ids, loss, starts in corpus.iter_packs():
            builder.add_packed(ids, loss, starts)
            if first_pack_s is None:  # includes loading the numba kernels from their cache
                first_pack_s = time.perf_counter() - t0
    return {"write_s": time.perf_counter() - t0, "write_first_pack_s": first_pack_s}


def files(out_dir):
    return list(ShardPaths.from_prefix(_prefix(out_dir)).by_suffix().values())


def open_reader(out_dir):
    return MMapIndexedDataset(_prefix(out_dir))


def touch(pack):
    ids = pack.input_ids
    return (ids.shape[0], int(ids.sum()), int(pack.loss_mask.sum()), int(pack.seq_start_id.sum()))


def touch_tokens(pack):
    return int(pack.input_ids.sum())


def as_arrays(pack):
    return np.array(pack.input_ids), np.array(pack.loss_mask), np.array(pack.seq_start_id)


def get(reader, i):
    return reader.get(i)


def get_many(reader, indices):
    return reader.get_many(indices)
