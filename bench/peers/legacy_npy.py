"""Megatron-Bridge's legacy packed format: a pickled list of dicts in one ``.npy``.

Written as Nemotron's ``LegacyPickleWriter`` does (every pack's arrays become Python
lists in one big list, then ``np.save(..., allow_pickle=True)``) and read as
``GPTSFTPackedDataset._load_dataset`` does: a full ``np.load(..., allow_pickle=True)``
at open. Unpickling is allowed here only because measuring this peer is the point;
the project itself never loads pickles.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

NAME = "legacy_npy"
LABEL = "legacy .npy pickled list of dicts"
TOUCHES = (0, 1, 2, 3)


def _path(out_dir) -> Path:
    return Path(out_dir) / "packed.npy"


def write(corpus, out_dir) -> dict:
    path = _path(out_dir)
    t0 = time.perf_counter()
    packed_data = []
    for ids, loss, starts in corpus.iter_packs():
        packed_data.append({"input_ids": ids.tolist(), "loss_mask": loss.tolist(),
                            "seq_start_id": starts.tolist()})
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, packed_data, allow_pickle=True)
    os.replace(tmp, path)
    return {"write_s": time.perf_counter() - t0}


def files(out_dir):
    return [_path(out_dir)]


def open_reader(out_dir):
    return np.load(_path(out_dir), allow_pickle=True)  # the peer's own full load


def touch(rec):
    ids = rec["input_ids"]
    return (len(ids), sum(ids), sum(rec["loss_mask"]), sum(rec["seq_start_id"]))


def touch_tokens(rec):
    return sum(rec["input_ids"])


def as_arrays(rec):
    return np.array(rec["input_ids"]), np.array(rec["loss_mask"]), np.array(rec["seq_start_id"])
