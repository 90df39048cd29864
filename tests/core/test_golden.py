"""The committed golden shards pin the bytes: old versions stay readable, the current one is rebuilt identically."""

import importlib.util
import json
import os
import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.format import ALL_SUFFIXES, METADATA_OFFSET, SeqIdxHeader

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: golden/ lives there
GOLDEN = os.path.join(HERE, "golden", "v1_1", "tiny")  # the current version
GOLDEN_V1_0 = os.path.join(HERE, "golden", "v1_0", "tiny")
GOLDEN_V1_2 = os.path.join(HERE, "golden", "v1_2", "tiny")  # the same packs, recording their sources


def _load_maker():
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(HERE, "golden", "make_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_golden = _load_maker()


def read(path):
    with open(path, "rb") as f:
        return f.read()


def split_seq_idx(raw):
    """(header, metadata dict, CSR bytes) of a ``.seq.idx``."""
    h = SeqIdxHeader.parse(raw, "seq.idx", len(raw))
    meta = json.loads(raw[METADATA_OFFSET:METADATA_OFFSET + h.metadata_length])
    padding = raw[METADATA_OFFSET + h.metadata_length:h.csr_offset]
    assert padding == b"\0" * len(padding)
    return h, meta, raw[h.csr_offset:]


def test_golden_files_are_committed():
    for suffix in ALL_SUFFIXES:
        assert os.path.isfile(GOLDEN + suffix), f"missing golden file {GOLDEN + suffix}"


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V1_0, GOLDEN_V1_2], ids=["v1_1", "v1_0", "v1_2"])
def test_reader_reads_the_golden_packs(golden):
    ds = MMapIndexedDataset(golden, check_packs=True)
    assert len(ds) == len(make_golden.PACKS) and ds.dtype.name == "uint16"
    for i, (ids, loss, starts) in enumerate(make_golden.PACKS):
        pack = ds[i]
        assert pack.input_ids.dtype == np.uint16
        assert pack.input_ids.tolist() == ids
        assert pack.loss_mask.tolist() == loss
        assert pack.seq_start_id.tolist() == starts
    m = ds.metadata
    assert (m.pack_size, m.vocab_size, m.token_dtype, m.pad_seq_to_mult) == (8, 32, "uint16", 1)
    assert m.tokenizer == {"name": "golden"} and m.loss_mask_convention == "label_aligned"
    s = m.stats
    assert (s.pack_count, s.sequence_count, s.token_count, s.loss_token_count) == (3, 6, 16, 9)
    assert (s.max_samples_per_bin, s.dataset_max_seqlen, s.min_seqlen) == (3, 4, 1)
    assert (s.min_packed_seqlen, s.max_packed_seqlen) == (3, 8)
    assert s.packing_factor == 2.0 and s.packing_efficiency == pytest.approx(16 / 24, abs=1e-6)
    assert m.pad_layout == "stored"  # 1.0 has no pad_layout: the stored layout
    # New in 1.1 (Megatron-Bridge's min_packed_seqlen); a 1.0 shard does not record it.
    assert s.min_packed_runtime_len == (None if golden == GOLDEN_V1_0 else 2)  # pack 1: 3 - 1 = 5 - 3
    assert ds.seq_header.version_minor == {GOLDEN_V1_0: 0, GOLDEN: 1, GOLDEN_V1_2: 2}[golden]
    if golden == GOLDEN_V1_2:   # 1.2: each sequence's source
        assert ds.sources == ("chat", "math") and ds.seq_header.flags == 1
        assert [ds.source_ids(i).tolist() for i in range(len(ds))] == make_golden.SOURCE_IDS
        assert [(s.name, s.sequences, s.extra) for s in m.sources] == [("chat", 3, {"store_id": "0" * 32}),
                                                                      ("math", 3, {"store_id": "f" * 32})]
    else:
        assert ds.sources is None and m.sources is None and ds.seq_header.flags == 0
        with pytest.raises(ShardError, match="records no sources"):
            ds.source_ids(0)


def test_the_gate_passes_every_golden_version():
    from megatron_sft_idx.gate import check

    report = check([GOLDEN, GOLDEN_V1_0, GOLDEN_V1_2], level="deep")
    assert report.passed, report.format_text()
    assert "sources" in report.shards[2].checks


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V1_0, GOLDEN_V1_2], ids=["v1_1", "v1_0", "v1_2"])
def test_recorded_checksums_match_the_committed_files(golden):
    m = MMapIndexedDataset(golden).metadata
    for suffix, digest in m.files.items():
        raw = read(golden + suffix)
        assert (len(raw), zlib.crc32(raw)) == (digest.size, digest.crc32), suffix
    raw = read(golden + ".seq.idx")
    h = SeqIdxHeader.parse(raw, "seq.idx", len(raw))
    assert h.body_crc32 == zlib.crc32(raw[METADATA_OFFSET:])


