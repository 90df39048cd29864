"""Shard generations that a reader can tell apart pack by pack, with identical file sizes.

Generation ``g`` of a shard holds ``N`` packs; pack ``i`` has length ``lengths(g)[i]`` (a
rotation of one list, so every generation has the same token count), two sequences split
at ``split(g, i, length)``, every token equal to ``token(g, i)`` and a loss mask that
alternates with phase ``g``. The generation is also written in the metadata
(``extra.generation``). So a pack read through files of two generations -- tokens of one,
lengths, loss or starts of another -- differs from what the metadata's generation
predicts: :func:`torn` says how. All five files of every generation have the same sizes,
so no size check can tell generations apart; only reading one generation's files can.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from megatron_sft_idx import IndexedDatasetBuilder

N_PACKS = 48
PACK_SIZE = 64
_BASE_LENGTHS = np.random.default_rng(5).integers(4, PACK_SIZE + 1, N_PACKS)


def lengths(g: int) -> np.ndarray:
    return np.roll(_BASE_LENGTHS, g)


def token(g: int, i: int) -> int:
    return 1000 * (g % 60) + i


def split(g: int, i: int, length: int) -> int:
    return 1 + (g + i) % (length - 1)


def pack(g: int, i: int):
    n = int(lengths(g)[i])
    starts = np.array([0, split(g, i, n)], dtype=np.int64)
    loss = ((np.arange(n) + g) % 2).astype(np.uint8)
    loss[starts[1] - 1] = 0
    loss[n - 1] = 0
    return np.full(n, token(g, i), dtype=np.int64), loss, starts


def write_generation(prefix: str, g: int, overwrite: bool = False) -> None:
    with IndexedDatasetBuilder(prefix, dtype=np.uint16, vocab_size=65000, pack_size=PACK_SIZE,
                               metadata={"generation": g}, overwrite=overwrite) as b:
        for i in range(N_PACKS):
            b.add_packed(*pack(g, i))


def torn(ds) -> Optional[str]:
    """None when every pack of the open dataset ``ds`` is exactly what its metadata's generation
    holds; else a description of the first pack that mixes generations."""
    g = ds.metadata.extra.get("generation")
    if len(ds) != N_PACKS:
        return f"{len(ds)} packs"
    for i in range(N_PACKS):
        got = ds[i]
        ids, loss, starts = pack(g, i)
        for name, a, b in (("input_ids", got.input_ids, ids), ("loss_mask", got.loss_mask, loss),
                           ("seq_start_id", got.seq_start_id, starts)):
            if a.shape != b.shape or not np.array_equal(a, b):
                return f"generation {g}, pack {i}: {name} is not generation {g}'s"
    return None


def torn_native(shard) -> Optional[str]:
    """:func:`torn` for a ``megatron_sft_idx.native.NativeShard``."""
    g = shard.metadata.get("extra", {}).get("generation")
    if len(shard) != N_PACKS:
        return f"{len(shard)} packs"
    for i in range(N_PACKS):
        got = shard.pack(i)
        for name, a, b in zip(("input_ids", "loss_mask", "seq_start_id"), got, pack(g, i)):
            if a.shape != b.shape or not np.array_equal(a, b):
                return f"generation {g}, pack {i}: {name} is not generation {g}'s (native)"
    return None
