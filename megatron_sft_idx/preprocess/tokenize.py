"""The index and tokenize steps: inputs -> partitions -> the sequence store.

:class:`IndexStep` (unit: one input file) hashes the file and cuts its partitions;
:class:`TokenizeStep` (unit: one partition) reads the partition's records, encodes them a
batch at a time through :meth:`RecordEncoder.encode_batch`, and writes partition ``k`` of the
store (a shard plus its ``.rows``), then its receipt. Both are embarrassingly parallel, hold
one batch in memory, and know nothing of the engine that runs them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from ..builder import IndexedDatasetBuilder
from ..errors import InputError
from ..packing import exclusive_cumsum
from .encode import EncodedBatch, EncodeOptions, RecordEncoder, preload
from .engines.base import report_progress
from .partitions import Partition, index_file, read_batches
from .receipts import ReceiptBook
from .store import ROW_DTYPE, ROWS_SUFFIX, part_prefix, tokenize_book

_ENCODERS: Dict[EncodeOptions, RecordEncoder] = {}  # one per process and options: load the tokenizer once


def encoder_for(options: EncodeOptions) -> RecordEncoder:
    encoder = _ENCODERS.get(options)
    if encoder is None:
        encoder = _ENCODERS[options] = RecordEncoder(options)
    return encoder


@dataclass(frozen=True)
class IndexStep:
    """Unit ``i``: sha256, size and partitions of input file ``i``; the receipt holds them."""

    paths: Tuple[str, ...]       # absolute paths, read by whichever node runs the unit
    partition_bytes: int
    book: ReceiptBook
    name: str = "index"

    @property
    def writes_to(self) -> str:
        return self.book.directory

    def run(self, unit: int) -> dict:
        try:
            info = index_file(self.paths[unit], unit, self.partition_bytes)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read input ({exc.__class__.__name__}: {exc})", path=self.paths[unit],
                             hint="check the file is complete and its format matches its suffix") from None
        return self.book.write(unit, info)


class PartWriter:
    """Partition ``unit`` of the store: its shard (one conversation per pack) and its rows."""

    def __init__(self, directory: str, unit: int, vocab_size: Optional[int], metadata: dict) -> None:
        self.prefix = part_prefix(directory, unit)
        os.makedirs(os.path.dirname(self.prefix), exist_ok=True)
        self.builder = IndexedDatasetBuilder(self.prefix, vocab_size=vocab_size, pack_size=None,
                                             metadata=metadata, overwrite=True)
        self.rows = []
        self.tokens = 0

    def add(self, batch: EncodedBatch) -> None:
        ends = exclusive_cumsum(batch.lengths)
        self.builder.add_sequences(batch.ids, batch.loss_mask, batch.lengths)  # one pack per conversation
        rows = np.empty(batch.lengths.size, dtype=ROW_DTYPE)
        rows["line"] = batch.lines
        rows["length"] = batch.lengths
        rows["first_trained"] = first_trained(batch.loss_mask, ends)
        self.rows.append(rows)
        self.tokens += int(ends[-1])

    def finish(self) -> list:
        """Publish the shard (when it holds anything) and the rows; returns the artifact paths."""
        from .._atomic import write_file_atomically

        rows = np.concatenate(self.rows) if self.rows else np.empty(0, ROW_DTYPE)
        artifacts = []
        if rows.size:
            self.builder.finalize()
            artifacts = [self.prefix + s for s in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")]
        else:
            self.builder.abort()
        write_file_atomically(self.prefix + ROWS_SUFFIX, lambda f: f.write(rows.tobytes()))
        return artifacts + [self.prefix + ROWS_SUFFIX]

    def abort(self) -> None:
        self.builder.abort()


def first_trained(mask: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per sequence ``[ends[k], ends[k+1])``: the offset of its first trained position (the
    sequence's length when none is), so the planner can tell, from lengths alone, whether a
    sequence cut to T tokens still trains anything (``first_trained < T - 1``)."""
    lengths = np.diff(ends)
    trained = np.flatnonzero(mask)
    if trained.size == 0:
        return lengths.astype(np.int32)
    at = np.minimum(np.searchsorted(trained, ends[:-1]), trained.size - 1)
    first = trained[at] - ends[:-1]
    return np.where((first >= 0) & (first < lengths), first, lengths).astype(np.int32)


@dataclass(frozen=True)
class TokenizeStep:
    """Unit ``k``: tokenize partition ``k`` into the store; the receipt is the commit point."""

    directory: str                     # the store, absolute
    store_id: str
    paths: Tuple[str, ...]             # absolute input paths, for reading
    names: Tuple[str, ...]             # the inputs as given, for messages (file:line)
    partitions: Tuple[Partition, ...]
    options: EncodeOptions
    batch_size: int
    max_record_bytes: int
    shard_metadata: Tuple[dict, ...]   # per input file: metadata of its partitions' shards
    name: str = "tokenize"

    @property
    def writes_to(self) -> str:
        return self.directory

    @property
    def book(self) -> ReceiptBook:
        return tokenize_book(self.directory, self.store_id)

    def prepare(self) -> None:
        """Load the tokenizers once in the process that forks the workers, so they start with them."""
        preload(self.options)
        encoder_for(self.options)

    def run(self, unit: int) -> dict:
        part = self.partitions[unit]
        path, name = self.paths[part.file], self.names[part.file]
        encoder = encoder_for(self.options)
        meta = dict(self.shard_metadata[part.file])
        meta["extra"] = dict(meta.get("extra") or {}, store_id=self.store_id, partition=part.to_list())
        writer = PartWriter(self.directory, unit, self.options.vocab_size, meta)
        records, sequences = 0, 0
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        try:
            for batch in _read(path, name, part, self.batch_size, self.max_record_bytes):
                records += len(batch)
                encoded = encoder.encode_batch(batch, name)
                if part.kind in ("lines", "array"):  # the driver sized this partition in bytes
                    report_progress(sum(len(raw) for _, raw in batch if isinstance(raw, bytes)))
                writer.add(encoded)
                sequences += int(encoded.lengths.size)
                for reason, count in encoded.skipped.items():
                    skipped[reason] = skipped.get(reason, 0) + count
                for reason, message in encoded.first_skipped.items():
                    first.setdefault(reason, message)
            artifacts = writer.finish()
        except BaseException:
            writer.abort()
            raise
        body = {"records": records, "sequences": sequences, "tokens": writer.tokens, "skipped": skipped,
                "first_skipped": first}
        pinned = [a for a in artifacts if a.endswith((".seq.idx", ROWS_SUFFIX))]  # small: verified on reuse
        return self.book.write(unit, body, artifacts, pinned)


def _read(path: str, name: str, part: Partition, batch_size: int, max_record_bytes: int):
    try:
        yield from read_batches(path, part, batch_size, max_record_bytes)
    except InputError:
        raise
    except (OSError, EOFError, ValueError) as exc:
        raise InputError(f"cannot read input ({exc.__class__.__name__}: {exc})", path=name,
                         hint="check the file is complete and its compression matches its suffix") from None
