"""The reader: what it refuses at open (and how it names it), pretrain data, laziness, pickling."""

import json
import os
import pickle
import shutil
import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import (
    DTypeError,
    HeaderError,
    IncompleteShardError,
    InvariantError,
    MetadataError,
    ShardError,
    ShardNotFoundError,
    SizeMismatchError,
    TruncatedFileError,
    VersionError,
)
from megatron_sft_idx.format import (
    ALL_SUFFIXES,
    IDX_HEADER_SIZE,
    METADATA_OFFSET,
    SEQ_IDX_HEADER_SIZE,
    IdxHeader,
    SeqIdxHeader,
)
from support.shardgen import random_packs, write_shard

SFT = (".loss.bin", ".seq.idx", ".seq.bin")


@pytest.fixture
def shard(tmp_path, rng):
    prefix = str(tmp_path / "s")
    packs = random_packs(rng, 6, pack_size=32)
    write_shard(prefix, packs, pack_size=32, vocab_size=1000)
    return prefix, packs


def patch(path, offset, fmt, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<" + fmt, value))


def fix_header_crc(path):
    with open(path, "r+b") as f:
        head = f.read(60)
        f.write(struct.pack("<I", zlib.crc32(head)))


def rewrite_seq_idx(path, edit_meta):
    """Re-encode ``.seq.idx`` with edited metadata and valid CRCs (the checks behind the CRCs)."""
    raw = open(path, "rb").read()
    h = SeqIdxHeader.parse(raw, path, len(raw))
    meta = json.loads(raw[METADATA_OFFSET:METADATA_OFFSET + h.metadata_length])
    edit_meta(meta)
    mbytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    csr = raw[h.csr_offset:]
    new = SeqIdxHeader(token_dtype_code=h.token_dtype_code, pack_count=h.pack_count,
                       sequence_count=h.sequence_count, token_count=h.token_count,
                       metadata_length=len(mbytes))
    body = mbytes + b"\0" * (new.csr_offset - METADATA_OFFSET - len(mbytes)) + csr
    new = SeqIdxHeader(token_dtype_code=h.token_dtype_code, pack_count=h.pack_count,
                       sequence_count=h.sequence_count, token_count=h.token_count,
                       metadata_length=len(mbytes), body_crc32=zlib.crc32(body))
    with open(path, "wb") as f:
        f.write(new.pack() + body)


def refuses(prefix, err, match, file_suffix):
    with pytest.raises(err, match=match) as info:
        MMapIndexedDataset(prefix)
    assert info.value.path == prefix + file_suffix, str(info.value)
    assert str(info.value).startswith(prefix + file_suffix)
    return info.value


# ----------------------------------------------------------------------------- missing files


def test_no_files_at_all(tmp_path):
    with pytest.raises(ShardNotFoundError, match="no shard at this prefix") as info:
        MMapIndexedDataset(str(tmp_path / "nothing"))
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("missing", SFT)
def test_missing_sft_companion_is_never_read_as_pretrain(shard, missing):
    prefix, _ = shard
    os.unlink(prefix + missing)
    refuses(prefix, IncompleteShardError, rf"\['{missing}'\] are missing; refusing to read it as pretrain",
            missing)


def test_missing_bin(shard):
    prefix, _ = shard
    os.unlink(prefix + ".bin")
    refuses(prefix, IncompleteShardError, r"\.bin is missing", ".bin")


def test_missing_idx(shard):
    prefix, _ = shard
    os.unlink(prefix + ".idx")
    refuses(prefix, IncompleteShardError, r"\.idx is missing", ".idx")


# ----------------------------------------------------------------------------- headers


def test_wrong_idx_magic(shard):
    prefix, _ = shard
    patch(prefix + ".idx", 0, "9s", b"MMIDIDX\x00\x01")
    refuses(prefix, HeaderError, "bad magic", ".idx")


def test_wrong_seq_idx_magic(shard):
    prefix, _ = shard
    patch(prefix + ".seq.idx", 0, "8s", b"MSFTSEQ\x01")
    refuses(prefix, HeaderError, "bad magic", ".seq.idx")


def test_unknown_seq_idx_major(shard):
    prefix, _ = shard
    patch(prefix + ".seq.idx", 8, "H", 2)
    fix_header_crc(prefix + ".seq.idx")
    err = refuses(prefix, VersionError, r"major version 2\.\d+; supported majors: \(1,\)", ".seq.idx")
    assert err.actual == 2


def test_newer_seq_idx_minor_and_unknown_metadata_keys_are_accepted(shard):
    prefix, packs = shard
    rewrite_seq_idx(prefix + ".seq.idx", lambda m: m.update(future_key={"x": 1}))
    patch(prefix + ".seq.idx", 10, "H", 7)
    fix_header_crc(prefix + ".seq.idx")
    ds = MMapIndexedDataset(prefix)
    assert ds.seq_header.version_minor == 7
    np.testing.assert_array_equal(ds[2].input_ids, packs[2][0])


def test_unknown_idx_version(shard):
    prefix, _ = shard
    patch(prefix + ".idx", 9, "Q", 2)
    refuses(prefix, VersionError, r"unsupported MMIDIDX version 2; supported: \(1,\)", ".idx")


@pytest.mark.parametrize("code", [0, 6, 7, 9, 255])
def test_unknown_or_non_integer_idx_dtype(shard, code):
    prefix, _ = shard
    patch(prefix + ".idx", 17, "B", code)
    refuses(prefix, DTypeError, f"token dtype code {code}", ".idx")


def test_idx_dtype_disagreeing_with_seq_idx(shard):
    prefix, _ = shard
    patch(prefix + ".idx", 17, "B", 4)
    refuses(prefix, SizeMismatchError, "token dtype differs", ".seq.idx")


@pytest.mark.parametrize("code", [1, 5, 99])
def test_unknown_seq_idx_token_dtype(shard, code):
    prefix, _ = shard
    patch(prefix + ".seq.idx", 12, "B", code)
    fix_header_crc(prefix + ".seq.idx")
    refuses(prefix, DTypeError, f"token dtype code {code}", ".seq.idx")


def test_seq_idx_header_crc(shard):
    prefix, _ = shard
    patch(prefix + ".seq.idx", 24, "Q", 999)
    refuses(prefix, HeaderError, "header CRC-32 mismatch", ".seq.idx")


def test_garbled_metadata(shard):
    prefix, _ = shard
    patch(prefix + ".seq.idx", METADATA_OFFSET, "1s", b"\xff")
    refuses(prefix, MetadataError, "not valid UTF-8 JSON", ".seq.idx")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("stats"), "required metadata key 'stats'"),
    (lambda m: m.update(format="other"), "does not declare this format"),
    (lambda m: m.update(loss_mask_convention="token_aligned"), "unknown loss-mask convention"),
    (lambda m: m.update(token_dtype="int32"), "metadata token_dtype differs"),
    (lambda m: m["stats"].update(token_count=1), r"metadata statistics disagree"),
    (lambda m: m["files"].pop(".seq.bin"), r"size/crc32 of '\.seq\.bin' missing"),
])
def test_bad_metadata(shard, edit, match):
    prefix, _ = shard
    rewrite_seq_idx(prefix + ".seq.idx", edit)
    refuses(prefix, MetadataError, match, ".seq.idx")


