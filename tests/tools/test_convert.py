"""convert-packed: every conversion is lossless on what the consumer reads, checked element
for element; shard -> Parquet -> shard is byte-identical; refusals name the file and pack."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as UpstreamBuilder

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import (FormatError, InvariantError, ShardError, ShardExistsError,
                                     ShardNotFoundError)
from megatron_sft_idx.gate import check
from megatron_sft_idx.tools import convert_to_shard
from megatron_sft_idx.tools.convert import ConvertOptions, convert, detect_source
from megatron_sft_idx.tools.convert_cli import main as convert_main
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUFFIXES = (".bin", ".idx", ".loss.bin", ".seq.bin", ".seq.idx")


def _assert_packs(prefix, packs):
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == len(packs)
    for i, (ids, loss, starts) in enumerate(packs):
        p = ds[i]
        np.testing.assert_array_equal(p.input_ids, ids)
        np.testing.assert_array_equal(p.loss_mask, loss)
        np.testing.assert_array_equal(p.seq_start_id, starts)


def _bridge_npy(path, packs):
    """Bridge's legacy file: np.save of an object array of dicts of Python lists."""
    records = [{"input_ids": ids.tolist(), "loss_mask": [bool(v) for v in loss], "seq_start_id": starts.tolist()}
               for ids, loss, starts in packs]
    np.save(path, np.array(records), allow_pickle=True)


def _bridge_parquet(path, packs, row_group_size=500):
    """As Bridge's write_packed_parquet builds it: lists of Python ints (inferred int64) for input_ids and
    seq_start_id, list<int8> for loss_mask."""
    table = pa.table({"input_ids": [p[0].tolist() for p in packs],
                      "loss_mask": pa.array([[int(v) for v in p[1]] for p in packs], type=pa.list_(pa.int8())),
                      "seq_start_id": [p[2].tolist() for p in packs]})
    pq.write_table(table, path, row_group_size=row_group_size)


def _parquet_rows(path):
    table = pq.read_table(path)
    return [tuple(np.asarray(table.column(c)[i].as_py()) for c in ("input_ids", "loss_mask", "seq_start_id"))
            for i in range(table.num_rows)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 60), seed=st.integers(0, 2**16), big=st.booleans(), rows=st.integers(1, 40))
def test_shard_to_parquet_and_back_is_byte_identical(tmp_path_factory, n, seed, big, rows):
    tmp = tmp_path_factory.mktemp("rt")
    packs = random_packs(np.random.default_rng(seed), n, vocab=100_000 if big else 1000)
    write_shard(tmp / "s", packs, vocab_size=100_000 if big else 1000, metadata={"tokenizer": {"name": "t"}})
    convert(str(tmp / "s"), str(tmp / "s.parquet"), options=ConvertOptions(row_group_size=rows))
    pf = pq.ParquetFile(tmp / "s.parquet")
    assert str(pf.schema_arrow.field("input_ids").type) == "list<element: int32>"
    assert str(pf.schema_arrow.field("loss_mask").type) == "list<element: int8>"
    assert pf.metadata.num_row_groups == -(-n // rows)
    for got, want in zip(_parquet_rows(tmp / "s.parquet"), packs):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    convert(str(tmp / "s.parquet"), str(tmp / "back"))
    for suffix in SUFFIXES:
        with open(str(tmp / "s") + suffix, "rb") as a, open(str(tmp / "back") + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


def test_bridge_reader_reads_our_parquet(tmp_path, rng):
    """Our Parquet through a reader written the way Bridge's GPTSFTPackedParquetDataset reads."""
    from bench.peers.parquet import PackedParquetDataset

    packs = random_packs(rng, 1234)
    write_shard(tmp_path / "s", packs)
    convert(str(tmp_path / "s"), str(tmp_path / "p.parquet"))
    ds = PackedParquetDataset(tmp_path / "p.parquet")
    assert len(ds) == len(packs)
    for i in (0, 499, 500, 1233):
        rec = ds[i]
        assert rec["input_ids"] == packs[i][0].tolist() and rec["loss_mask"] == packs[i][1].tolist()
        assert rec["seq_boundaries"] == packs[i][2].tolist() + [len(packs[i][0])]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 50), seed=st.integers(0, 2**16), mult=st.sampled_from([1, 2, 4]))
