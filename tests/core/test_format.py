"""Unit tests of the layout module: codes, structs and the strict header parsers."""

import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx import format as fmt
from megatron_sft_idx.errors import (
    DTypeError,
    HeaderError,
    ShardError,
    SizeMismatchError,
    TruncatedFileError,
    VersionError,
)
from megatron_sft_idx.format import DType, IdxHeader, Rule, SeqIdxHeader


def test_dtype_codes_are_megatrons():
    assert {d.name: int(d) for d in DType} == {
        "uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
    assert DType.from_numpy(np.uint16) is DType.uint16
    assert DType.uint16.itemsize == 2 and DType.int32.numpy == np.dtype("int32")
    with pytest.raises(DTypeError, match="no Megatron dtype code"):
        DType.from_numpy(np.complex64)


def test_rule_codes_are_stable():
    assert [(r.name, int(r)) for r in Rule] == [
        ("OK", 0), ("PACK_EMPTY", 1), ("PACK_TOO_LONG", 2), ("LENGTH_MISMATCH", 3), ("LOSS_VALUE", 4),
        ("LOSS_ON_LAST", 5), ("SEQ_NONE", 6), ("SEQ_FIRST_NOT_ZERO", 7), ("SEQ_NOT_INCREASING", 8),
        ("SEQ_START_OUT_OF_RANGE", 9), ("SEQ_NOT_PAD_MULTIPLE", 10), ("TOKEN_NEGATIVE", 11),
        ("TOKEN_TOO_LARGE", 12), ("TOKEN_OUT_OF_VOCAB", 13)]
    assert all(r.describe for r in Rule)


def test_choose_token_dtype():
    assert fmt.choose_token_dtype(65535) is DType.uint16
    assert fmt.choose_token_dtype(65536) is DType.int32
    assert fmt.choose_token_dtype(None) is DType.int32


def test_suffixes_and_publish_order():
    paths = fmt.ShardPaths.from_prefix("/d/x")
    assert paths == ("/d/x.bin", "/d/x.idx", "/d/x.loss.bin", "/d/x.seq.idx", "/d/x.seq.bin")
    assert fmt.PUBLISH_ORDER[-1] == fmt.IDX_SUFFIX
    assert sorted(fmt.PUBLISH_ORDER) == sorted(fmt.ALL_SUFFIXES)


def test_struct_sizes_match_the_documented_layout():
    assert fmt.IDX_HEADER.size == 34
    assert fmt.SEQ_IDX_HEADER.size == 64 and fmt.METADATA_OFFSET == 64
    assert fmt.align(0) == 0 and fmt.align(1) == 64 and fmt.align(64) == 64 and fmt.align(65) == 128


# ----------------------------------------------------------------------------- .idx header


def idx_bytes(n=3, code=8, magic=fmt.IDX_MAGIC, version=1, ndoc=None):
    ndoc = n + 1 if ndoc is None else ndoc
    return struct.pack("<9sQBQQ", magic, version, code, n, ndoc)


def test_idx_header_round_trip():
    h = IdxHeader(8, 3, 4)
    raw = h.pack()
    assert raw == idx_bytes() and raw[:9] == b"MMIDIDX\x00\x00"
    assert h.file_size == 34 + 12 * 3 + 8 * 4
    assert h.pointers_offset == 34 + 12 and h.document_indices_offset == 34 + 36
    assert IdxHeader.parse(raw, "p.idx", h.file_size) == h


@pytest.mark.parametrize("raw, size, err, match", [
    (idx_bytes()[:20], 20, TruncatedFileError, "shorter than the MMIDIDX header"),
    (idx_bytes(magic=b"MMIDIDY\x00\x00"), 102, HeaderError, "bad magic"),
    (idx_bytes(version=2), 102, VersionError, r"unsupported MMIDIDX version 2; supported: \(1,\)"),
    (idx_bytes(code=7), 102, DTypeError, "token dtype code 7"),
    (idx_bytes(code=99), 102, DTypeError, "token dtype code 99"),
    (idx_bytes(), 101, TruncatedFileError, "index size disagrees"),
    (idx_bytes(), 103, SizeMismatchError, "index size disagrees"),
    (idx_bytes(n=2 ** 62), 102, SizeMismatchError, "index size disagrees"),
])
def test_idx_header_refusals(raw, size, err, match):
    with pytest.raises(err, match=match) as info:
        IdxHeader.parse(raw, "/x/p.idx", size)
    assert "/x/p.idx" in str(info.value)


# ----------------------------------------------------------------------------- .seq.idx header


def seq_header(**kw):
    base = dict(token_dtype_code=8, pack_count=2, sequence_count=3, token_count=10, metadata_length=5)
    base.update(kw)
    return SeqIdxHeader(**base)


def reheader(raw, fmt_char, offset, value):
    """Patch one field and recompute the header CRC (to reach the checks after the CRC)."""
    b = bytearray(raw)
    struct.pack_into("<" + fmt_char, b, offset, value)
    struct.pack_into("<I", b, 60, zlib.crc32(bytes(b[:60])))
    return bytes(b)


def test_seq_idx_header_round_trip():
    h = seq_header(body_crc32=123)
    raw = h.pack()
    assert len(raw) == 64 and raw[:8] == b"MSFTSEQ\x00"
    assert struct.unpack_from("<HH", raw, 8) == fmt.SEQ_IDX_VERSION
    assert h.csr_offset == 128 and h.file_size == 128 + 8 * 3
    assert struct.unpack_from("<I", raw, 60)[0] == zlib.crc32(raw[:60])
    assert SeqIdxHeader.parse(raw, "p", h.file_size) == h


GOOD = seq_header().pack()
SIZE = seq_header().file_size


@pytest.mark.parametrize("raw, size, err, match", [
    (GOOD[:63], SIZE, TruncatedFileError, "shorter than the .seq.idx header"),
    (b"XSFTSEQ\x00" + GOOD[8:], SIZE, HeaderError, "bad magic"),
    (reheader(GOOD, "H", 8, 2), SIZE, VersionError, r"major version 2\.\d+; supported majors: \(1,\)"),
    (GOOD[:20] + b"\xff" + GOOD[21:], SIZE, HeaderError, "header CRC-32 mismatch"),
    (reheader(GOOD, "B", 12, 1), SIZE, DTypeError, "token dtype code 1"),
    (reheader(GOOD, "B", 12, 77), SIZE, DTypeError, "token dtype code 77"),
    (reheader(GOOD, "B", 13, 8), SIZE, DTypeError, "seq_start_id dtype code"),
    (reheader(GOOD, "B", 14, 4), SIZE, DTypeError, "loss mask dtype code"),
    (reheader(GOOD, "B", 15, 2), SIZE, HeaderError, "reserved flags"),
    (reheader(GOOD, "B", 15, 0x81), SIZE, HeaderError, "reserved flags"),
    (reheader(GOOD, "B", 15, 1), SIZE, HeaderError, r"sources flag needs version 1\.2"),   # (GOOD is 1.1)
    (reheader(GOOD, "Q", 40, 1 << 40), SIZE, HeaderError, "metadata length is implausible"),
    (reheader(GOOD, "Q", 48, 64), SIZE, HeaderError, "CSR offset"),
    (reheader(GOOD, "Q", 16, 0), SIZE, HeaderError, "at least one pack"),
    (reheader(GOOD, "Q", 16, 1 << 40), SIZE, HeaderError, "fewer sequences than packs"),
    (reheader(reheader(reheader(GOOD, "Q", 24, 1 << 40), "Q", 32, 1 << 40), "Q", 16, 1 << 40), SIZE,
     TruncatedFileError, "pack count cannot fit"),
    (reheader(GOOD, "Q", 16, (1 << 56) + 1), SIZE, HeaderError, "pack_count exceeds the format's limit"),
    (reheader(GOOD, "Q", 24, 1 << 63), SIZE, HeaderError, "sequence_count exceeds the format's limit"),
    (reheader(GOOD, "Q", 32, (1 << 64) - 1), SIZE, HeaderError, "token_count exceeds the format's limit"),
    (reheader(GOOD, "Q", 24, 1), SIZE, HeaderError, "fewer sequences than packs"),
    (reheader(GOOD, "Q", 32, 1), SIZE, HeaderError, "fewer tokens than packs"),
    (GOOD, SIZE - 1, TruncatedFileError, "size disagrees"),
    (GOOD, SIZE + 1, SizeMismatchError, "size disagrees"),
])
def test_seq_idx_header_refusals(raw, size, err, match):
    with pytest.raises(err, match=match) as info:
        SeqIdxHeader.parse(raw, "/x/p.seq.idx", size)
    assert "/x/p.seq.idx" in str(info.value)
    assert isinstance(info.value, ShardError) and isinstance(info.value, ValueError)


def test_error_message_carries_context_and_pickles():
    import pickle

    err = VersionError("bad", path="/a.seq.idx", field="version_major", pack=3, expected=(1,), actual=7,
                       rule="R")
    text = str(err)
    for part in ("/a.seq.idx: bad", "pack=3", "field=version_major", "rule=R", "expected=(1,)", "actual=7",
                 "use a matching version"):
        assert part in text
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is VersionError and str(back) == text and back.actual == 7