@pytest.mark.parametrize("suffix", [".bin", ".loss.bin", ".seq.bin", ".idx"])
def test_size_recorded_in_metadata_disagrees(shard, suffix):
    prefix, _ = shard
    rewrite_seq_idx(prefix + ".seq.idx", lambda m: m["files"][suffix].update(size=m["files"][suffix]["size"] + 2))
    refuses(prefix, SizeMismatchError, "size recorded in the metadata", suffix)


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("suffix", ALL_SUFFIXES)
@pytest.mark.parametrize("delta", [-1, -5, 1, 64])
def test_truncated_or_extended_file(shard, suffix, delta):
    prefix, _ = shard
    path = prefix + suffix
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size + delta)
    err = TruncatedFileError if delta < 0 else SizeMismatchError
    with pytest.raises(err) as info:
        MMapIndexedDataset(prefix)
    assert info.value.path.startswith(prefix), str(info.value)
    assert delta > 0 or isinstance(info.value, TruncatedFileError)


@pytest.mark.parametrize("suffix", [".bin", ".loss.bin", ".seq.bin", ".idx"])
def test_truncated_to_nothing(shard, suffix):
    prefix, _ = shard
    open(prefix + suffix, "wb").close()
    with pytest.raises(TruncatedFileError):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize("suffix", SFT + (".bin",))
