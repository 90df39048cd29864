"""Whole-shard passes over the mapped arrays, in numba (no Python loop over packs).

``check_idx_arrays`` (pointers, lengths, document indices), ``check_offsets``
(CSR), ``scan`` (every pack invariant, all-zero loss masks, statistics vs the
metadata) and ``checksums`` (CRC-32 of the four data files, run in a thread
beside the numba passes: both release the GIL).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .. import _kernels
from ..format import (
    BIN_SUFFIX,
    CHECKSUMMED_SUFFIXES,
    IDX_SUFFIX,
    LENGTH_DTYPE,
    LOSS_SUFFIX,
    PAD_LAYOUT_STORED,
    POINTER_DTYPE,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_SUFFIX,
    Rule,
)
from ..packing.padding import pad_offset
from ._context import ShardContext

from .._crc import crc32 as _crc32
from .codes import ERROR, RULE_CODES

#: Pack findings recorded per shard; the rest are counted per rule.
MAX_PACK_FINDINGS = 64
#: Bytes per CRC-32 call: large enough to amortise the call, small enough to stream.
CRC_CHUNK = 16 << 20
_INT32_WRAP = 1 << 32


# --------------------------------------------------------------------------- .idx arrays


def check_idx_arrays(ctx: ShardContext) -> None:
    """Lengths > 0; pointers start at 0 and step by length x itemsize; the last pack ends at .bin's end."""
    h = ctx.idx_header
    itemsize = h.dtype.itemsize
    bin_size = ctx.sizes[BIN_SUFFIX]
    lengths, pointers = ctx.lengths(), ctx.pointers()
    n = h.sequence_count
    # Check the chain with an unbounded limit first: a wrong pointer is reported as such even
    # when it also runs past the end of .bin.
    bad, kind = _kernels.first_pointer_mismatch(lengths, pointers, itemsize, np.iinfo(np.int64).max)
    if kind == 1:
        ctx.add("IDX_LENGTH_NONPOSITIVE", f"sequence_lengths[{bad}] is {int(lengths[bad])}", IDX_SUFFIX,
                pack=bad, offset=h.lengths_offset + LENGTH_DTYPE.itemsize * bad)
    elif kind == 2:
        _pointer_finding(ctx, bad, lengths, pointers, itemsize)
    elif kind == 3:  # only on int64 overflow of the running sum
        ctx.add("IDX_POINTER_MISMATCH", "the running sum of lengths overflows int64", IDX_SUFFIX, pack=bad,
                offset=h.pointers_offset + POINTER_DTYPE.itemsize * bad)
    else:
        end = int(pointers[n - 1]) + int(lengths[n - 1]) * itemsize if n else 0
        if end != bin_size:
            where = "past" if end > bin_size else "before"
            ctx.add("BIN_SIZE_MISMATCH", f"the last pack ends at byte {end}, {where} the end of .bin "
                    f"({bin_size} bytes)", BIN_SUFFIX, pack=max(n - 1, 0), offset=min(end, bin_size))
        else:
            ctx.pointers_ok = True
    docs = ctx.documents()
    bad_doc = _kernels.first_document_mismatch(docs, n, ctx.report.kind == "sft")
    if bad_doc >= 0:
        value = int(docs[bad_doc]) if bad_doc < docs.shape[0] else None
        rule = "0, 1, ..., N (one document per pack)" if ctx.report.kind == "sft" else \
            "start at 0, non-decreasing, end at the sequence count"
        ctx.add("IDX_DOCUMENT_INDICES", f"document_indices[{bad_doc}] is {value}; they must be {rule}",
                IDX_SUFFIX, offset=h.document_indices_offset + POINTER_DTYPE.itemsize * bad_doc)
        ctx.pointers_ok = False


def _pointer_finding(ctx: ShardContext, i: int, lengths, pointers, itemsize: int) -> None:
    h = ctx.idx_header
    expected = int(np.sum(lengths[:i], dtype=np.int64)) * itemsize
    actual = int(pointers[i])
    wrapped = (expected + (1 << 31)) % _INT32_WRAP - (1 << 31)
    offset = h.pointers_offset + POINTER_DTYPE.itemsize * i
    if expected > np.iinfo(np.int32).max and actual == wrapped:
        ctx.add("IDX_POINTER_INT32_OVERFLOW", f"sequence_pointers[{i}] is {actual}: the true offset "
                f"{expected} wrapped around in int32", IDX_SUFFIX, pack=i, offset=offset)
        return
    previous = f"previous pointer {int(pointers[i - 1])} + length {int(lengths[i - 1])} x {itemsize}" \
        if i else "the first pointer must be 0"
    duplicate = " (a duplicate of the previous pointer)" if i and actual == int(pointers[i - 1]) else ""
    ctx.add("IDX_POINTER_MISMATCH", f"sequence_pointers[{i}] is {actual}, expected {expected} "
            f"({previous}){duplicate}", IDX_SUFFIX, pack=i, offset=offset)


