"""Sample orders that read object storage a block at a time: the block-local shuffle.

A full shuffle visits packs in a uniformly random order, so over a bucket every read
lands in a different block: one ranged GET per pack per data file, and a block of
``block_size`` bytes is fetched again for each of its packs (unless the whole shard
fits in the block cache). The block-local order keeps most of the randomness and
fetches every block once per epoch:

1. each pack belongs to the block of ``.bin`` its first token lies in
   (``sequence_pointers // block_size``; for several shards, blocks are per shard);
2. the blocks are put in a uniformly random order;
3. consecutive runs of ``window`` blocks form windows; the packs of a window are
   shuffled uniformly among themselves, and windows follow each other.

A reader whose block cache holds ``window`` blocks (``cache_blocks >= window``) then
fetches each block once per epoch (a pack straddling two blocks is served by its first
block's fetch, see :mod:`megatron_sft_idx.storage.blocks`).
Every pack still appears exactly once per epoch; any two packs in the same window
are in uniformly random relative order; the price is that a batch draws from
``window`` random blocks instead of from the whole dataset — measured in
``bench/remote.py`` (order statistics beside a full shuffle).

Use it through either adapter (``order=BlockLocalOrder(window=8)`` for
:class:`~megatron_sft_idx.training.bridge.PackedSFTDataset`, ``pack_order=...`` in
:class:`~megatron_sft_idx.training.megatron.SFTIndexedDatasetConfig`) or as a
DataLoader sampler (:class:`BlockLocalSampler`). The order is a function of the seed
and the shard layout only, so it is identical in every rank and after a restart.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from .reader import MMapIndexedDataset
from .storage.config import StorageConfig

__all__ = ["BlockLocalOrder", "BlockLocalSampler", "block_local_permutation", "pack_blocks"]


def block_local_permutation(blocks: np.ndarray, window: int, rng) -> np.ndarray:
    """Positions ``0..len(blocks)-1`` in block-local order (see the module doc).

    Args:
        blocks: the block number of every item (any integers; equal means same block).
        window: blocks per window (>= 1); 1 visits one block at a time.
        rng: a ``numpy.random.RandomState`` or ``Generator`` (its ``permutation`` and
            ``random`` are used), so callers keep their own seeding scheme.
    """
    blocks = np.asarray(blocks)
    if window < 1:
        raise ValueError("window must be at least 1")
    if blocks.size == 0:
        return np.empty(0, dtype=np.int64)
    uniq, inverse = np.unique(blocks, return_inverse=True)
    rank = np.empty(uniq.shape[0], dtype=np.int64)
    rank[rng.permutation(uniq.shape[0])] = np.arange(uniq.shape[0])
    window_of = rank[inverse.reshape(-1)] // window
    return np.lexsort((rng.random(blocks.shape[0]), window_of)).astype(np.int64)


def pack_blocks(source, block_size: Optional[int] = None) -> np.ndarray:
    """The block number of every pack of ``source`` (int64), unique across shards.

    ``block_size`` defaults to the remote reader's own (or :class:`StorageConfig`'s), so the
    order matches the block cache. Sources without a byte layout (none known) get one
    block per pack, i.e. a full shuffle.
    """
    if block_size is None:
        block_size = _default_block_size(source)
    if isinstance(source, MMapIndexedDataset):
        return np.asarray(source.sequence_pointers, dtype=np.int64) // block_size
    prefixes = getattr(source, "prefixes", None)
    if prefixes is not None and hasattr(source, "shard"):  # MultiShardDataset: blocks per shard
        parts, base = [], 0
        for k in range(len(prefixes)):
            blocks = pack_blocks(source.shard(k), block_size)
            parts.append(blocks + base)
            base += int(blocks.max()) + 1 if blocks.size else 0
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    offsets = getattr(source, "token_offsets", None)
    tokens = getattr(source, "tokens", None)
    if offsets is not None and tokens is not None:  # FlatPackedSource
        return np.asarray(offsets[:-1], dtype=np.int64) * tokens.dtype.itemsize // block_size
    return np.arange(len(source), dtype=np.int64)


def _default_block_size(source) -> int:
    config = getattr(source, "config", None)
    size = getattr(config, "block_size", None)
    if size:
        return int(size)
    return StorageConfig.resolve().block_size


class BlockLocalOrder:
    """An index-order function ``order(source, indices, rng) -> indices, permuted``.

    The adapters call it once per epoch where they would call ``rng.permutation(indices)``.

    Args:
        window: blocks whose packs are shuffled together (>= 1).
        block_size: bytes of ``.bin`` per block (default: the reader's / StorageConfig's).
    """

    def __init__(self, window: int = 8, block_size: Optional[int] = None) -> None:
        if int(window) < 1:
            raise ValueError("window must be at least 1")
        self.window = int(window)
        self.block_size = None if block_size is None else int(block_size)
        self._cache = None  # (id(source), len(source), blocks): computed once per source

    def blocks(self, source) -> np.ndarray:
        key = (id(source), len(source))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, pack_blocks(source, self.block_size))
        return self._cache[1]

    def __call__(self, source, indices, rng) -> np.ndarray:
        indices = np.asarray(indices)
        perm = block_local_permutation(self.blocks(source)[indices], self.window, rng)
        return indices[perm]

    def __repr__(self) -> str:  # part of the Megatron dataset's cache identity
        return f"BlockLocalOrder(window={self.window}, block_size={self.block_size})"

    def __getstate__(self):
        return {"window": self.window, "block_size": self.block_size, "_cache": None}


class BlockLocalSampler:
    """A DataLoader sampler yielding every pack of ``source`` once per epoch, block-local.

    Duck-types ``torch.utils.data.Sampler`` (``__iter__``, ``__len__``, ``set_epoch``)
    without importing torch. The epoch's order comes from ``RandomState(seed + epoch)``.
    """

    def __init__(self, source, window: int = 8, seed: int = 0, block_size: Optional[int] = None) -> None:
        self.source = source
        self.order = BlockLocalOrder(window, block_size)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[int]:
        rng = np.random.RandomState(self.seed + self.epoch)
        return iter(self.order(self.source, np.arange(len(self.source)), rng).tolist())