def test_bridge_npy_and_parquet_to_shard_element_for_element(tmp_path_factory, n, seed, mult):
    tmp = tmp_path_factory.mktemp("b")
    packs = random_packs(np.random.default_rng(seed), n, pad_mult=mult)
    _bridge_npy(str(tmp / "p.npy"), packs)
    _bridge_parquet(str(tmp / "p.parquet"), packs, row_group_size=7)
    # shardgen pads each sequence to a multiple (Megatron-LM's stored layout); Bridge's default is runtime
    opts = ConvertOptions(pack_size=64, pad_seq_to_mult=mult, vocab_size=1000, pad_layout="stored")
    for name in ("p.npy", "p.parquet"):
        out = str(tmp / ("out_" + name.split(".")[1]))
        result = convert(str(tmp / name), out, options=opts)
        _assert_packs(out, packs)
        m = result.metadata
        assert m.pack_size == 64 and m.pad_seq_to_mult == mult and m.vocab_size == 1000 and m.pad_layout == "stored"
        assert m.source["converted_from"]["format"] == name.split(".")[1]
    # and back to Parquet: what Bridge wrote is what it reads again
    convert(str(tmp / "out_parquet"), str(tmp / "again.parquet"))
    for got, want in zip(_parquet_rows(tmp / "again.parquet"), packs):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_parquet_directory_in_file_order_and_pack_size_note(tmp_path, rng):
    packs = random_packs(rng, 30)
    (tmp_path / "d").mkdir()
    _bridge_parquet(str(tmp_path / "d" / "part-000.parquet"), packs[:12])
    _bridge_parquet(str(tmp_path / "d" / "part-001.parquet"), packs[12:])
    with pytest.raises(FormatError, match="pack size is needed"):
        convert(str(tmp_path / "d"), str(tmp_path / "s"))
    convert(str(tmp_path / "d"), str(tmp_path / "s"), options=ConvertOptions(pack_size=64))
    _assert_packs(tmp_path / "s", packs)
    result = convert(str(tmp_path / "d" / "part-001.parquet"), str(tmp_path / "one"))
    assert result.metadata.pack_size == max(len(p[0]) for p in packs[12:])
    assert any("--pack-size" in n for n in result.notes)


def test_a_pack_breaking_an_invariant_is_named_by_file_and_pack(tmp_path, rng):
    packs = random_packs(rng, 5)
    _bridge_npy(str(tmp_path / "p.npy"), packs)
    with pytest.raises(InvariantError) as info:  # the pack size is a rule of the shard
        convert(str(tmp_path / "p.npy"), str(tmp_path / "s"), options=ConvertOptions(pack_size=2))
    assert info.value.rule == "PACK_TOO_LONG" and info.value.path.endswith("p.npy")
    assert not os.path.exists(tmp_path / "s.idx")


def test_malicious_npy_is_refused_without_running_it(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(tmp_path / "evil.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": (1,)})
        pickle.dump(np.array([Evil()], dtype=object), f, protocol=3)
    assert convert_main([str(tmp_path / "evil.npy"), str(tmp_path / "s")]) == 1
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "s.idx").exists()


# --------------------------------------------------------------------------- Option A


def _option_a(directory, packs, pack_size=64):
    from bench.peers.option_a import PaddedMemmapWriter

    w = PaddedMemmapWriter(directory, len(packs), pack_size, sum(len(p[2]) for p in packs))
    for i, (ids, loss, starts) in enumerate(packs):
        w.write_bin(i, ids, loss, starts)
    w.finalize()