# --------------------------------------------------------------------------- CSR offsets


def check_offsets(ctx: ShardContext) -> None:
    h = ctx.seq_header
    offsets = ctx.seq_offsets()
    bad = _kernels.first_offset_mismatch(offsets, h.sequence_count)
    if bad >= 0:
        ctx.add("SEQ_IDX_OFFSETS", f"seq_offsets[{bad}] is {int(offsets[bad])}: offsets must start at 0, "
                f"increase strictly and end at {h.sequence_count}", SEQ_IDX_SUFFIX,
                pack=min(bad, h.pack_count - 1), offset=h.csr_offset + POINTER_DTYPE.itemsize * bad)
        return
    ctx.offsets_ok = True


# --------------------------------------------------------------------------- packs


def scan(ctx: ShardContext, vocab_size: Optional[int]) -> None:
    """Every pack's invariants, all-zero loss masks, and the statistics recorded in the metadata."""
    meta, h = ctx.metadata, ctx.idx_header
    itemsize = h.dtype.itemsize
    lengths, pointers, offsets = ctx.lengths(), ctx.pointers(), ctx.seq_offsets()
    tokens, loss, starts = ctx.tokens(), ctx.loss(), ctx.seq_starts()
    token_offsets = pointers // itemsize
    n = h.sequence_count
    out_rule = np.zeros(MAX_PACK_FINDINGS, np.int64)
    out_pack = np.zeros(MAX_PACK_FINDINGS, np.int64)
    out_pos = np.zeros(MAX_PACK_FINDINGS, np.int64)
    counts = np.zeros(_kernels.N_RULES, np.int64)
    dtype_max = int(np.iinfo(h.dtype.numpy).max)
    pad = meta.pad_seq_to_mult if meta is not None else 1
    layout = meta.pad_layout if meta is not None else PAD_LAYOUT_STORED
    result = _kernels.scan_packs(lengths, token_offsets, offsets, tokens, loss, starts,
                                 (meta.pack_size or 0) if meta else 0, dtype_max, vocab_size or 0, pad,
                                 0, n, MAX_PACK_FINDINGS, out_rule, out_pack, out_pos, counts,
                                 pad_offset(layout))
    recorded = int(result[0])
    if int(counts.sum()) > recorded:  # the total first, so a shortened listing still shows it
        per_rule = ", ".join(f"{RULE_CODES[Rule(r)]}: {int(c)}" for r, c in enumerate(counts) if c)
        ctx.add(RULE_CODES[Rule(int(out_rule[0]))], f"{int(counts.sum())} packs break an invariant in total, "
                f"only the first {recorded} are listed ({per_rule})", severity=ERROR)
    for k in range(recorded):
        _rule_finding(ctx, Rule(int(out_rule[k])), int(out_pack[k]), int(out_pos[k]), token_offsets,
                      offsets, vocab_size, f"{pad}, pad_layout {layout}")
    _zero_loss(ctx, lengths, token_offsets, loss)
    if not counts.any() and meta is not None:
        _compare_stats(ctx, result, n, int(starts.shape[0]), int(tokens.shape[0]),
                       int((lengths.astype(np.int64) - np.diff(offsets)).min()))


def _rule_finding(ctx, rule: Rule, i: int, pos: int, token_offsets, offsets, vocab_size, pad) -> None:
    itemsize = ctx.idx_header.dtype.itemsize
    t0, s0 = int(token_offsets[i]), int(offsets[i])
    text = rule.describe
    if rule in (Rule.PACK_EMPTY, Rule.PACK_TOO_LONG):
        suffix, offset = IDX_SUFFIX, ctx.idx_header.lengths_offset + LENGTH_DTYPE.itemsize * i
        text += f" (packed_len {int(ctx.lengths()[i])}, pack_size {getattr(ctx.metadata, 'pack_size', None)})"
    elif rule in (Rule.LOSS_VALUE, Rule.LOSS_ON_LAST, Rule.LENGTH_MISMATCH):
        suffix, offset = LOSS_SUFFIX, t0 + pos
        text += f" (position {pos} of the pack holds {int(ctx.loss()[t0 + pos])})"
    elif rule in (Rule.TOKEN_NEGATIVE, Rule.TOKEN_TOO_LARGE, Rule.TOKEN_OUT_OF_VOCAB):
        suffix, offset = BIN_SUFFIX, (t0 + pos) * itemsize
        text += f" (position {pos} holds id {int(ctx.tokens()[t0 + pos])}; vocab_size {vocab_size})"
    else:
        suffix, offset = SEQ_BIN_SUFFIX, (s0 + pos) * SEQ_DTYPE.itemsize
        starts = ctx.seq_starts()[s0:int(offsets[i + 1])]
        shown = ", ".join(str(int(v)) for v in starts[:8]) + (", ..." if starts.shape[0] > 8 else "")
        text += f" (seq_start_id [{shown}], packed_len {int(ctx.lengths()[i])}"
        text += f", pad multiple {pad})" if rule == Rule.SEQ_NOT_PAD_MULTIPLE else ")"
    ctx.add(RULE_CODES[rule], text, suffix, pack=i, offset=offset)


