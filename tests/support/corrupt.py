"""Corrupting shards on purpose, for the gate, reader-fuzz and native tests."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import zlib

import numpy as np

from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.format import (
    ALL_SUFFIXES,
    CHECKSUMMED_SUFFIXES,
    IDX_HEADER_SIZE,
    METADATA_OFFSET,
    SEQ_IDX_HEADER,
    SEQ_IDX_HEADER_CRC_SPAN,
    IdxHeader,
    align,
)
from megatron_sft_idx.gate.structure import SEQ_IDX_FIELDS

# --------------------------------------------------------------------------- bytes


def patch(path, offset, data: bytes):
    """Overwrite ``data`` at byte ``offset`` of ``path`` (the file keeps its size unless written past)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path, offset):
    """Invert every bit of the byte at ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def cut(path, keep):
    """Truncate ``path`` to its first ``keep`` bytes."""
    os.truncate(path, keep)


# --------------------------------------------------------------------------- reading a valid shard


def seq_fields(prefix):
    """The ``.seq.idx`` header fields, by name."""
    with open(prefix + ".seq.idx", "rb") as f:
        return dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(f.read(SEQ_IDX_HEADER.size))))


def layout(prefix):
    """(pointers, lengths, seq_offsets, starts) of a valid shard, copied out."""
    a = MMapIndexedDataset(prefix).arrays()
    return (np.array(a.sequence_pointers), np.array(a.sequence_lengths), np.array(a.seq_offsets),
            np.array(a.seq_starts))


def pack_with_seqs(prefix, k):
    """Index of the first pack holding at least ``k`` sequences."""
    _, _, offsets, _ = layout(prefix)
    hits = np.nonzero(np.diff(offsets) >= k)[0]
    assert hits.size, "the base shard must hold a pack with enough sequences"
    return int(hits[0])


def idx_offset(prefix, which, i):
    """Byte offset in ``.idx`` of element ``i`` of array ``which``: "len", "ptr" or "doc"."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read(IDX_HEADER_SIZE)
    h = IdxHeader.parse(raw, prefix + ".idx", os.path.getsize(prefix + ".idx"))
    base = {"len": h.lengths_offset, "ptr": h.pointers_offset, "doc": h.document_indices_offset}[which]
    return base + (4 if which == "len" else 8) * i


# --------------------------------------------------------------------------- writing


def set_loss(prefix, pos, value):
    """Set the loss-mask byte at token position ``pos`` (whole-shard index)."""
    patch(prefix + ".loss.bin", pos, bytes([value]))


def set_start(prefix, index, value):
    """Set entry ``index`` of ``.seq.bin`` (whole-shard sequence index) to ``value``."""
    patch(prefix + ".seq.bin", 4 * index, struct.pack("<i", value))


def reseal(prefix, header=None, metadata_bytes=None, edit=None, pad_byte=False):
    """Rewrite ``.seq.idx`` consistently: the four files' real sizes/CRCs into the metadata
    (then ``edit(obj)``), CSR offsets kept, body and header CRCs recomputed, ``header``
    overrides applied last (their CRCs still recomputed unless overridden too).

    ``metadata_bytes`` replaces the metadata verbatim (no sizes/CRCs, no ``edit``);
    ``pad_byte`` leaves a nonzero byte in the padding before the CSR offsets.
    """
    path = prefix + ".seq.idx"
    raw = pathlib.Path(path).read_bytes()
    fields = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))
    csr = raw[fields["csr_offset"]:]
    if metadata_bytes is None:
        obj = json.loads(raw[METADATA_OFFSET:METADATA_OFFSET + fields["metadata_length"]])
        for suffix in CHECKSUMMED_SUFFIXES:
            data = pathlib.Path(prefix + suffix).read_bytes()
            obj["files"][suffix] = {"size": len(data), "crc32": zlib.crc32(data)}
        if edit:
            edit(obj)
        metadata_bytes = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    if pad_byte and align(METADATA_OFFSET + len(metadata_bytes)) == METADATA_OFFSET + len(metadata_bytes):
        metadata_bytes += b" "  # make room for a padding byte (JSON allows trailing space)
    fields["metadata_length"] = len(metadata_bytes)
    fields["csr_offset"] = align(METADATA_OFFSET + len(metadata_bytes))
    padding = bytearray(fields["csr_offset"] - METADATA_OFFSET - len(metadata_bytes))
    if pad_byte:
        padding[-1] = 7
    body = metadata_bytes + bytes(padding) + csr
    fields["body_crc32"] = zlib.crc32(body)
    fields.update(header or {})
    head = SEQ_IDX_HEADER.pack(*(fields[k] for k in SEQ_IDX_FIELDS))
    if "header_crc32" not in (header or {}):
        head = head[:SEQ_IDX_HEADER_CRC_SPAN] + struct.pack("<I", zlib.crc32(head[:SEQ_IDX_HEADER_CRC_SPAN]))
    with open(path, "wb") as f:
        f.write(head + body)


