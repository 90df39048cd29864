"""The materialize step: plan + store -> one output shard per unit, in a staging directory.

Unit ``u`` writes output shard ``u`` (splits in order, shards in order inside a split): the
packs ``shard_starts[s]..shard_starts[s+1]`` of its split, a chunk of packs at a time. Each
chunk reads its sequences from the store's partitions with ``pread`` (see :class:`Gatherer`),
cut to the truncation length (the last kept position gets loss 0), padded with ``pad_id``
(loss 0) to the pad multiple, and is appended pack by pack to an
:class:`IndexedDatasetBuilder`. The staged shard is published into the staging directory
(``.idx`` last), then the unit's receipt is written.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..builder import IndexedDatasetBuilder
from .._files import open_generation
from ..errors import ShardError
from ..format import BIN_SUFFIX, LOSS_SUFFIX, PUBLISH_ORDER, SEQ_IDX_SUFFIX, ShardPaths
from ..packing import exclusive_cumsum, fill_sequences, padded_length, truncation_length
from .planfile import PackPlan
from .receipts import ReceiptBook
from .store import SequenceStore, part_prefix

_CHUNK_TOKENS = 1 << 22  # tokens materialized at once
_CHUNK_SEQUENCES = 512   # sequences read at once (one pread each for tokens and loss mask)


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
        try:
            with IndexedDatasetBuilder(out.staged, overwrite=True, vocab_size=self.vocab_size,
                                       pack_size=settings["pack_size"], metadata=out.metadata) as builder:
                for b0, b1 in chunks(arrays["pack_offsets"], arrays["pack_loads"], first, last):
                    ids, mask, starts, ends = gather.packs(arrays, b0, b1)
                    for k in range(b1 - b0):
                        lo, hi = int(ends[k]), int(ends[k + 1])
                        builder.add_packed(ids[lo:hi], mask[lo:hi], starts[k] - lo)
        finally:
            gather.close()
        body = {"final": out.final, "packs": last - first, "metadata": builder.metadata.to_dict(),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        return self.book.write(unit, body, [out.staged + s for s in PUBLISH_ORDER], pinned=[out.staged + SEQ_IDX_SUFFIX])


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
    """Builds packs from store sequences: truncation, padding and the truncated-end mask rule.

    Sequences are read with ``pread`` into a chunk-sized buffer, not through a map: packs take
    their sequences from anywhere in the store, and every fault on a mapped file maps the whole
    page-cache folio around it (64 KiB to MiBs on current kernels, whatever ``madvise`` says),
    which charged the process ~100 MiB of file pages per chunk. A read maps nothing, so RSS is
    the chunk's own buffers however large the store is.
    """

    def __init__(self, store: SequenceStore, pack_size: int, pad_multiple: int, pad_id: int,
                 pad_layout: str = "stored", truncated_turn_loss: str = "keep") -> None:
        self.store = store
        self.part_starts = store.starts()
        self.truncate_to = truncation_length(pack_size, pad_multiple, pad_layout)
        self.pad_multiple = pad_multiple
        self.pad_layout = pad_layout
        self.pad_id = pad_id
        self.drop_cut_turn = truncated_turn_loss == "drop"
        self._files = {}   # partition -> _PartFiles

    def _part(self, k: int) -> "_PartFiles":
        files = self._files.get(k)
        if files is None:
            files = self._files[k] = _PartFiles(self.store.part(k), part_prefix(self.store.directory, k))
        return files

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def packs(self, arrays: dict, b0: int, b1: int):
        """Packs ``b0..b1`` of a split: ``(ids int64, mask uint8, seq starts per pack, pack ends)``.

        ``seq starts per pack`` is a list of int64 arrays of absolute offsets in ``ids``; pack k
        spans ``ends[k]..ends[k+1]``.

        Raises:
            ShardError: a store partition is shorter than its index says (changed under the run).
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
            full[sel] = self._part(int(k)).lengths[local[sel]]
        copy = np.minimum(full, self.truncate_to)
        dst = exclusive_cumsum(padded_length(copy, self.pad_multiple, self.pad_layout))
        ids = np.full(int(dst[-1]), self.pad_id, dtype=np.int64)
        mask = np.zeros(int(dst[-1]), dtype=np.uint8)
        for k in touched:
            sel = np.flatnonzero(part == k)
            tokens, loss, src = self._part(int(k)).read(local[sel], copy[sel])
            fill_sequences(ids, mask, dst[sel], tokens, loss, src, copy[sel], full[sel], self.drop_cut_turn)
        pack_seq = np.asarray(offsets[b0:b1 + 1], dtype=np.int64) - s0
        ends = dst[pack_seq]
        starts = [dst[pack_seq[k]:pack_seq[k + 1]] for k in range(b1 - b0)]
        return ids, mask, starts, ends


class _PartFiles:
    """One store partition for reading sequences: its index arrays (mapped: small) and its
    token and loss-mask files, read with ``pread``."""

    def __init__(self, ds, prefix: str) -> None:
        self.lengths = ds.sequence_lengths
        self.pointers = ds.sequence_pointers
        self.dtype = ds.dtype.numpy
        self.itemsize = ds.dtype.itemsize
        self.prefix = prefix
        self.files = open_generation(prefix, ShardPaths.from_prefix(prefix))

    def read(self, local: np.ndarray, count: np.ndarray):
        """The first ``count[i]`` tokens and loss values of sequences ``local``, one after another:
        ``(tokens, loss, start of each sequence in them)``.

        Raises:
            ShardError: a file is shorter than the index says, or cannot be read.
        """
        starts = exclusive_cumsum(count)
        tokens = np.empty(int(starts[-1]), dtype=self.dtype)
        loss = np.empty(int(starts[-1]), dtype=np.uint8)
        token_bytes, loss_bytes = memoryview(tokens).cast("B"), memoryview(loss)
        size, read = self.itemsize, self.files.read_into
        for pointer, a, b in zip(self.pointers[local].tolist(), starts[:-1].tolist(), starts[1:].tolist()):
            if (read(BIN_SUFFIX, token_bytes[a * size:b * size], pointer) != (b - a) * size
                    or read(LOSS_SUFFIX, loss_bytes[a:b], pointer // size) != b - a):
                raise ShardError("store partition is shorter than its index says", path=self.prefix,
                                 field="sequence_pointers", hint="the sequence store changed under the run; "
                                 "rebuild it (rerun without --resume)")
        return tokens, loss, starts[:-1]

    def close(self) -> None:
        self.files.close()