def test_companion_swapped_from_another_shard(tmp_path, rng, suffix):
    """Same pack count, different content sizes: the swap is caught at open, naming a file."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_shard(a, random_packs(rng, 5, pack_size=16), pack_size=16)
    write_shard(b, random_packs(rng, 5, pack_size=64, full=True), pack_size=64)
    shutil.copyfile(b + suffix, a + suffix)
    with pytest.raises(SizeMismatchError) as info:
        MMapIndexedDataset(a)
    assert info.value.path.startswith(a + ".")


def test_swapped_idx_with_other_pack_count(tmp_path, rng):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_shard(a, random_packs(rng, 5))
    write_shard(b, random_packs(rng, 4))
    shutil.copyfile(b + ".idx", a + ".idx")
    with pytest.raises(SizeMismatchError, match="pack count differs"):
        MMapIndexedDataset(a)


# ----------------------------------------------------------------------------- pretrain data


def write_pretrain(prefix, seqs, dtype, docs=None):
    """Upstream-layout .bin/.idx written by hand from the documented layout."""
    lengths = np.array([len(s) for s in seqs], np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
    docs = np.arange(len(seqs) + 1, dtype=np.int64) if docs is None else np.asarray(docs, np.int64)
    from megatron_sft_idx.format import DType
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(seqs).astype(dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(IdxHeader(int(DType.from_numpy(dtype)), len(seqs), len(docs)).pack())
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_pretrain_prefix_opens_as_packs_of_one_sequence(tmp_path, dtype):
    prefix = str(tmp_path / "p")
    seqs = [np.arange(5), np.arange(3) + 7, np.arange(9) + 100]
    write_pretrain(prefix, seqs, dtype, docs=[0, 2, 3])
    ds = MMapIndexedDataset(prefix, check_packs=True)
    assert ds.is_pretrain and ds.metadata.kind == "pretrain" and len(ds) == 3
    assert ds.metadata.loss_mask_convention == "pretrain_all_ones"
    for i, s in enumerate(seqs):
        pack = ds[i]
        np.testing.assert_array_equal(pack.input_ids, s)
        assert pack.input_ids.dtype == dtype
        np.testing.assert_array_equal(pack.loss_mask, np.ones(len(s)))
        np.testing.assert_array_equal(pack.seq_start_id, [0])
        assert not pack.loss_mask.flags.writeable and not pack.seq_start_id.flags.writeable
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(ds.seq_offsets, [0, 1, 2, 3])
    arrays = ds.arrays()
    np.testing.assert_array_equal(arrays.tokens, np.concatenate(seqs))
    assert arrays.loss_mask.sum() == 17 and arrays.seq_starts.tolist() == [0, 0, 0]


def test_sft_shard_without_companions_reads_as_pretrain(shard):
    prefix, packs = shard
    for suffix in SFT:
        os.unlink(prefix + suffix)
    ds = MMapIndexedDataset(prefix)
    assert ds.is_pretrain
    np.testing.assert_array_equal(ds[3].input_ids, packs[3][0])


def test_pretrain_bin_size_disagreeing_with_idx(tmp_path):
    prefix = str(tmp_path / "p")
    write_pretrain(prefix, [np.arange(5), np.arange(4)], np.uint16)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    refuses(prefix, SizeMismatchError, "last pack does not end at the end of .bin", ".bin")


# ----------------------------------------------------------------------------- laziness, pickling


def test_open_reads_only_headers(shard):
    prefix, packs = shard
    ds = MMapIndexedDataset(prefix)
    assert not ds.is_mapped
    assert len(ds) == 6 and ds.metadata.stats.pack_count == 6
    assert not ds.is_mapped
    ds[0]
    assert ds.is_mapped


def test_open_does_not_read_bin_contents(shard):
    prefix, _ = shard
    for suffix in (".bin", ".loss.bin", ".seq.bin"):
        size = os.path.getsize(prefix + suffix)
        with open(prefix + suffix, "wb") as f:
            f.write(os.urandom(size))
    ds = MMapIndexedDataset(prefix)
    assert not ds.is_mapped and len(ds) == 6


def test_pickles_as_prefix_only(shard):
    prefix, packs = shard
    ds = MMapIndexedDataset(prefix, check_packs=True)
    ds[0]  # maps exist now; they must not travel
    raw = pickle.dumps(ds)
    assert len(raw) < len(prefix) + 300
    assert b"MMIDIDX" not in raw
    back = pickle.loads(raw)
    assert not back.is_mapped and back.check_packs and back.prefix == prefix
    for i, (ids, loss, starts) in enumerate(packs):
        np.testing.assert_array_equal(back[i].input_ids, ids)
        np.testing.assert_array_equal(back[i].loss_mask, loss)
        np.testing.assert_array_equal(back[i].seq_start_id, starts)
    assert "packs=6" in repr(back) and "kind=sft" in repr(back)


def test_exists(shard, tmp_path):
    prefix, _ = shard
    assert MMapIndexedDataset.exists(prefix)
    assert not MMapIndexedDataset.exists(str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- corrupt contents


def test_check_packs_catches_a_bad_loss_value(shard):
    prefix, packs = shard
    offset = sum(len(p[0]) for p in packs[:2])
    patch(prefix + ".loss.bin", offset, "B", 2)
    assert MMapIndexedDataset(prefix)[2].loss_mask[0] == 2  # structural checks pass: values unchecked
    ds = MMapIndexedDataset(prefix, check_packs=True)
    ds[1]
    with pytest.raises(InvariantError, match=r"pack 2 breaks an invariant.*pack=2, rule=LOSS_VALUE"):
        ds[2]


def test_check_packs_catches_out_of_vocab_token(shard):
    prefix, packs = shard
    patch(prefix + ".bin", 0, "H", 1000)
    with pytest.raises(InvariantError, match="rule=TOKEN_OUT_OF_VOCAB"):
        MMapIndexedDataset(prefix, check_packs=True)[0]


def test_corrupt_pointer_is_a_shard_error_not_a_numpy_one(shard):
    prefix, _ = shard
    h = IdxHeader.parse(open(prefix + ".idx", "rb").read(IDX_HEADER_SIZE), prefix + ".idx",
                        os.path.getsize(prefix + ".idx"))
    patch(prefix + ".idx", h.pointers_offset + 8, "q", 1 << 40)
    ds = MMapIndexedDataset(prefix)
    ds[0]
    with pytest.raises(InvariantError, match=r"pack 1 is corrupt: pointer/length fall outside \.bin"):
        ds[1]


def test_corrupt_csr_offsets(shard):
    prefix, _ = shard
    h = SeqIdxHeader.parse(open(prefix + ".seq.idx", "rb").read(SEQ_IDX_HEADER_SIZE),
                           prefix + ".seq.idx", os.path.getsize(prefix + ".seq.idx"))
    patch(prefix + ".seq.idx", h.csr_offset + 8 * 3, "q", -4)
    ds = MMapIndexedDataset(prefix)
    with pytest.raises(InvariantError, match="CSR offsets"):
        ds[2]
    with pytest.raises(ShardError):
        ds[3]