@pytest.mark.parametrize("sources", [False, True], ids=["v1_1", "v1_2"])
@pytest.mark.parametrize("producer_version", [None, "99.100.101.dev5+gabcdef0123456789abcdef"])
def test_building_the_same_packs_today_gives_the_same_bytes(tmp_path, monkeypatch, producer_version, sources):
    if producer_version is not None:  # a later release: the metadata grows, the CSR moves
        from megatron_sft_idx import builder

        monkeypatch.setattr(builder, "__version__", producer_version)
    prefix = str(tmp_path / "tiny")
    golden = GOLDEN_V1_2 if sources else GOLDEN
    make_golden.build(prefix, sources=sources)
    for suffix in (".bin", ".idx", ".loss.bin", ".seq.bin"):
        assert read(prefix + suffix) == read(golden + suffix), suffix
    new_h, new_meta, new_csr = split_seq_idx(read(prefix + ".seq.idx"))
    old_h, old_meta, old_csr = split_seq_idx(read(golden + ".seq.idx"))
    # Only the producer version may differ, and with it the lengths/CRCs that cover it.
    varying = {"metadata_length", "csr_offset", "body_crc32"}
    for field in SeqIdxHeader.__dataclass_fields__:
        if field not in varying:
            assert getattr(new_h, field) == getattr(old_h, field), field
    assert new_meta.pop("producer")["name"] == old_meta.pop("producer")["name"] == "megatron_sft_idx"
    assert new_meta == old_meta
    assert new_csr == old_csr


def test_pinned_bytes():
    idx = read(GOLDEN + ".idx")
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<QBQQ", idx, 9) == (1, 8, 3, 4)  # version, uint16, packs, packs + 1
    assert np.frombuffer(idx, "<i4", 3, 34).tolist() == [8, 3, 5]
    assert np.frombuffer(idx, "<i8", 3, 46).tolist() == [0, 16, 22]
    assert np.frombuffer(idx, "<i8", 4, 70).tolist() == [0, 1, 2, 3]
    assert len(idx) == 102

    seq_idx = read(GOLDEN + ".seq.idx")
    assert seq_idx[:8] == b"MSFTSEQ\x00"
    assert struct.unpack_from("<HHBBBB", seq_idx, 8) == (1, 1, 8, 4, 1, 0)
    assert struct.unpack_from("<QQQ", seq_idx, 16) == (3, 6, 16)
    mlen, csr = struct.unpack_from("<QQ", seq_idx, 40)
    assert csr % 64 == 0 and csr == (64 + mlen + 63) // 64 * 64
    assert struct.unpack_from("<I", seq_idx, 60)[0] == zlib.crc32(seq_idx[:60])
    assert np.frombuffer(seq_idx, "<i8", 4, csr).tolist() == [0, 2, 3, 6]

    assert read(GOLDEN + ".bin") == np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 31, 0, 5, 5, 12], "<u2").tobytes()
    assert read(GOLDEN + ".loss.bin") == bytes([0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 0])
    assert read(GOLDEN + ".seq.bin") == np.array([0, 4, 0, 0, 1, 2], "<i4").tobytes()


def test_pinned_bytes_of_the_sources():
    """1.2: the flag, the minor version, and the source ids 64-byte aligned after the offsets."""
    seq_idx = read(GOLDEN_V1_2 + ".seq.idx")
    assert struct.unpack_from("<HHBBBB", seq_idx, 8) == (1, 2, 8, 4, 1, 1)
    mlen, csr = struct.unpack_from("<QQ", seq_idx, 40)
    assert np.frombuffer(seq_idx, "<i8", 4, csr).tolist() == [0, 2, 3, 6]
    src = (csr + 32 + 63) // 64 * 64
    assert seq_idx[csr + 32:src] == b"\0" * (src - csr - 32)
    assert np.frombuffer(seq_idx, "<u2", 6, src).tolist() == [0, 1, 1, 0, 0, 1]
    assert len(seq_idx) == src + 12
    for suffix in (".bin", ".idx", ".loss.bin", ".seq.bin"):   # the sources change nothing else
        assert read(GOLDEN_V1_2 + suffix) == read(GOLDEN + suffix), suffix


def test_make_golden_cli_writes_a_shard(tmp_path):
    prefix = str(tmp_path / "g")
    assert make_golden.main(["--prefix", prefix]) == 0
    assert read(prefix + ".bin") == read(GOLDEN + ".bin")
