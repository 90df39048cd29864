"""open_packed: our shards, legacy Bridge .npy (restricted unpickler) and packed Parquet agree."""

import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import InvariantError, ShardError, ShardNotFoundError
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.training.bridge import PackedSFTDataset
from megatron_sft_idx.legacy import load_legacy_npy
from megatron_sft_idx.multi import MultiShardDataset
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.packed import FlatPackedSource, summarize

PACK = 64


@pytest.fixture(scope="module")
def same_data(tmp_path_factory):
    """One set of packs written as our shard, as Bridge's legacy .npy and as Parquet."""
    root = tmp_path_factory.mktemp("formats")
    packs = random_packs(np.random.default_rng(5), 30, pack_size=PACK)
    shard = str(root / "shard")
    write_shard(shard, packs)
    # Bridge's legacy file: np.save of an object array of dicts of Python lists.
    records = [{"input_ids": ids.tolist(), "loss_mask": [bool(v) for v in loss],
                "seq_start_id": starts.tolist()} for ids, loss, starts in packs]
    npy = str(root / "packed.npy")
    np.save(npy, np.array(records), allow_pickle=True)
    table = pa.table({
        "input_ids": pa.array([p[0].tolist() for p in packs], pa.list_(pa.int32())),
        "loss_mask": pa.array([p[1].tolist() for p in packs], pa.list_(pa.int8())),
        "seq_start_id": pa.array([p[2].tolist() for p in packs], pa.list_(pa.int32())),
    })
    parquet = str(root / "packed.parquet")
    pq.write_table(table, parquet, row_group_size=7)
    pdir = root / "pq_dir"
    pdir.mkdir()
    pq.write_table(table.slice(0, 12), str(pdir / "part-000.parquet"))
    pq.write_table(table.slice(12), str(pdir / "part-001.parquet"))
    return {"packs": packs, "shard": shard, "npy": npy, "parquet": parquet, "pq_dir": str(pdir),
            "pq_glob": str(pdir / "part-*.parquet"), "root": root}


def test_open_packed_recognises_each_format(same_data):
    assert isinstance(open_packed(same_data["shard"]), MMapIndexedDataset)
    for key in ("npy", "parquet", "pq_dir", "pq_glob"):
        src = open_packed(same_data[key])
        assert isinstance(src, FlatPackedSource) and len(src) == 30, key
    assert isinstance(open_packed([same_data["shard"]]), MultiShardDataset)


@pytest.mark.parametrize("fmt", ["npy", "parquet", "pq_dir", "pq_glob"])
def test_batches_identical_element_for_element(same_data, fmt):
    ours = PackedSFTDataset(same_data["shard"], max_num_samples=45, pad_to_max_length=True,
                            pad_cu_seqlens=True, pad_id=3)
    other = PackedSFTDataset(same_data[fmt], max_num_samples=45, max_seq_length=PACK,
                             pad_to_max_length=True, pad_cu_seqlens=True, pad_id=3)
    assert summarize(other.source).max_samples_per_bin == ours.summary.max_samples_per_bin
    for i in range(len(ours.source)):
        a, b = ours.source[i], other.source[i]
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    for start in range(0, 44, 4):
        idx = list(range(start, start + 4)) + [-1]
        a = ours.collate_fn([ours[i] for i in idx])
        b = other.collate_fn([other[i] for i in idx])
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


def test_megatron_samples_identical_across_formats(same_data):
    pytest.importorskip("megatron.core")
    from megatron_sft_idx.training.megatron import _layout_pack

    ours, npy, parquet = (open_packed(same_data[k]) for k in ("shard", "npy", "parquet"))
    for i in range(len(ours)):
        samples = [_layout_pack(src[i], PACK, 0, None) for src in (ours, npy, parquet)]
        for key in samples[0]:
            assert torch.equal(samples[0][key], samples[1][key]) and torch.equal(samples[0][key], samples[2][key])


# --------------------------------------------------------------------------- restricted unpickler


