"""Packed Parquet as Megatron-Bridge writes and reads it (``packed_parquet.py``).

Schema ``input_ids list<int32>``, ``loss_mask list<int8>``, ``seq_start_id
list<int32>``; row groups of 500 rows; pyarrow's default compression (snappy), as
``pq.write_table(table, path, row_group_size=500)`` gives. Bridge's
``write_packed_parquet`` builds the whole table in memory first; here the rows are
written 500 at a time through a ``ParquetWriter``, which yields the same file and is
the kinder peer for writer memory.

Reading follows ``GPTSFTPackedParquetDataset``: metadata (row-group row counts) at
open, the ``ParquetFile`` opened lazily on first access, the row group found by
bisect over cumulative row counts, the last row group cached, and each row's three
columns converted with ``.as_py()`` into lists, with ``seq_boundaries`` appended.
"""

from __future__ import annotations

import bisect
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NAME = "parquet"
LABEL = "packed Parquet (Megatron-Bridge)"
TOUCHES = (0, 1, 2, 3)
ROW_GROUP_SIZE = 500
SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                    ("seq_start_id", pa.list_(pa.int32()))])


def _path(out_dir) -> Path:
    return Path(out_dir) / "packed.idx.parquet"


def _list_column(parts, dtype):
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _flush(writer, rows) -> None:
    ids, loss, starts = zip(*rows)
    table = pa.Table.from_arrays([_list_column(ids, np.int32), _list_column(loss, np.int8),
                                  _list_column(starts, np.int32)], schema=SCHEMA)
    writer.write_table(table, row_group_size=ROW_GROUP_SIZE)


def write(corpus, out_dir) -> dict:
    t0 = time.perf_counter()
    with pq.ParquetWriter(str(_path(out_dir)), SCHEMA) as writer:
        rows = []
        for pack in corpus.iter_packs():
            rows.append(pack)
            if len(rows) == ROW_GROUP_SIZE:
                _flush(writer, rows)
                rows = []
        if rows:
            _flush(writer, rows)
    return {"write_s": time.perf_counter() - t0}


def files(out_dir):
    return [_path(out_dir)]


class PackedParquetDataset:
    """Bridge's reader for one file: lazy ParquetFile, bisect, one cached row group."""

    def __init__(self, path) -> None:
        self.path = str(path)
        metadata = pq.read_metadata(self.path)
        missing = {"input_ids", "seq_start_id", "loss_mask"} - set(pq.read_schema(self.path).names)
        if missing:
            raise ValueError(f"{self.path} lacks columns {missing}")
        self._row_group_offsets = [0]
        for i in range(metadata.num_row_groups):
            self._row_group_offsets.append(self._row_group_offsets[-1] + metadata.row_group(i).num_rows)
        self._num_rows = metadata.num_rows
        self._pf = None
        self._cached_id = None
        self._cached_table = None

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, idx: int) -> dict:
        if self._pf is None:
            self._pf = pq.ParquetFile(self.path)
        group = bisect.bisect_right(self._row_group_offsets, idx) - 1
        row = idx - self._row_group_offsets[group]
        if self._cached_id != group:
            self._cached_table = self._pf.read_row_group(group, columns=["input_ids", "seq_start_id", "loss_mask"])
            self._cached_id = group
        table = self._cached_table
        input_ids = table.column("input_ids")[row].as_py()
        seq_start_id = table.column("seq_start_id")[row].as_py()
        loss_mask = table.column("loss_mask")[row].as_py()
        return {"input_ids": input_ids, "seq_boundaries": seq_start_id + [len(input_ids)], "loss_mask": loss_mask}


def open_reader(out_dir):
    return PackedParquetDataset(_path(out_dir))


def touch(rec):
    ids = rec["input_ids"]
    bounds = rec["seq_boundaries"]
    return (len(ids), sum(ids), sum(rec["loss_mask"]), sum(bounds) - bounds[-1])


def touch_tokens(rec):
    return sum(rec["input_ids"])


def as_arrays(rec):
    return np.array(rec["input_ids"]), np.array(rec["loss_mask"]), np.array(rec["seq_boundaries"][:-1])