def test_option_a_directory_to_shard(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(convert_to_shard, "CHUNK_TOKENS", 200)  # several runs of bins
    packs = random_packs(rng, 40)
    _option_a(tmp_path / "oa", packs)
    assert detect_source(str(tmp_path / "oa")) == "option-a"
    result = convert(str(tmp_path / "oa"), str(tmp_path / "s"))
    _assert_packs(tmp_path / "s", packs)
    assert result.metadata.pack_size == 64 and check(str(tmp_path / "s")).passed


def test_option_a_refusals(tmp_path, rng):
    packs = random_packs(rng, 4)
    _option_a(tmp_path / "oa", packs)
    lengths = np.load(tmp_path / "oa" / "packed_len.npy", mmap_mode="r+")
    lengths[2] = 65
    lengths.flush()
    del lengths
    with pytest.raises(InvariantError) as info:
        convert(str(tmp_path / "oa"), str(tmp_path / "s"))
    assert info.value.pack == 2 and info.value.rule == "PACK_TOO_LONG"
    (tmp_path / "oa" / "manifest.json").write_text(json.dumps({"format": "something_else"}))
    with pytest.raises(FormatError, match="Option A"):
        convert(str(tmp_path / "oa"), str(tmp_path / "s"))


# --------------------------------------------------------------------------- upstream pretrain


def _pretrain(prefix, documents, dtype=np.uint16):
    """Written by the real megatron-core builder; a document may span several sequences."""
    b = UpstreamBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        for part in doc:
            b.add_item(torch.tensor(part, dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")


def _random_documents(rng, n, longest=100):
    docs = []
    for _ in range(n):
        parts = [rng.integers(0, 5000, int(rng.integers(1, longest // 2))).tolist()
                 for _ in range(int(rng.integers(1, 3)))]
        docs.append(parts)
    return docs


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 80), seed=st.integers(0, 2**16),
       algorithm=st.sampled_from(["first_fit_decreasing", "first_fit_shuffle", "best_fit_decreasing"]))
def test_pretrain_documents_become_label_aligned_sequences(tmp_path_factory, n, seed, algorithm):
    tmp = tmp_path_factory.mktemp("pt")
    docs = _random_documents(np.random.default_rng(seed), n)
    _pretrain(str(tmp / "pt"), docs)
    assert detect_source(str(tmp / "pt")) == "pretrain"
    result = convert(str(tmp / "pt"), str(tmp / "s"), options=ConvertOptions(pack_size=128, algorithm=algorithm))
    ds = MMapIndexedDataset(tmp / "s")
    seen = []
    for i in range(len(ds)):
        p = ds[i]
        assert p.packed_len <= 128
        bounds = p.seq_boundaries
        for k in range(len(bounds) - 1):
            seq, loss = p.input_ids[bounds[k]:bounds[k + 1]], p.loss_mask[bounds[k]:bounds[k + 1]]
            assert loss[-1] == 0 and loss[:-1].all()  # loss on every token, label-aligned
            seen.append(tuple(seq.tolist()))
    assert sorted(seen) == sorted(tuple(sum(d, [])) for d in docs)  # each document exactly once
    assert result.metadata.packing["algorithm"] == algorithm and result.metadata.token_dtype == "uint16"
    assert check(str(tmp / "s")).passed


def test_pretrain_overlong_documents(tmp_path):
    docs = [[[1] * 30], [[2] * 200], [[3] * 10, [4] * 5]]
    _pretrain(str(tmp_path / "pt"), docs, dtype=np.int32)
    with pytest.raises(InvariantError, match="document 1 has 200 tokens"):
        convert(str(tmp_path / "pt"), str(tmp_path / "s"), options=ConvertOptions(pack_size=64))
    r = convert(str(tmp_path / "pt"), str(tmp_path / "t"), options=ConvertOptions(pack_size=64, overlong="truncate"))
    assert r.details["truncated"] == 1 and r.metadata.stats.token_count == 30 + 64 + 15
    assert r.metadata.token_dtype == "int32"
    r = convert(str(tmp_path / "pt"), str(tmp_path / "d"), options=ConvertOptions(pack_size=64, overlong="drop"))
    assert r.details["overlong_dropped"] == 1 and r.metadata.stats.sequence_count == 2


# --------------------------------------------------------------------------- refusals and CLI


def test_refusals(tmp_path, rng):
    packs = random_packs(rng, 3)
    write_shard(tmp_path / "s", packs)
    _bridge_npy(str(tmp_path / "p.npy"), packs)
    with pytest.raises(FormatError, match="already a shard"):
        convert(str(tmp_path / "s"), str(tmp_path / "t"))
    with pytest.raises(FormatError, match="converts shards"):
        convert(str(tmp_path / "p.npy"), str(tmp_path / "x.parquet"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FormatError, match="not a packed format"):
        convert(str(tmp_path / "notes.txt"), str(tmp_path / "t"))
    with pytest.raises(ShardNotFoundError):
        convert(str(tmp_path / "nothing.npy"), str(tmp_path / "t"))
    convert(str(tmp_path / "p.npy"), str(tmp_path / "t"))
    with pytest.raises(ShardExistsError):
        convert(str(tmp_path / "p.npy"), str(tmp_path / "t"))
    convert(str(tmp_path / "p.npy"), str(tmp_path / "t"), options=ConvertOptions(overwrite=True))
    _pretrain(str(tmp_path / "pt"), [[[1, 2, 3]]])
    with pytest.raises(FormatError, match="pretrain"):
        convert(str(tmp_path / "pt"), str(tmp_path / "pt.parquet"), source_format="shard")


def test_cli(tmp_path, rng, capsys):
    packs = random_packs(rng, 20)
    write_shard(tmp_path / "s", packs)
    meta = tmp_path / "pack_meta.json"
    assert convert_main([str(tmp_path / "s"), str(tmp_path / "s.parquet"), "--pack-metadata", str(meta)]) == 0
    assert "converted shard(s)" in capsys.readouterr().out
    record = json.loads(meta.read_text())[0]
    stats = MMapIndexedDataset(tmp_path / "s").metadata.stats
    assert record["max_samples_per_bin"] == stats.max_samples_per_bin
    # Bridge's units: its packer bins on length - 1 (checked against Bridge's own file in tests/compat)
    assert record["dataset_max_seqlen"] == stats.dataset_max_seqlen - 1 and record["pack_size"] == 64
    assert record["min_packed_seqlen"] == stats.min_packed_runtime_len
    assert convert_main([str(tmp_path / "s.parquet"), str(tmp_path / "b"), "--json", "--check"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["packs"] == 20 and doc["gate_passed"] is True
    _pretrain(str(tmp_path / "pt"), [[[1, 2, 3]]])
    assert convert_main([str(tmp_path / "pt"), str(tmp_path / "q")]) == 2          # needs --pack-size
    assert convert_main([str(tmp_path / "pt"), str(tmp_path / "q"), "--pack-size", "8"]) == 0
    assert convert_main([str(tmp_path / "missing.npy"), str(tmp_path / "q2")]) == 2
    assert convert_main([str(tmp_path / "s.parquet"), str(tmp_path / "b")]) == 2     # exists
    assert convert_main([str(tmp_path / "s"), str(tmp_path / "t")]) == 1             # shard -> shard
    assert convert_main([str(tmp_path / "s"), str(tmp_path / "t.idx")]) == 2
    assert convert_main([str(tmp_path / "s"), str(tmp_path / "t"), "--pack-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "already a shard" in err


@pytest.mark.subprocess
def test_the_script_runs_without_installation(tmp_path, rng):
    write_shard(tmp_path / "s", random_packs(rng, 3))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_packed.py"), str(tmp_path / "s"),
                           str(tmp_path / "s.parquet")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "s.parquet" in proc.stdout, proc.stderr


def test_bridge_quirks_are_normalised_by_the_factory(tmp_path):
    """Bridge stores loss 1 on positions no consumer reads (each sequence's last) and pads for the
    runtime layout; the factory sets those to 0 and records the layout. Every other stored loss
    value is kept (EOS inputs included: Bridge main trains them, 0.6 does not), and the shard
    records that and the EOS id."""
    ids = np.arange(1, 11)
    loss = np.ones(10, dtype=np.uint8)  # loss on every position, the sequences' last ones included
    starts = np.array([0, 5])           # lengths 5 and 5: runtime layout, multiple 2 ((5 - 1) % 2 == 0)
    _bridge_npy(str(tmp_path / "b.npy"), [(ids, loss, starts)])
    result = convert(str(tmp_path / "b.npy"), str(tmp_path / "s"), options=ConvertOptions(pad_seq_to_mult=2, eos_id=7))
    assert result.metadata.pad_layout == "runtime" and result.metadata.pad_seq_to_mult == 2
    expected = np.ones(10, dtype=np.uint8)
    expected[[4, 9]] = 0                # the last position of each sequence (no consumer reads it)
    np.testing.assert_array_equal(MMapIndexedDataset(tmp_path / "s")[0].loss_mask, expected)  # EOS (7) kept
    record = result.metadata.source["converted_from"]
    assert record["loss_mask"] == "as_written" and record["bridge_eos_id"] == 7
    assert record["consumer_loss_rules"]["megatron-bridge-0.6"] == "stored mask, 0 at EOS inputs"
    # 0.6's rule baked in on read, for a reader that asks for it
    from megatron_sft_idx.open import open_packed

    expected[ids == 7] = 0
    np.testing.assert_array_equal(open_packed(str(tmp_path / "b.npy"), pad_seq_to_mult=2, eos_id=7)[0].loss_mask,
                                  expected)
