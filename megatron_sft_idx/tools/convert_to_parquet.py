"""Shards -> Megatron-Bridge packed Parquet, streaming one row group at a time.

The schema is what Bridge's ``GPTSFTPackedParquetDataset`` reads (its docstring and the
columns it requires): ``input_ids list<int32>``, ``loss_mask list<int8>``, ``seq_start_id
list<int32>``, one row per pack, row groups of 500 rows (Bridge's ``write_packed_parquet``
default). The shard's metadata travels in the schema's key-value metadata under
``megatron_sft_idx.metadata``, so converting the file back restores the shard byte for byte.
Optionally the Bridge pack-metadata JSON (``pack_metadata_file_path``, which
``pad_cu_seqlens`` needs) is written beside it.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from .. import publishing
from .._atomic import write_file_atomically
from .._extras import require_extra
from ..errors import FormatError
from ..packed import runtime_min_packed
from ..reader import MMapIndexedDataset
from .merge_plan import plan_merge

METADATA_KEY = b"megatron_sft_idx.metadata"
ROW_GROUP_SIZE = 500
_PER_SHARD_KEYS = ("stats", "files", "producer")


def output_metadata(prefixes: Sequence[str]) -> dict:
    """The metadata the Parquet file carries: the shard's own (one shard), or what a merge
    of the shards would record (several; incompatible shards are refused as merge refuses them)."""
    if len(prefixes) == 1:
        meta = MMapIndexedDataset(prefixes[0]).metadata.to_dict()
        return {k: v for k, v in meta.items() if k not in _PER_SHARD_KEYS}

    return plan_merge(prefixes).metadata


def _list_array(values: np.ndarray, offsets: np.ndarray, value_type):
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), type=pa.int32()),
                                    pa.array(values, type=value_type))


def _row_groups(shard: MMapIndexedDataset, rows: int):
    """``(input_ids, loss_mask, seq_start_id)`` list arrays of ``rows`` packs at a time."""
    import pyarrow as pa

    arrays = shard.arrays()
    itemsize = shard.dtype.itemsize
    n = len(shard)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        starts = np.asarray(arrays.sequence_pointers[a:b], dtype=np.int64) // itemsize
        t0, t1 = int(starts[0]), int(starts[-1]) + int(arrays.sequence_lengths[b - 1])
        token_offsets = np.append(starts - t0, t1 - t0)
        seq_offsets = np.asarray(arrays.seq_offsets[a:b + 1], dtype=np.int64)
        s0 = int(seq_offsets[0])
        yield (_list_array(np.asarray(arrays.tokens[t0:t1], dtype=np.int32), token_offsets, pa.int32()),
               _list_array(np.asarray(arrays.loss_mask[t0:t1]).view(np.int8), token_offsets, pa.int8()),
               _list_array(np.asarray(arrays.seq_starts[s0:int(seq_offsets[-1])]), seq_offsets - s0, pa.int32()))
        if not (a // rows) % 64:
            shard.release_pages()


def shards_to_parquet(prefixes: Sequence[str], output: str, *, row_group_size: int = ROW_GROUP_SIZE,
                      compression: str = "snappy", overwrite: bool = False,
                      pack_metadata: Optional[str] = None) -> Dict[str, int]:
    """Write every pack of ``prefixes`` (in order) as one packed Parquet file, atomically.

    Returns ``{"packs", "row_groups"}``.

    Raises:
        ShardExistsError: ``output`` exists and ``overwrite`` is false.
        FormatError: an input is pretrain data (no loss mask or sequence starts to write).
        IncompatibleShardsError: several shards that could not be one shard.
    """
    require_extra("tools", "pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    output = os.fspath(output)
    if not overwrite:
        publishing.refuse_existing([output] if os.path.exists(output) else [])
    shards = [MMapIndexedDataset(p) for p in prefixes]
    for shard in shards:
        if shard.is_pretrain:
            raise FormatError("upstream pretrain data has no SFT fields to write as packed Parquet",
                              path=shard.prefix, field="kind", expected="sft", actual="pretrain",
                              hint="convert it to a shard first: convert-packed PREFIX OUT --pack-size N")
    meta = output_metadata(prefixes)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                        ("seq_start_id", pa.list_(pa.int32()))],
                       metadata={METADATA_KEY: json.dumps(meta, sort_keys=True).encode("utf-8")})
    counts = {"packs": 0, "row_groups": 0}

    def write(f) -> None:
        with pq.ParquetWriter(f, schema, compression=compression) as writer:
            for shard in shards:
                for columns in _row_groups(shard, row_group_size):
                    writer.write_table(pa.Table.from_arrays(list(columns), schema=schema),
                                       row_group_size=row_group_size)
                    counts["row_groups"] += 1
                counts["packs"] += len(shard)

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    write_file_atomically(output, write)
    if pack_metadata:
        write_bridge_pack_metadata(pack_metadata, shards)
    return counts


def write_bridge_pack_metadata(path: str, shards: List[MMapIndexedDataset]) -> dict:
    """Bridge's packing-metadata record (``create_packing_strategy``'s dict, in a one-item list)
    from the shards' statistics; ``pad_cu_seqlens`` reads ``max_samples_per_bin``,
    ``dataset_max_seqlen`` and ``min_packed_seqlen`` from it.

    Bridge's packer bins each sequence on its length minus one (the label shift), so its
    record is in those runtime units: the longest sequence minus one, the shortest pack's
    length minus its sequence count, and the efficiency of the runtime lengths.
    """
    stats = [s.metadata.stats for s in shards]
    packs = sum(s.pack_count for s in stats)
    runtime_tokens = sum(s.token_count - s.sequence_count for s in stats)
    sizes = [s.metadata.pack_size for s in shards]
    pack_size = max(sizes) if all(sizes) else max(s.max_packed_seqlen for s in stats)
    record = {"dataset_max_seqlen": max(s.dataset_max_seqlen for s in stats) - 1,
              "max_samples_per_bin": max(s.max_samples_per_bin for s in stats),
              "packing_factor": round(sum(s.sequence_count for s in stats) / packs, 2),
              "packing_efficiency": round(runtime_tokens / packs / pack_size * 100, 2),
              "pack_size": pack_size, "min_packed_seqlen": min(runtime_min_packed(s) for s in shards)}
    data = json.dumps([record], indent=1).encode("utf-8")
    write_file_atomically(os.fspath(path), lambda f: f.write(data))
    return record
