"""The gate's corruption matrix: every corruption fails the check with its named finding code.

Content corruptions come in two variants: *unsealed* (bytes changed, nothing
else, so the CRC-32 pass also fires) and *sealed* (``reseal`` then rewrites the
metadata's sizes/CRCs and the ``.seq.idx`` header/body CRCs to match, so only
the deeper check can catch it). The reader, handed the same shard, must raise
only the project's ShardError (never a numpy/struct error).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from support.corrupt import (cut, first_start, flip, idx_offset, layout, loss_on_last, loss_two, pack_with_seqs,
                     patch, reader_raises_only_shard_errors, reseal, sealed, set_loss, set_start,
                     start_decreasing)
from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.format import METADATA_OFFSET, SEQ_IDX_HEADER, IdxHeader, SeqIdxHeader
from megatron_sft_idx.gate import check
from megatron_sft_idx.gate.structure import IDX_OFFSETS, SEQ_IDX_FIELDS, SEQ_IDX_OFFSETS
from megatron_sft_idx.metadata import FileDigest, PackingStats, ShardMetadata
from support.shardgen import random_packs, write_shard

VOCAB = 1000


# --------------------------------------------------------------------------- helpers


def build(directory, name="s", seed=0, n=24, **kw):
    prefix = os.path.join(str(directory), name)
    rng = np.random.default_rng(seed)
    packs = random_packs(rng, n, vocab=VOCAB, max_seqs=kw.pop("max_seqs", 6))
    for ids, loss, starts in packs:  # no all-zero packs: the base shard is clean even with strict
        loss[0] = 1 if len(starts) == 1 or starts[1] > 1 else loss[0]
        loss[np.append(starts[1:], len(ids)) - 1] = 0
    write_shard(prefix, packs, vocab_size=VOCAB, **kw)
    return prefix


def twin(prefix, directory):
    """A shard with the same pack and sequence lengths but other tokens and loss values."""
    ds = MMapIndexedDataset(prefix)
    rng = np.random.default_rng(99)
    packs = []
    for p in ds:
        ids = rng.integers(0, VOCAB, p.packed_len)
        loss = 1 - np.asarray(p.loss_mask)
        loss[p.seq_boundaries[1:] - 1] = 0
        packs.append((ids, loss, np.asarray(p.seq_start_id)))
    other = os.path.join(str(directory), "twin")
    write_shard(other, packs, vocab_size=VOCAB)
    return other


def set_token(prefix, index, value, fmt="<H"):
    patch(prefix + ".bin", struct.calcsize(fmt) * index, struct.pack(fmt, value))


def set_idx(prefix, which, i, value):
    patch(prefix + ".idx", idx_offset(prefix, which, i), struct.pack("<i" if which == "len" else "<q", value))


# --------------------------------------------------------------------------- the matrix

def _truncate(suffix, half):
    def run(p, d):
        size = os.path.getsize(p + suffix)
        cut(p + suffix, size // 2 if half else size - 1)
    return run


def _flip_idx(field):
    return lambda p, d: flip(p + ".idx", IDX_OFFSETS[field])


def _flip_seq(field):
    return lambda p, d: flip(p + ".seq.idx", SEQ_IDX_OFFSETS[field])


def _seal_header(**fields):
    def run(p, d):
        raw = open(p + ".seq.idx", "rb").read(64)
        current = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))
        reseal(p, header={k: (v(current[k]) if callable(v) else v) for k, v in fields.items()})
    return run


def _swap(suffix, kind):
    def run(p, d):
        other = twin(p, d) if kind == "twin" else build(d, "other", seed=5, n=24, max_seqs=1)
        shutil.copyfile(other + suffix, p + suffix)
    return run


def _remove(*suffixes):
    return lambda p, d: [os.remove(p + s) for s in suffixes]


def _dup_pointer(p, d):
    ptr, *_ = layout(p)
    set_idx(p, "ptr", 5, int(ptr[4]))


def _lengths_disagree(p, d):
    _, lengths, _, _ = layout(p)
    set_idx(p, "len", 3, int(lengths[3]) + 1)


def _start_eq_len(p, d):
    ptr, lengths, offsets, starts = layout(p)
    i = pack_with_seqs(p, 2)
    set_start(p, int(offsets[i + 1]) - 1, int(lengths[i]))


def _token_vocab(p, d):
    ptr, *_ = layout(p)
    set_token(p, int(ptr[9]) // 2 + 2, VOCAB)


def _offsets_equal(p, d):
    raw = open(p + ".seq.idx", "rb").read(64)
    csr = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))["csr_offset"]
    _, _, offsets, _ = layout(p)
    patch(p + ".seq.idx", csr + 8 * 2, struct.pack("<q", int(offsets[1])))


def _edit_meta(fn):
    return lambda p, d: reseal(p, edit=fn)


def _stat(name, delta):
    def fn(obj):
        obj["stats"][name] += delta
    return fn


def _json_cut_unsealed(p, d):
    raw = open(p + ".seq.idx", "rb").read(64)
    mlen = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))["metadata_length"]
    patch(p + ".seq.idx", METADATA_OFFSET + mlen - 10, b"\0" * 10)


def _json_cut_sealed(p, d):
    raw = open(p + ".seq.idx", "rb").read()
    mlen = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))["metadata_length"]
    reseal(p, metadata_bytes=raw[METADATA_OFFSET:METADATA_OFFSET + mlen // 2])


def _extend(suffix):
    def run(p, d):
        with open(p + suffix, "ab") as f:
            f.write(b"\0")
    return run


def _checksum(p, d):
    ptr, *_ = layout(p)
    t = int(ptr[3]) // 2
    value = struct.unpack("<H", open(p + ".bin", "rb").read()[2 * t:2 * t + 2])[0]
    set_token(p, t, (value + 1) % VOCAB)


CASES = [
    # each file truncated by one byte and by half
    ("bin-minus-1", _truncate(".bin", False), "BIN_SIZE_MISMATCH"),
    ("bin-half", _truncate(".bin", True), "BIN_SIZE_MISMATCH"),
    ("idx-minus-1", _truncate(".idx", False), "IDX_SIZE_MISMATCH"),
    ("idx-half", _truncate(".idx", True), "IDX_SIZE_MISMATCH"),
    ("idx-header-cut", lambda p, d: cut(p + ".idx", 20), "IDX_TRUNCATED"),
    ("loss-minus-1", _truncate(".loss.bin", False), "LOSS_SIZE_MISMATCH"),
    ("loss-half", _truncate(".loss.bin", True), "LOSS_SIZE_MISMATCH"),
    ("seqbin-minus-1", _truncate(".seq.bin", False), "SEQ_BIN_SIZE_MISMATCH"),
    ("seqbin-half", _truncate(".seq.bin", True), "SEQ_BIN_SIZE_MISMATCH"),
    ("seqidx-minus-1", _truncate(".seq.idx", False), "SEQ_IDX_SIZE_MISMATCH"),
    ("seqidx-half", _truncate(".seq.idx", True), "SEQ_IDX_SIZE_MISMATCH"),
    ("seqidx-header-cut", lambda p, d: cut(p + ".seq.idx", 30), "SEQ_IDX_TRUNCATED"),
    ("bin-minus-1-metadata", _truncate(".bin", False), "FILE_TRUNCATED"),
    ("loss-plus-1", _extend(".loss.bin"), "LOSS_SIZE_MISMATCH"),
    ("bin-plus-2-metadata", lambda p, d: (_extend(".bin")(p, d), _extend(".bin")(p, d)), "FILE_SIZE_MISMATCH"),
    # a byte flipped in every .idx header field
    ("idx-flip-magic", _flip_idx("magic"), "IDX_BAD_MAGIC"),
    ("idx-flip-version", _flip_idx("version"), "IDX_BAD_VERSION"),
    ("idx-flip-dtype", _flip_idx("dtype_code"), "IDX_BAD_DTYPE"),
    ("idx-flip-seqcount", _flip_idx("sequence_count"), "IDX_SIZE_MISMATCH"),
    ("idx-flip-doccount", _flip_idx("document_count"), "IDX_SIZE_MISMATCH"),
    ("idx-version-2", lambda p, d: patch(p + ".idx", IDX_OFFSETS["version"], struct.pack("<Q", 2)),
     "IDX_BAD_VERSION"),
    ("idx-dtype-unknown", lambda p, d: patch(p + ".idx", IDX_OFFSETS["dtype_code"], bytes([99])),
     "IDX_BAD_DTYPE"),
    ("idx-dtype-other-valid", lambda p, d: patch(p + ".idx", IDX_OFFSETS["dtype_code"], bytes([4])),
     "DTYPE_MISMATCH"),
    # a byte flipped in every .seq.idx header field (unsealed: the header CRC catches most)
    *[(f"seqidx-flip-{f}", _flip_seq(f),
       {"magic": "SEQ_IDX_BAD_MAGIC", "version_major": "SEQ_IDX_BAD_VERSION"}.get(f, "SEQ_IDX_HEADER_CRC"))
      for f in SEQ_IDX_FIELDS],
    # the same fields wrong with the header CRC resealed: the field's own check fires
    ("seqidx-version-2", _seal_header(version_major=2), "SEQ_IDX_BAD_VERSION"),
    ("seqidx-token-dtype-unknown", _seal_header(token_dtype_code=99), "SEQ_IDX_BAD_DTYPE"),
    ("seqidx-token-dtype-other", _seal_header(token_dtype_code=4), "DTYPE_MISMATCH"),
    ("seqidx-seq-dtype", _seal_header(seq_dtype_code=5), "SEQ_IDX_BAD_DTYPE"),
    ("seqidx-loss-dtype", _seal_header(loss_dtype_code=2), "SEQ_IDX_BAD_DTYPE"),
    ("seqidx-flags", _seal_header(flags=1), "SEQ_IDX_BAD_HEADER"),
    ("seqidx-pack-count", _seal_header(pack_count=lambda v: v + 1), "SEQ_IDX_SIZE_MISMATCH"),
    ("seqidx-sequence-count", _seal_header(sequence_count=lambda v: v + 1), "SEQ_BIN_SIZE_MISMATCH"),
    ("seqidx-token-count", _seal_header(token_count=lambda v: v + 1), "BIN_SIZE_MISMATCH"),
    ("seqidx-metadata-length", _seal_header(metadata_length=lambda v: v + 64), "SEQ_IDX_BAD_HEADER"),
    ("seqidx-csr-offset", _seal_header(csr_offset=lambda v: v + 64), "SEQ_IDX_BAD_HEADER"),
    ("seqidx-body-crc", _seal_header(body_crc32=lambda v: v ^ 1), "SEQ_IDX_BODY_CRC"),
    ("seqidx-padding", lambda p, d: reseal(p, pad_byte=True), "SEQ_IDX_BAD_PADDING"),
    # companions swapped in from another shard with the same pack count
    ("swap-bin-twin", _swap(".bin", "twin"), "CHECKSUM_MISMATCH"),
    ("swap-loss-twin", _swap(".loss.bin", "twin"), "CHECKSUM_MISMATCH"),
    ("swap-seqidx-twin", _swap(".seq.idx", "twin"), "CHECKSUM_MISMATCH"),
    ("swap-seqbin-other", _swap(".seq.bin", "other"), "SEQ_BIN_SIZE_MISMATCH"),
    ("swap-idx-other", _swap(".idx", "other"), "CHECKSUM_MISMATCH"),
    ("swap-loss-other", _swap(".loss.bin", "other"), "LOSS_SIZE_MISMATCH"),
    # .idx arrays
    ("pointer-duplicated", _dup_pointer, "IDX_POINTER_MISMATCH"),
    ("pointer-duplicated-sealed", sealed(_dup_pointer), "IDX_POINTER_MISMATCH"),
    ("lengths-vs-pointers", _lengths_disagree, "IDX_POINTER_MISMATCH"),
    ("length-zero", lambda p, d: set_idx(p, "len", 2, 0), "IDX_LENGTH_NONPOSITIVE"),
    ("first-pointer-nonzero", lambda p, d: set_idx(p, "ptr", 0, 2), "IDX_POINTER_MISMATCH"),
    ("last-length-past-bin", lambda p, d: set_idx(p, "len", 23, int(layout(p)[1][23]) + 1), "BIN_SIZE_MISMATCH"),
    ("documents-not-per-pack", lambda p, d: set_idx(p, "doc", 3, 5), "IDX_DOCUMENT_INDICES"),
    ("documents-bad-end", lambda p, d: set_idx(p, "doc", 24, 23), "IDX_DOCUMENT_INDICES"),
    ("csr-offsets-equal", sealed(_offsets_equal), "SEQ_IDX_OFFSETS"),
    ("csr-offsets-equal-unsealed", _offsets_equal, "SEQ_IDX_OFFSETS"),
    # every pack's invariants, unsealed and sealed
    ("loss-two", loss_two, "LOSS_NOT_BINARY"),
    ("loss-two-sealed", sealed(loss_two), "LOSS_NOT_BINARY"),
    ("loss-on-last", loss_on_last, "LOSS_ON_LAST_POSITION"),
    ("loss-on-last-sealed", sealed(loss_on_last), "LOSS_ON_LAST_POSITION"),
    ("start-eq-packed-len", sealed(_start_eq_len), "SEQ_START_OUT_OF_RANGE"),
    ("start-decreasing", sealed(start_decreasing), "SEQ_NOT_INCREASING"),
    ("start-first-nonzero", sealed(first_start), "SEQ_FIRST_NOT_ZERO"),
    ("token-eq-vocab", sealed(_token_vocab), "TOKEN_OUT_OF_VOCAB"),
    ("token-eq-vocab-unsealed", _token_vocab, "TOKEN_OUT_OF_VOCAB"),
    ("pack-too-long", _edit_meta(lambda o: o.update(pack_size=8)), "PACK_TOO_LONG"),
    ("pad-multiple", _edit_meta(lambda o: o.update(pad_seq_to_mult=7)), "SEQ_NOT_PAD_MULTIPLE"),
    # metadata
    ("stats-max-seqlen", _edit_meta(_stat("dataset_max_seqlen", 1)), "METADATA_STATS_MISMATCH"),
    ("stats-loss-tokens", _edit_meta(_stat("loss_token_count", -1)), "METADATA_STATS_MISMATCH"),
    ("stats-pack-count", _edit_meta(_stat("pack_count", 1)), "METADATA_STATS_MISMATCH"),
    ("metadata-missing-key", _edit_meta(lambda o: o.pop("files")), "METADATA_INVALID"),
    ("metadata-dtype", _edit_meta(lambda o: o.update(token_dtype="int32")), "DTYPE_MISMATCH"),
    ("metadata-size", _edit_meta(lambda o: o["files"][".seq.bin"].update(size=1)), "FILE_SIZE_MISMATCH"),
    ("metadata-json-cut", _json_cut_sealed, "METADATA_UNPARSABLE"),
    ("metadata-json-zeroed", _json_cut_unsealed, "METADATA_UNPARSABLE"),
    # checksums and presence
    ("checksum-data-byte", _checksum, "CHECKSUM_MISMATCH"),
    ("seqidx-missing-loss-present", _remove(".seq.idx"), "FILE_MISSING"),
    ("idx-missing", _remove(".idx"), "FILE_MISSING"),
    ("bin-missing", _remove(".bin"), "FILE_MISSING"),
    ("pretrain-only", _remove(".loss.bin", ".seq.idx", ".seq.bin"), "PRETRAIN_SHARD"),
]


def test_matrix_is_large_and_distinct():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 30
    assert len({c[2] for c in CASES}) >= 30  # distinct finding codes exercised


@pytest.mark.slow
@pytest.mark.parametrize("name,corrupt,code", CASES, ids=[c[0] for c in CASES])
def test_corruption_is_caught(tmp_path, name, corrupt, code):
    prefix = build(tmp_path)
    assert check(prefix, strict=True).passed  # the base shard is clean
    corrupt(prefix, tmp_path)
    report = check(prefix)
    shard = report.shards[0]
    assert not report.passed and report.exit_code == 1, report.format_text(verbose=True)
    assert code in shard.codes(), f"{code} not in {shard.codes()}\n{report.format_text(verbose=True)}"
    finding = next(f for f in shard.findings if f.code == code)
    assert finding.severity == "error" and finding.message and finding.file.startswith(prefix)
    json.loads(report.to_json())
    reader_raises_only_shard_errors(prefix)


def test_pack_findings_name_pack_and_offset(tmp_path):
    prefix = build(tmp_path)
    ptr, lengths, offsets, starts = layout(prefix)
    i = pack_with_seqs(prefix, 2)
    pos = int(ptr[i]) // 2 + int(starts[offsets[i] + 1]) - 1
    set_loss(prefix, pos, 1)
    reseal(prefix)
    finding = next(f for f in check(prefix).shards[0].findings if f.code == "LOSS_ON_LAST_POSITION")
    assert (finding.pack, finding.offset, finding.file) == (i, pos, prefix + ".loss.bin")


def test_header_findings_point_at_the_field(tmp_path):
    prefix = build(tmp_path)
    _seal_header(flags=3)(prefix, tmp_path)
    finding = next(f for f in check(prefix).shards[0].findings if f.code == "SEQ_IDX_BAD_HEADER")
    assert finding.offset == SEQ_IDX_OFFSETS["flags"] and "flags" in finding.message


def test_crc_flip_still_names_the_bad_field(tmp_path):
    prefix = build(tmp_path)
    patch(prefix + ".seq.idx", SEQ_IDX_OFFSETS["seq_dtype_code"], bytes([5]))  # CRC now wrong as well
    codes = check(prefix).shards[0].codes()
    assert "SEQ_IDX_HEADER_CRC" in codes and "SEQ_IDX_BAD_DTYPE" in codes


def test_vocab_size_argument_overrides_metadata(tmp_path):
    prefix = build(tmp_path)
    max_id = int(np.max(MMapIndexedDataset(prefix).arrays().tokens))
    report = check(prefix, vocab_size=max_id)
    assert "TOKEN_OUT_OF_VOCAB" in report.shards[0].codes()
    assert "VOCAB_DIFFERS_FROM_METADATA" in report.shards[0].codes()
    assert check(prefix, vocab_size=max_id + 1).passed


def test_zero_loss_pack_warns_and_fails_with_strict(tmp_path):
    prefix = build(tmp_path)
    ptr, lengths, _, _ = layout(prefix)
    patch(prefix + ".loss.bin", int(ptr[6]) // 2, bytes(int(lengths[6])))
    reseal(prefix, edit=lambda o: None)
    # loss_token_count in the stats is now stale too; recompute it for a clean warning-only shard
    loss = np.fromfile(prefix + ".loss.bin", np.uint8)
    reseal(prefix, edit=lambda o: o["stats"].update(loss_token_count=int(loss.sum())))
    report = check(prefix)
    zero = [f for f in report.shards[0].findings if f.code == "ZERO_LOSS_PACK"]
    assert report.passed and [f.pack for f in zero] == [6] and zero[0].severity == "warning"
    strict = check(prefix, strict=True)
    assert not strict.passed and strict.exit_code == 1


def test_fast_level_skips_checksums_and_says_so(tmp_path):
    prefix = build(tmp_path)
    _checksum(prefix, tmp_path)
    fast = check(prefix, level="fast")
    assert fast.passed and "CHECKSUMS_SKIPPED" in fast.shards[0].codes()
    assert "checksums skipped" in fast.format_text()
    assert not check(prefix, level="standard").passed


def test_newer_minor_version_passes_with_a_notice(tmp_path):
    prefix = build(tmp_path)
    _seal_header(version_minor=3)(prefix, tmp_path)
    report = check(prefix)
    assert report.passed and "SEQ_IDX_NEWER_MINOR" in report.shards[0].codes()


def test_pretrain_passes_only_when_allowed(tmp_path):
    prefix = build(tmp_path)
    _remove(".loss.bin", ".seq.idx", ".seq.bin")(prefix, tmp_path)
    assert check(prefix, allow_pretrain=True, level="deep").passed
    report = check(prefix)
    assert not report.passed and report.shards[0].kind == "pretrain"
    set_token(prefix, 3, VOCAB + 5)
    bad = check(prefix, allow_pretrain=True, vocab_size=VOCAB)
    assert "TOKEN_OUT_OF_VOCAB" in bad.shards[0].codes()


def test_token_negative_in_int32_shard(tmp_path):
    prefix = build(tmp_path, dtype=np.int32)
    ptr, *_ = layout(prefix)
    set_token(prefix, int(ptr[2]) // 4, -5, fmt="<i")
    reseal(prefix)
    assert "TOKEN_NEGATIVE" in check(prefix).shards[0].codes()


# --------------------------------------------------------------------------- > 2 GiB, sparse

PACK_LEN = 1 << 20          # tokens per pack (uint16: 2 MiB of .bin)
SPARSE_PACKS = 1025         # 2 GiB + 2 MiB of .bin: the last pointer is 2**31


def write_sparse_shard(prefix, wrap_int32):
    """A shard whose .bin/.loss.bin are sparse zeros (> 2 GiB of .bin, no disk used).

    The files' CRC-32s in the metadata are placeholders: the tests run at level
    ``fast`` (computing CRCs over 3 GiB of zeros would cost seconds and prove nothing new).
    """
    n, itemsize = SPARSE_PACKS, 2
    tokens = n * PACK_LEN
    lengths = np.full(n, PACK_LEN, np.int32)
    pointers = np.arange(n, dtype=np.int64) * PACK_LEN * itemsize
    if wrap_int32:  # what a writer that accumulates pointers in int32 produces
        pointers = pointers.astype(np.int32).astype(np.int64)
    with open(prefix + ".bin", "wb"):
        pass
    os.truncate(prefix + ".bin", tokens * itemsize)
    with open(prefix + ".loss.bin", "wb"):
        pass
    os.truncate(prefix + ".loss.bin", tokens)
    np.zeros(n, np.int32).tofile(prefix + ".seq.bin")
    idx = IdxHeader(8, n, n + 1).pack() + lengths.tobytes() + pointers.tobytes() + \
        np.arange(n + 1, dtype=np.int64).tobytes()
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    sizes = {".bin": tokens * itemsize, ".loss.bin": tokens, ".seq.bin": 4 * n, ".idx": len(idx)}
    stats = PackingStats(pack_count=n, sequence_count=n, token_count=tokens, loss_token_count=0,
                         max_samples_per_bin=1, dataset_max_seqlen=PACK_LEN, min_seqlen=PACK_LEN,
                         min_packed_seqlen=PACK_LEN, max_packed_seqlen=PACK_LEN, packing_factor=1.0,
                         packing_efficiency=1.0)
    meta = ShardMetadata(pack_size=PACK_LEN, token_dtype="uint16", vocab_size=VOCAB, stats=stats,
                         files={s: FileDigest(size=v, crc32=0) for s, v in sizes.items()},
                         producer={"name": "test", "version": "0"}).encode()
    csr = np.arange(n + 1, dtype=np.int64).tobytes()
    header = SeqIdxHeader(token_dtype_code=8, pack_count=n, sequence_count=n, token_count=tokens,
                          metadata_length=len(meta))
    body = meta + bytes(header.csr_offset - METADATA_OFFSET - len(meta)) + csr
    header = SeqIdxHeader(token_dtype_code=8, pack_count=n, sequence_count=n, token_count=tokens,
                          metadata_length=len(meta), body_crc32=zlib.crc32(body))
    with open(prefix + ".seq.idx", "wb") as f:
        f.write(header.pack() + body)


def test_int32_overflowed_pointers_in_sparse_2gib_shard(tmp_path):
    prefix = str(tmp_path / "big")
    write_sparse_shard(prefix, wrap_int32=True)
    finding = next(f for f in check(prefix, level="fast").shards[0].findings
                   if f.code == "IDX_POINTER_INT32_OVERFLOW")
    assert finding.pack == 1024 and "2147483648" in finding.message


@pytest.mark.slow
def test_valid_sparse_2gib_shard_passes(tmp_path):
    prefix = str(tmp_path / "big")
    write_sparse_shard(prefix, wrap_int32=False)
    report = check(prefix, level="fast", sample=4)
    shard = report.shards[0]
    assert report.passed, report.format_text()
    assert shard.tokens == SPARSE_PACKS * PACK_LEN and "ZERO_LOSS_PACK" in shard.codes()
