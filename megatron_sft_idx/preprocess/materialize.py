"""The materialize step: plan + store -> one output shard per unit, in a staging directory.

Unit ``u`` writes output shard ``u`` (splits in order, shards in order inside a split): the
packs ``shard_starts[s]..shard_starts[s+1]`` of its split, a chunk of packs at a time. Each
chunk gathers its sequences from the store's partitions (mapped, ``MADV_RANDOM``, pages
dropped after the chunk so RSS stays at one chunk), cut to the truncation length (the last
kept position gets loss 0), padded with ``pad_id`` (loss 0) to the pad multiple, and is
appended pack by pack to an :class:`IndexedDatasetBuilder`. The staged shard is published
into the staging directory (``.idx`` last), then the unit's receipt is written.
"""

from __future__ import annotations

import mmap
import os
import resource
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..builder import IndexedDatasetBuilder
from ..format import PUBLISH_ORDER
from ..packing import padded_length, truncation_length
from ._materialize import exclusive_cumsum, fill_sequences
from .planfile import PackPlan
from .receipts import ReceiptBook
from .store import SequenceStore

_CHUNK_TOKENS = 1 << 22  # tokens materialized at once
# Packs gather sequences from anywhere in the store, and the kernel maps ~64 KiB around every
# page fault (fault-around), for tokens and loss mask alike: bounding the sequences per chunk,
# and dropping the mapped pages after it, keeps the store's share of RSS small however large
# the store is.
_CHUNK_SEQUENCES = 512


@dataclass(frozen=True)
class OutputShard:
    """Where unit ``u`` goes: split ``split`` (index into the plan's splits), shard ``shard``."""

    split: int
    shard: int
    staged: str          # prefix in the staging directory
    final: str           # prefix it is published to
    metadata: dict       # the builder's metadata= for this shard


@dataclass(frozen=True)
class MaterializeStep:
    store_dir: str
    plan_path: str
    shards: Tuple[OutputShard, ...]
    pad_id: int
    vocab_size: int
    book: ReceiptBook
    name: str = "materialize"

    @property
    def writes_to(self) -> str:
        return os.path.dirname(self.shards[0].staged)

    def run(self, unit: int) -> dict:
        out = self.shards[unit]
        store = SequenceStore(self.store_dir)
        plan = PackPlan(self.plan_path)
        settings = plan.metadata["settings"]
        gather = Gatherer(store, settings["pack_size"], settings["pad_multiple"], self.pad_id,
                          settings.get("pad_layout", "stored"), settings.get("truncated_turn_loss", "keep"))
        arrays = plan.arrays(out.split)
        first, last = int(arrays["shard_starts"][out.shard]), int(arrays["shard_starts"][out.shard + 1])
        with IndexedDatasetBuilder(out.staged, overwrite=True, vocab_size=self.vocab_size,
                                   pack_size=settings["pack_size"], metadata=out.metadata) as builder:
            for b0, b1 in chunks(arrays["pack_offsets"], arrays["pack_loads"], first, last):
                ids, mask, starts, ends = gather.packs(arrays, b0, b1)
                for k in range(b1 - b0):
                    lo, hi = int(ends[k]), int(ends[k + 1])
                    builder.add_packed(ids[lo:hi], mask[lo:hi], starts[k] - lo)
        body = {"final": out.final, "packs": last - first, "metadata": builder.metadata.to_dict(),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        return self.book.write(unit, body, [out.staged + s for s in PUBLISH_ORDER])


def chunks(offsets: np.ndarray, loads: np.ndarray, first: int, last: int):
    """``(b0, b1)`` runs of packs of at most ``_CHUNK_TOKENS`` tokens and ``_CHUNK_SEQUENCES``
    sequences (at least one pack each)."""
    b0 = first
    while b0 < last:
        b1 = b0 + 1
        tokens = int(loads[b0])
        while (b1 < last and tokens + int(loads[b1]) <= _CHUNK_TOKENS
               and int(offsets[b1 + 1]) - int(offsets[b0]) <= _CHUNK_SEQUENCES):
            tokens += int(loads[b1])
            b1 += 1
        yield b0, b1
        b0 = b1


class Gatherer:
    """Builds packs from store sequences: truncation, padding and the truncated-end mask rule."""

    def __init__(self, store: SequenceStore, pack_size: int, pad_multiple: int, pad_id: int,
                 pad_layout: str = "stored", truncated_turn_loss: str = "keep") -> None:
        self.store = store
        self.part_starts = store.starts()
        self.truncate_to = truncation_length(pack_size, pad_multiple, pad_layout)
        self.pad_multiple = pad_multiple
        self.pad_layout = pad_layout
        self.pad_id = pad_id
        self.drop_cut_turn = truncated_turn_loss == "drop"
        self._advised = set()

    def _part(self, k: int):
        ds = self.store.part(k)
        if k not in self._advised:
            self._advised.add(k)
            if hasattr(mmap, "MADV_RANDOM"):  # scattered reads: map only what is read
                ds.advise(mmap.MADV_RANDOM)
        return ds

    def packs(self, arrays: dict, b0: int, b1: int, release: bool = True):
        """Packs ``b0..b1`` of a split: ``(ids int64, mask uint8, seq starts per pack, pack ends)``.

        ``seq starts per pack`` is a list of int64 arrays of absolute offsets in ``ids``; pack k
        spans ``ends[k]..ends[k+1]``. ``release`` drops the store pages the chunk mapped.
        """
        offsets = arrays["pack_offsets"]
        s0, s1 = int(offsets[b0]), int(offsets[b1])
        seq = np.asarray(arrays["sequence_ids"][s0:s1], dtype=np.int64)
        part = np.searchsorted(self.part_starts, seq, side="right") - 1
        local = seq - self.part_starts[part]
        touched = np.unique(part)
        full = np.empty(seq.size, dtype=np.int64)
        for k in touched:
            sel = part == k
            full[sel] = self._part(int(k)).sequence_lengths[local[sel]]
        copy = np.minimum(full, self.truncate_to)
        dst = exclusive_cumsum(padded_length(copy, self.pad_multiple, self.pad_layout))
        ids = np.full(int(dst[-1]), self.pad_id, dtype=np.int64)
        mask = np.zeros(int(dst[-1]), dtype=np.uint8)
        for k in touched:
            sel = np.flatnonzero(part == k)
            ds = self._part(int(k))
            arr = ds.arrays()
            src = np.asarray(ds.sequence_pointers[local[sel]]) // ds.dtype.itemsize
            fill_sequences(ids, mask, dst[sel], arr.tokens, arr.loss_mask, src, copy[sel], full[sel],
                           self.drop_cut_turn)
        if release:  # a long scan keeps RSS at one chunk; random single reads keep their pages
            for k in touched:
                self._part(int(k)).release_pages()
        pack_seq = np.asarray(offsets[b0:b1 + 1], dtype=np.int64) - s0
        ends = dst[pack_seq]
        starts = [dst[pack_seq[k]:pack_seq[k + 1]] for k in range(b1 - b0)]
        return ids, mask, starts, ends
