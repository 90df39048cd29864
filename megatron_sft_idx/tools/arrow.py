"""Shards as Arrow record batches built on the memory maps: no token data is copied.

One row per pack. The list columns (``input_ids``, ``loss_mask``, ``seq_start_id``) are
``large_list`` arrays whose values buffer *is* the mapped file region (``pa.py_buffer``
over the mapped numpy view); only their offsets (8 bytes per pack) and the scalar
columns are new memory. So DuckDB, Polars or pandas can query a shard or a manifest of
shards without converting it::

    import duckdb
    from megatron_sft_idx.tools.arrow import PackTable
    packs = PackTable("/data/train_*")          # prefix, glob, directory, manifest or list
    duckdb.sql("SELECT num_sequences, count(*) FROM packs GROUP BY 1 ORDER BY 1").show()
    polars.from_arrow(packs.to_table())          # also zero-copy for the token lists

Columns: ``shard`` (string, the shard's prefix or URL), ``shard_index`` (int32, the shard's
position in the list), ``pack`` (int64, global),
``packed_len`` (int32), ``num_sequences`` (int32), ``trainable_tokens`` (int64, ones in the
loss mask; computed from it), ``input_ids`` (large_list of the token dtype; int32 when
shards of both dtypes are listed, then copied), ``loss_mask`` (large_list<uint8>),
``seq_start_id`` (large_list<int32>).

:class:`SequenceTable` is one row per *sequence* of the same shards: ``shard``, ``shard_index``,
``pack`` (global), ``sequence`` (its position in the pack), ``length`` (int32), ``trainable_tokens``
(int64) and, for shards written from a mixture (format 1.2), ``source_id`` (int32) and ``source``
(string, its name; both null for shards that record no sources): ``GROUP BY source``.

A :class:`PackTable` implements the Arrow PyCapsule stream protocol
(``__arrow_c_stream__``), and each call starts a fresh pass, so a query engine may scan
it several times. Every batch's offsets are checked against the shard's lengths before
Arrow sees them: a corrupt index raises :class:`InvariantError`, never a wild read.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from .. import _kernels
from .._extras import require_extra
from ..errors import FormatError, InvariantError
from ..reader import MMapIndexedDataset

COLUMNS = ("shard", "shard_index", "pack", "packed_len", "num_sequences", "trainable_tokens", "input_ids", "loss_mask",
           "seq_start_id")
#: Packs per record batch.
BATCH_PACKS = 1 << 16
#: Batches between releases of the mapped pages (RSS stays at a few batches' worth).
_RELEASE_EVERY = 16


def _pa():
    require_extra("tools", "pyarrow")
    import pyarrow

    return pyarrow


def _large_list(values: np.ndarray, offsets: np.ndarray, value_type):
    """A large_list array over ``values`` without copying them (``offsets`` start at 0)."""
    pa = _pa()
    buffer = pa.py_buffer(np.ascontiguousarray(values))
    flat = pa.Array.from_buffers(value_type, len(values), [None, buffer])
    return pa.LargeListArray.from_arrays(pa.Array.from_buffers(pa.int64(), len(offsets), [None, pa.py_buffer(offsets)]),
                                         flat)


class PackTable:
    """Shards as a re-scannable stream of Arrow record batches (see the module docstring).

    Args:
        spec: a shard prefix, glob, directory, manifest ``.json`` or a list of those.
        columns: the columns to produce (default all); unused ones cost nothing.
        batch_packs: packs per record batch.

    Raises:
        ShardNotFoundError, ShardError: a shard is missing or unreadable.
        FormatError: a shard is upstream pretrain data (no SFT columns) or a column is unknown.
    """

    def __init__(self, spec, columns: Optional[Sequence[str]] = None, batch_packs: int = BATCH_PACKS) -> None:
        from .merge_plan import resolve_inputs

        pa = _pa()
        self.columns = tuple(COLUMNS if columns is None else columns)
        unknown = [c for c in self.columns if c not in COLUMNS]
        if unknown:
            raise FormatError(f"unknown column(s) {unknown}", field="columns", expected=list(COLUMNS))
        self.prefixes: List[str] = resolve_inputs([spec] if isinstance(spec, str) else list(spec))
        self.batch_packs = int(batch_packs)
        counts, dtypes = [], set()
        for prefix in self.prefixes:
            shard = MMapIndexedDataset(prefix)
            if shard.is_pretrain:
                raise FormatError("upstream pretrain data has no loss mask or sequence starts to query",
                                  path=prefix, field="kind", expected="sft", actual="pretrain",
                                  hint="convert it first: convert-packed PREFIX OUT --pack-size N")
            counts.append(len(shard))
            dtypes.add(shard.dtype.numpy)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.token_dtype = np.dtype(dtypes.pop()) if len(dtypes) == 1 else np.dtype(np.int32)
        types = {"shard": pa.string(), "shard_index": pa.int32(), "pack": pa.int64(), "packed_len": pa.int32(), "num_sequences": pa.int32(),
                 "trainable_tokens": pa.int64(), "input_ids": pa.large_list(pa.from_numpy_dtype(self.token_dtype)),
                 "loss_mask": pa.large_list(pa.uint8()), "seq_start_id": pa.large_list(pa.int32())}
        self.schema = pa.schema([(c, types[c]) for c in self.columns])
        self.failure: Optional[BaseException] = None

    def __len__(self) -> int:
        return int(self.counts.sum())

    def batches(self) -> Iterator:
        """Record batches of every shard, in order. An exception raised here while a query
        engine pulls the batches is also kept as ``failure``: an engine reports it inside
        its own error (DuckDB with the Python traceback), so the caller can raise it as is."""
        self.failure: Optional[BaseException] = None
        base = 0
        try:
            for k, prefix in enumerate(self.prefixes):
                shard = MMapIndexedDataset(prefix)
                yield from self._shard_batches(shard, k, base)
                base += len(shard)
        except BaseException as exc:  # GeneratorExit too: an engine that stops early closes us
            if not isinstance(exc, GeneratorExit):
                self.failure = exc
            raise

    def reader(self):
        """A one-pass ``pyarrow.RecordBatchReader``."""
        return _pa().RecordBatchReader.from_batches(self.schema, self.batches())

    def __arrow_c_stream__(self, requested_schema=None):
        return self.reader().__arrow_c_stream__(requested_schema)

    def to_table(self):
        """All batches as a ``pyarrow.Table`` (the token lists still point into the maps)."""
        return _pa().Table.from_batches(list(self.batches()), schema=self.schema)

    def _shard_batches(self, shard: MMapIndexedDataset, k: int, base: int) -> Iterator:
        pa = _pa()
        arrays = shard.arrays()
        n = len(shard)
        for number, a in enumerate(range(0, n, self.batch_packs)):
            b = min(n, a + self.batch_packs)
            parts = _batch_parts(shard, arrays, a, b)
            columns = [self._column(name, parts, k, base, a, b) for name in self.columns]
            yield pa.RecordBatch.from_arrays(columns, schema=self.schema)
            if number % _RELEASE_EVERY == _RELEASE_EVERY - 1:
                shard.release_pages()  # file-backed pages: still in the page cache, refaulted if read

    def _column(self, name: str, parts: Dict[str, np.ndarray], k: int, base: int, a: int, b: int):
        pa = _pa()
        if name == "shard":
            return pa.repeat(pa.scalar(self.prefixes[k], pa.string()), b - a)
        if name == "shard_index":
            return pa.array(np.full(b - a, k, dtype=np.int32))
        if name == "pack":
            return pa.array(np.arange(base + a, base + b, dtype=np.int64))
        if name == "packed_len":
            return pa.array(parts["lengths"])
        if name == "num_sequences":
            return pa.array(np.diff(parts["seq_offsets"]).astype(np.int32))
        if name == "trainable_tokens":
            out = np.empty(b - a, dtype=np.int64)
            _kernels.segment_sums(parts["loss"], parts["token_offsets"], out)
            return pa.array(out)
        if name == "input_ids":
            tokens = parts["tokens"]
            if tokens.dtype != self.token_dtype:  # shards of both dtypes: the only copy
                tokens = tokens.astype(self.token_dtype)
            return _large_list(tokens, parts["token_offsets"], pa.from_numpy_dtype(self.token_dtype))
        if name == "loss_mask":
            return _large_list(parts["loss"], parts["token_offsets"], pa.uint8())
        return _large_list(parts["starts"], parts["seq_offsets"], pa.int32())


SEQUENCE_COLUMNS = ("shard", "shard_index", "pack", "sequence", "length", "trainable_tokens", "source_id", "source")


class SequenceTable(PackTable):
    """One row per sequence of the shards (module doc), re-scannable as :class:`PackTable`.

    Raises:
        as :class:`PackTable`; FormatError: an unknown column.
    """

    def __init__(self, spec, columns: Optional[Sequence[str]] = None, batch_packs: int = BATCH_PACKS) -> None:
        pa = _pa()
        unknown = [c for c in (columns or ()) if c not in SEQUENCE_COLUMNS]
        if unknown:
            raise FormatError(f"unknown column(s) {unknown}", field="columns", expected=list(SEQUENCE_COLUMNS))
        super().__init__(spec, columns=("pack",), batch_packs=batch_packs)
        self.columns = tuple(SEQUENCE_COLUMNS if columns is None else columns)
        types = {"shard": pa.string(), "shard_index": pa.int32(), "pack": pa.int64(), "sequence": pa.int32(),
                 "length": pa.int32(), "trainable_tokens": pa.int64(), "source_id": pa.int32(), "source": pa.string()}
        self.schema = pa.schema([(c, types[c]) for c in self.columns])

    def _shard_batches(self, shard: MMapIndexedDataset, k: int, base: int) -> Iterator:
        pa = _pa()
        arrays = shard.arrays()
        names = shard.sources
        for number, a in enumerate(range(0, len(shard), self.batch_packs)):
            b = min(len(shard), a + self.batch_packs)
            parts = _batch_parts(shard, arrays, a, b)
            counts = np.diff(parts["seq_offsets"])
            starts = parts["starts"].astype(np.int64) + np.repeat(parts["token_offsets"][:-1], counts)
            ends = np.append(starts[1:], parts["token_offsets"][-1])
            ends[np.cumsum(counts) - 1] = parts["token_offsets"][1:]   # each pack's last sequence ends with it
            trained = np.empty(starts.size, dtype=np.int64)
            _kernels.segment_sums(parts["loss"], np.append(starts, ends[-1]), trained)
            ids = (None if names is None else
                   np.asarray(shard.sequence_source_ids[int(arrays.seq_offsets[a]):int(arrays.seq_offsets[b])]))
            values = {"shard": lambda: pa.repeat(pa.scalar(self.prefixes[k], pa.string()), starts.size),
                      "shard_index": lambda: pa.array(np.full(starts.size, k, dtype=np.int32)),
                      "pack": lambda: pa.array(base + a + np.repeat(np.arange(b - a, dtype=np.int64), counts)),
                      "sequence": lambda: pa.array((np.arange(starts.size) - np.repeat(
                          np.cumsum(counts) - counts, counts)).astype(np.int32)),
                      "length": lambda: pa.array((ends - starts).astype(np.int32)),
                      "trainable_tokens": lambda: pa.array(trained),
                      "source_id": lambda: (pa.nulls(starts.size, pa.int32()) if ids is None
                                            else pa.array(ids.astype(np.int32))),
                      "source": lambda: (pa.nulls(starts.size, pa.string()) if ids is None
                                         else pa.array(np.asarray(names, dtype=object)[ids], pa.string()))}
            yield pa.RecordBatch.from_arrays([values[c]() for c in self.columns], schema=self.schema)
            if number % _RELEASE_EVERY == _RELEASE_EVERY - 1:
                shard.release_pages()


def _batch_parts(shard: MMapIndexedDataset, arrays, a: int, b: int) -> Dict[str, np.ndarray]:
    """Views and offsets of packs [a, b), checked so that Arrow never reads outside the maps."""
    itemsize = shard.dtype.itemsize
    lengths = np.array(arrays.sequence_lengths[a:b])
    pointers = np.asarray(arrays.sequence_pointers[a:b], dtype=np.int64)
    seq = np.asarray(arrays.seq_offsets[a:b + 1], dtype=np.int64)
    t0 = int(pointers[0]) // itemsize
    token_offsets = np.empty(b - a + 1, dtype=np.int64)
    token_offsets[0] = 0
    np.cumsum(lengths, out=token_offsets[1:])
    expected = (t0 + token_offsets[:-1]) * itemsize
    bad = np.flatnonzero((lengths <= 0) | (pointers != expected))
    t1 = t0 + int(token_offsets[-1])
    if bad.size or t1 > arrays.tokens.size or seq[0] < 0 or np.any(np.diff(seq) <= 0) \
            or seq[-1] > arrays.seq_starts.size:
        raise InvariantError("the shard's index is corrupt (pointers, lengths or CSR offsets)", path=shard.prefix,
                             pack=a + int(bad[0]) if bad.size else a, field="sequence_pointers/seq_offsets",
                             hint="run check-idx on this shard and rebuild it")
    s0 = int(seq[0])
    return {"lengths": lengths, "token_offsets": token_offsets, "seq_offsets": seq - s0,
            "tokens": arrays.tokens[t0:t1], "loss": arrays.loss_mask[t0:t1],
            "starts": arrays.seq_starts[s0:int(seq[-1])]}
