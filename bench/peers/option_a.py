"""The RFC's Option A (seed ``001_*``): padded fixed-shape ``.npy`` memmaps in a directory.

``input_ids.npy`` int32[num_bins, pack_size] and ``loss_mask.npy`` uint8[num_bins,
pack_size], padded; ``packed_len.npy`` uint32[num_bins]; CSR ``seq_offsets.npy``
uint32[num_bins+1] + ``seq_starts.npy`` uint32[total]; ``manifest.json``. The writer
pre-allocates every array with ``np.lib.format.open_memmap`` (so it must know the
pack and sequence counts up front) and renames ``*.tmp`` at the end; the reader
loads the manifest at open, opens the memmaps on first access and returns
``{"input_ids", "seq_boundaries", "loss_mask"}`` with ``seq_boundaries`` a list,
as the plan's ``GPTSFTPackedMemmapDataset`` does.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

NAME = "option_a"
LABEL = "Option A padded memmap (RFC seed 001)"
TOUCHES = (0, 1, 2, 3)
_ARRAYS = ("input_ids", "loss_mask", "packed_len", "seq_offsets", "seq_starts")


class PaddedMemmapWriter:
    """Streaming writer of the padded layout; memory is O(pack_size) plus dirty mapped pages."""

    def __init__(self, out_dir, num_bins: int, pack_size: int, total_seq_starts: int, dtype=np.int32):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_bins, self.pack_size, self.dtype = num_bins, pack_size, np.dtype(dtype)
        shapes = {"input_ids": (self.dtype, (num_bins, pack_size)), "loss_mask": (np.uint8, (num_bins, pack_size)),
                  "packed_len": (np.uint32, (num_bins,)), "seq_offsets": (np.uint32, (num_bins + 1,)),
                  "seq_starts": (np.uint32, (total_seq_starts,))}
        self.maps = {name: np.lib.format.open_memmap(self.dir / f"{name}.npy.tmp", mode="w+", dtype=dt, shape=shape)
                     for name, (dt, shape) in shapes.items()}
        self.maps["seq_offsets"][0] = 0
        self._seq_pos = 0
        self._written = 0

    def write_bin(self, bin_id: int, input_ids, loss_mask, seq_start_id) -> None:
        n, k = len(input_ids), len(seq_start_id)
        m = self.maps
        m["input_ids"][bin_id, :n] = input_ids
        m["loss_mask"][bin_id, :n] = loss_mask
        m["packed_len"][bin_id] = n
        m["seq_starts"][self._seq_pos:self._seq_pos + k] = seq_start_id
        self._seq_pos += k
        m["seq_offsets"][bin_id + 1] = self._seq_pos
        self._written += 1

    def finalize(self) -> dict:
        for arr in self.maps.values():
            arr.flush()
        self.maps.clear()
        for name in _ARRAYS:
            os.replace(self.dir / f"{name}.npy.tmp", self.dir / f"{name}.npy")
        manifest = {"version": "1.0", "format": "memmap_padded_v1", "num_bins": self.num_bins,
                    "pack_size": self.pack_size, "dtype": self.dtype.str, "loss_mask_dtype": "<u1",
                    "index_dtype": "<u4", "bins_written": self._written}
        (self.dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return manifest


class PaddedMemmapDataset:
    """Manifest at open; memmaps opened lazily on first access (per DataLoader worker)."""

    def __init__(self, shard_dir) -> None:
        self.dir = Path(shard_dir)
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self._num_bins = self.manifest["num_bins"]
        self._loaded = False

    def _ensure_open(self) -> None:
        if not self._loaded:
            for name in _ARRAYS:
                setattr(self, name, np.load(self.dir / f"{name}.npy", mmap_mode="r"))
            self._loaded = True

    def __len__(self) -> int:
        return self._num_bins

    def __getitem__(self, idx: int) -> dict:
        self._ensure_open()
        n = int(self.packed_len[idx])
        start, end = int(self.seq_offsets[idx]), int(self.seq_offsets[idx + 1])
        return {"input_ids": self.input_ids[idx, :n],
                "seq_boundaries": self.seq_starts[start:end].tolist() + [n],
                "loss_mask": self.loss_mask[idx, :n]}


def write(corpus, out_dir) -> dict:
    t0 = time.perf_counter()
    writer = PaddedMemmapWriter(Path(out_dir) / "option_a", len(corpus), corpus.pack_size, corpus.n_sequences)
    for i, (ids, loss, starts) in enumerate(corpus.iter_packs()):
        writer.write_bin(i, ids, loss, starts)
    writer.finalize()
    return {"write_s": time.perf_counter() - t0}


def files(out_dir):
    d = Path(out_dir) / "option_a"
    return [d / f"{name}.npy" for name in _ARRAYS] + [d / "manifest.json"]


def open_reader(out_dir):
    return PaddedMemmapDataset(Path(out_dir) / "option_a")


def touch(rec):
    ids = rec["input_ids"]
    bounds = rec["seq_boundaries"]
    return (ids.shape[0], int(ids.sum()), int(rec["loss_mask"].sum()), sum(bounds) - bounds[-1])


def touch_tokens(rec):
    return int(rec["input_ids"].sum())


def as_arrays(rec):
    return np.array(rec["input_ids"]), np.array(rec["loss_mask"]), np.array(rec["seq_boundaries"][:-1])