def _zero_loss(ctx, lengths, token_offsets, loss) -> None:
    out = np.zeros(MAX_PACK_FINDINGS, np.int64)
    count = int(_kernels.zero_loss_packs(lengths, token_offsets, loss, MAX_PACK_FINDINGS, out))
    if count > MAX_PACK_FINDINGS:
        ctx.add("ZERO_LOSS_PACK", f"{count} of {lengths.shape[0]} packs have an all-zero loss mask; the "
                f"first {MAX_PACK_FINDINGS} are listed", LOSS_SUFFIX)
    for k in range(min(count, MAX_PACK_FINDINGS)):
        i = int(out[k])
        ctx.add("ZERO_LOSS_PACK", f"the loss mask is 0 at all {int(lengths[i])} positions", LOSS_SUFFIX,
                pack=i, offset=int(token_offsets[i]))


def _compare_stats(ctx, result, n_packs: int, n_seq: int, n_tok: int, min_runtime: int) -> None:
    """The metadata's packing statistics must be what the data says."""
    _, max_len, min_len, loss_sum, max_samples, min_packed, max_packed = (int(v) for v in result)
    stats = ctx.metadata.stats
    pack_size = ctx.metadata.pack_size
    actual = {
        "pack_count": n_packs, "sequence_count": n_seq, "token_count": n_tok, "loss_token_count": loss_sum,
        "max_samples_per_bin": max_samples, "dataset_max_seqlen": max_len, "min_seqlen": min_len,
        "min_packed_seqlen": min_packed, "max_packed_seqlen": max_packed,
        "packing_factor": round(n_seq / n_packs, 6),
        "packing_efficiency": round(n_tok / (n_packs * pack_size), 6) if pack_size else None,
    }
    if stats.min_packed_runtime_len is not None:  # format 1.1; a 1.0 shard does not record it
        actual["min_packed_runtime_len"] = min_runtime
    for name, value in actual.items():
        recorded = getattr(stats, name)
        same = (recorded is None and value is None) or (
            recorded is not None and value is not None and abs(float(recorded) - float(value)) <= 1e-6)
        if not same:
            ctx.add("METADATA_STATS_MISMATCH", f"stats.{name} records {recorded}, the data gives {value}",
                    SEQ_IDX_SUFFIX)


# --------------------------------------------------------------------------- pretrain tokens


def scan_pretrain_tokens(ctx: ShardContext, vocab_size: Optional[int]) -> None:
    h = ctx.idx_header
    dtype_max = int(np.iinfo(h.dtype.numpy).max)
    rule, pos = _kernels.first_bad_token(ctx.tokens(), dtype_max, vocab_size or 0)
    if rule != int(Rule.OK):
        rule = Rule(int(rule))
        ctx.add(RULE_CODES[rule], f"{rule.describe} (token {int(pos)} holds id {int(ctx.tokens()[pos])}; "
                f"vocab_size {vocab_size})", BIN_SUFFIX, offset=int(pos) * h.dtype.itemsize)


# --------------------------------------------------------------------------- checksums


def checksums(ctx: ShardContext) -> List[Tuple[str, str, str, Optional[int]]]:
    """CRC-32 of each checksummed file vs the metadata: ``[(code, message, suffix, offset)]``.

    Runs in a worker thread beside the numba passes. It reads the files with
    ``readinto`` rather than through the shared maps, so it never waits on the
    main thread's page faults; it touches no shared state and returns what to report.
    """
    out = []
    for suffix in CHECKSUMMED_SUFFIXES:
        recorded = ctx.metadata.files[suffix]
        if ctx.sizes[suffix] != recorded.size:
            continue  # already reported as a size finding; a CRC would say nothing more
        try:
            crc = crc32_of_file(ctx.path(suffix))
        except OSError as exc:
            out.append(("FILE_UNREADABLE", f"cannot read: {exc.strerror or exc}", suffix, None))
            continue
        if crc != recorded.crc32:
            out.append(("CHECKSUM_MISMATCH", f"CRC-32 is {crc:#010x}, the metadata records "
                        f"{recorded.crc32:#010x}", suffix, None))
    return out


def crc32_of_file(path: str) -> int:
    """CRC-32 (zlib's polynomial) of a whole file; the GIL is released for each chunk."""
    buf = bytearray(CRC_CHUNK)
    view = memoryview(buf)
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return crc
            crc = _crc32(view[:n], crc)