def _write_object_npy(path, payload: bytes, shape=(1,)):
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": shape})
        f.write(payload)


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_restricted_unpickler_refuses_code_execution(tmp_path):
    marker = tmp_path / "pwned"
    path = str(tmp_path / "evil.npy")
    _write_object_npy(path, pickle.dumps(np.array([_Evil(f"touch {marker}")], dtype=object), protocol=3))
    with pytest.raises(ShardError, match="refusing to load global") as info:
        open_packed(path)
    assert not marker.exists()
    assert info.value.field == "pickle" and "system" in str(info.value.actual)
    # Same through np.save's own writer, and with builtins.eval.
    path2 = str(tmp_path / "evil2.npy")
    np.save(path2, np.array([{"input_ids": [1], "loss_mask": [0], "seq_start_id": [0], "x": _Evil("true")}]),
            allow_pickle=True)
    with pytest.raises(ShardError, match="refusing to load global"):
        load_legacy_npy(path2)
    evil_eval = b"\x80\x03cbuiltins\neval\nX\x03\x00\x00\x001+1q\x00\x85q\x01Rq\x02."
    path3 = str(tmp_path / "evil3.npy")
    _write_object_npy(path3, evil_eval)
    with pytest.raises(ShardError, match="builtins.eval"):
        load_legacy_npy(path3)


@pytest.mark.parametrize("records, match", [
    ([{"input_ids": [1.5, 2.0], "loss_mask": [0, 0], "seq_start_id": [0]}], "list of ints"),
    ([{"input_ids": [1, 2], "loss_mask": [0, 0]}], "exactly the packed keys"),
    ([[1, 2, 3]], "exactly the packed keys"),
    ([{"input_ids": "ab", "loss_mask": [0, 0], "seq_start_id": [0]}], "list of ints"),
])
def test_legacy_npy_shape_is_checked(tmp_path, records, match):
    path = str(tmp_path / "x.npy")
    arr = np.empty(len(records), dtype=object)
    arr[:] = records
    np.save(path, arr, allow_pickle=True)
    with pytest.raises(ShardError, match=match):
        load_legacy_npy(path)


def test_legacy_npy_invariants_and_non_object_arrays(tmp_path):
    path = str(tmp_path / "bad.npy")
    # Bridge's prompt-template packer sets 1 on each sequence's last position, which its collate
    # never reads: normalised to 0 on read (docs/FORMAT.md); nothing else changes.
    np.save(path, np.array([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "seq_start_id": [0]}]),
            allow_pickle=True)
    assert load_legacy_npy(path)[0].loss_mask.tolist() == [0, 1, 0]
    np.save(path, np.array([{"input_ids": [1, 2, 3], "loss_mask": [0, 2, 0], "seq_start_id": [0]}]),
            allow_pickle=True)
    with pytest.raises(InvariantError, match="0 or 1") as info:
        load_legacy_npy(path)
    assert info.value.pack == 0 and info.value.rule == "LOSS_VALUE"
    np.save(str(tmp_path / "num.npy"), np.arange(4))
    with pytest.raises(ShardError, match="object array"):
        load_legacy_npy(str(tmp_path / "num.npy"))
    truncated = str(tmp_path / "cut.npy")
    with open(truncated, "wb") as f:
        np.save(f, np.array([{"input_ids": [1, 2], "loss_mask": [1, 0], "seq_start_id": [0]}]),
                allow_pickle=True)
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 10)
    with pytest.raises(ShardError, match="malformed"):
        load_legacy_npy(truncated)


def test_parquet_and_unknown_inputs(tmp_path):
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}),
                   str(tmp_path / "cols.parquet"))
    with pytest.raises(ShardError, match="cannot read packed Parquet"):
        open_packed(str(tmp_path / "cols.parquet"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ShardError, match="not a recognised packed format"):
        open_packed(str(tmp_path / "notes.txt"))
    with pytest.raises(ShardNotFoundError):
        open_packed(str(tmp_path / "nothing_here"))