# --------------------------------------------------------------------------- shared cases
# Corruptions ``(prefix, directory)`` of a uint16 base shard with at least 10 packs, one of them
# holding 3 or more sequences. Unsealed: only the bytes change, so the CRC pass fires as well.


def sealed(corrupt):
    """``corrupt`` followed by ``reseal``: only the deeper check can catch it."""
    def run(p, d):
        corrupt(p, d)
        reseal(p)
    return run


def loss_two(p, d):
    """A loss-mask value of 2 inside pack 7."""
    ptr, *_ = layout(p)
    set_loss(p, int(ptr[7]) // 2 + 1, 2)


def loss_on_last(p, d):
    """Loss on the last position of the first sequence of a multi-sequence pack."""
    ptr, _, offsets, starts = layout(p)
    i = pack_with_seqs(p, 2)
    set_loss(p, int(ptr[i]) // 2 + int(starts[offsets[i] + 1]) - 1, 1)


def start_decreasing(p, d):
    """The third sequence start of a pack set below the second."""
    _, _, offsets, starts = layout(p)
    i = pack_with_seqs(p, 3)
    set_start(p, int(offsets[i]) + 2, int(starts[offsets[i] + 1]) - 1)


def first_start(p, d):
    """Pack 4's first sequence start set to 1 instead of 0."""
    _, _, offsets, _ = layout(p)
    set_start(p, int(offsets[4]), 1)


# --------------------------------------------------------------------------- fuzzing


def mutate(rng, prefix):
    """Apply one random mutation to one random file; return a description (or None if no-op)."""
    suffix = ALL_SUFFIXES[int(rng.integers(len(ALL_SUFFIXES)))]
    path = prefix + suffix
    data = bytearray(pathlib.Path(path).read_bytes())
    before = bytes(data)
    kind = int(rng.integers(6))
    size = len(data)
    if kind == 0 and size:                          # flip one byte
        data[int(rng.integers(size))] ^= 0xFF
    elif kind == 1 and size:                        # set a few random bytes
        for _ in range(int(rng.integers(1, 5))):
            data[int(rng.integers(size))] = int(rng.integers(256))
    elif kind == 2:                                 # truncate anywhere
        del data[int(rng.integers(size + 1)):]
    elif kind == 3:                                 # extend with random bytes
        data += bytes(rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8))
    elif kind == 4 and size:                        # zero a range
        a = int(rng.integers(size))
        b = min(size, a + int(rng.integers(1, 64)))
        data[a:b] = bytes(b - a)
    elif kind == 5 and size > 1:                    # a single bit
        data[int(rng.integers(size))] ^= 1 << int(rng.integers(8))
    if bytes(data) == before:
        return None
    with open(path, "wb") as f:
        f.write(data)
    return f"{suffix} kind {kind}"


def reader_raises_only_shard_errors(prefix):
    """Open ``prefix`` with pack checks and read every pack: ShardError is fine, anything else
    (a numpy/struct/index error) propagates and fails the calling test."""
    try:
        ds = MMapIndexedDataset(prefix, check_packs=True)
        for i in range(len(ds)):
            ds[i].seq_boundaries
    except ShardError:
        pass


# --------------------------------------------------------------------------- a hostile corpus


def with_metadata_value(prefix, key, text):
    """Reseal ``prefix`` with top-level metadata ``key`` set to the raw JSON ``text``
    (anything: ``1e999``, a 4000-digit integer, nesting 300 deep)."""
    raw = pathlib.Path(prefix + ".seq.idx").read_bytes()
    obj = json.loads(raw[METADATA_OFFSET:METADATA_OFFSET + seq_fields(prefix)["metadata_length"]])
    obj[key] = "@@VALUE@@"
    body = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    reseal(prefix, metadata_bytes=body.replace(b'"@@VALUE@@"', text.encode()))


def _targeted(base_count):
    """Corruptions aimed at integer and nesting limits and at the pack invariants."""
    deep = lambda n: "[" * n + "]" * n  # noqa: E731
    return [
        ("seq-count-max", lambda p: reseal(p, header={"sequence_count": 1 << 56})),
        ("seq-count-huge", lambda p: reseal(p, header={"sequence_count": 2 ** 64 - 1})),
        ("token-count-huge", lambda p: reseal(p, header={"token_count": 2 ** 63})),
        ("pack-count-huge", lambda p: reseal(p, header={"pack_count": (1 << 56) + 1})),
        ("seq-count-plus-one", lambda p: reseal(p, header={"sequence_count": base_count + 1})),
        ("vocab-2^70", lambda p: with_metadata_value(p, "vocab_size", str(2 ** 70))),
        ("vocab-int64-max", lambda p: with_metadata_value(p, "vocab_size", str(2 ** 63 - 1))),
        ("pack-size-2^64", lambda p: with_metadata_value(p, "pack_size", str(2 ** 64))),
        ("pad-2^63", lambda p: with_metadata_value(p, "pad_seq_to_mult", str(2 ** 63))),
        ("pad-4000-digits", lambda p: with_metadata_value(p, "pad_seq_to_mult", "9" * 4000)),
        ("vocab-1e999", lambda p: with_metadata_value(p, "vocab_size", "1e999")),
        ("nested-65", lambda p: with_metadata_value(p, "zz", deep(64))),
        ("nested-300", lambda p: with_metadata_value(p, "zz", deep(300))),
        ("nested-64", lambda p: with_metadata_value(p, "zz", deep(63))),
        ("loss-two-sealed", lambda p: sealed(loss_two)(p, None)),
        ("loss-on-last-sealed", lambda p: sealed(loss_on_last)(p, None)),
        ("start-decreasing-sealed", lambda p: sealed(start_decreasing)(p, None)),
        ("first-start-sealed", lambda p: sealed(first_start)(p, None)),
    ]


def hostile_corpus(directory, bases, seed, mutations_per_base=4, targeted=None):
    """Copies of each base shard (``{name: prefix}``, each with >= 10 packs and a pack of 3+
    sequences): pristine, every targeted corruption (only for the bases named in
    ``targeted``, default all), and ``mutations_per_base`` random mutations (seeded).
    Returns ``[(name, prefix)]``."""
    import shutil

    rng = np.random.default_rng(seed)
    out = []
    for base_name, base in sorted(bases.items()):
        count = seq_fields(base)["sequence_count"]
        cases = [("pristine", lambda p: None)]
        if targeted is None or base_name in targeted:
            cases += _targeted(count)
        cases += [(f"mutation-{k}", lambda p: mutate(rng, p)) for k in range(mutations_per_base)]
        for name, corrupt in cases:
            prefix = os.path.join(str(directory), f"{base_name}-{name}")
            for suffix in ALL_SUFFIXES:
                shutil.copyfile(base + suffix, prefix + suffix)
            corrupt(prefix)
            out.append((f"{base_name}/{name}", prefix))
    return out
