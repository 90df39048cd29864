"""Whole-shard passes over the mapped arrays, in numba (no Python loop over packs).

``check_idx_arrays`` (pointers, lengths, document indices), ``check_offsets``
(CSR), ``scan`` (every pack invariant, all-zero loss masks, statistics vs the
metadata) and ``checksums`` (CRC-32 of the four data files, run in a thread
beside the numba passes: both release the GIL).

Each pass walks the shard in chunks -- at most ``CHUNK_PACKS`` packs and, for the data,
``CHUNK_TOKENS`` tokens -- faulting a chunk's pages in with one call and releasing them
after it (:meth:`ShardContext.populate` / :meth:`ShardContext.release`), and keeps only
per-chunk arrays: the gate's resident memory is bounded by one chunk whatever the shard's
size. The findings are those of one pass over the whole shard (:class:`ScanAggregate`
combines the chunks; the remote gate streams its chunks through the same aggregate).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import numpy as np

from .. import _kernels
from ..format import (
    BIN_SUFFIX,
    CHECKSUMMED_SUFFIXES,
    IDX_SUFFIX,
    LENGTH_DTYPE,
    LOSS_SUFFIX,
    MAX_SOURCES,
    METADATA_OFFSET,
    PAD_LAYOUT_STORED,
    POINTER_DTYPE,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_SUFFIX,
    SOURCE_DTYPE,
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
#: Packs per chunk of a pass (index entries in flight: ~40 bytes each) ...
CHUNK_PACKS = 1 << 18
#: ... and tokens per chunk of the pack scan (x (itemsize + 1) bytes of data resident at once).
CHUNK_TOKENS = 8 << 20
_INT32_WRAP = 1 << 32
_INT64_MAX = int(np.iinfo(np.int64).max)


@contextlib.contextmanager
def resident(ctx: ShardContext, *ranges: Tuple[str, int, int]) -> Iterator[None]:
    """Byte ranges ``(suffix, start, stop)`` of mapped files faulted in for the block, released after."""
    for suffix, start, stop in ranges:
        ctx.populate(suffix, start, stop)
    try:
        yield
    finally:
        for suffix, start, stop in ranges:
            ctx.release(suffix, start, stop)


def pack_chunks(n: int, size: Optional[int] = None) -> Iterator[Tuple[int, int]]:
    """``[a, b)`` ranges of ``size`` (default ``CHUNK_PACKS``) covering ``[0, n)``."""
    size = size or CHUNK_PACKS
    for a in range(0, n, size):
        yield a, min(n, a + size)


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
    bad, kind, end = -1, 0, 0
    for a, b in pack_chunks(n):
        with resident(ctx, (IDX_SUFFIX, h.lengths_offset + 4 * a, h.lengths_offset + 4 * b),
                      (IDX_SUFFIX, h.pointers_offset + 8 * a, h.pointers_offset + 8 * b)):
            bad, kind, end = _kernels.pointer_chain(lengths[a:b], pointers[a:b], itemsize, _INT64_MAX, end)
        if bad >= 0:
            bad += a
            break
    if kind == 1:
        ctx.add("IDX_LENGTH_NONPOSITIVE", f"sequence_lengths[{bad}] is {int(lengths[bad])}", IDX_SUFFIX,
                pack=bad, offset=h.lengths_offset + LENGTH_DTYPE.itemsize * bad)
    elif kind == 2:
        _pointer_finding(ctx, bad, lengths, pointers, itemsize)
    elif kind == 3:  # only on int64 overflow of the running sum
        ctx.add("IDX_POINTER_MISMATCH", "the running sum of lengths overflows int64", IDX_SUFFIX, pack=bad,
                offset=h.pointers_offset + POINTER_DTYPE.itemsize * bad)
    elif end != bin_size:
        where = "past" if end > bin_size else "before"
        ctx.add("BIN_SIZE_MISMATCH", f"the last pack ends at byte {end}, {where} the end of .bin "
                f"({bin_size} bytes)", BIN_SUFFIX, pack=max(n - 1, 0), offset=min(end, bin_size))
    else:
        ctx.pointers_ok = True
    _check_documents(ctx, n)


def _check_documents(ctx: ShardContext, n: int) -> None:
    h = ctx.idx_header
    docs = ctx.documents()
    count = docs.shape[0]
    bad_doc = 0 if count == 0 else -1
    for a, b in pack_chunks(count):
        with resident(ctx, (IDX_SUFFIX, h.document_indices_offset + 8 * a, h.document_indices_offset + 8 * b)):
            bad_doc = _kernels.document_chain(docs[a:b], a, int(docs[a - 1]) if a else 0, n,
                                              ctx.report.kind == "sft")
        if bad_doc >= 0:
            break
    if bad_doc < 0 and int(docs[count - 1]) != n:
        bad_doc = count - 1
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
    count = offsets.shape[0]
    bad = 0 if count == 0 else -1
    for a, b in pack_chunks(count):
        with resident(ctx, (SEQ_IDX_SUFFIX, h.csr_offset + 8 * a, h.csr_offset + 8 * b)):
            bad = _kernels.offset_chain(offsets[a:b], a, int(offsets[a - 1]) if a else 0, h.sequence_count)
        if bad >= 0:
            break
    if bad < 0 and int(offsets[count - 1]) != h.sequence_count:
        bad = count - 1
    if bad >= 0:
        ctx.add("SEQ_IDX_OFFSETS", f"seq_offsets[{bad}] is {int(offsets[bad])}: offsets must start at 0, "
                f"increase strictly and end at {h.sequence_count}", SEQ_IDX_SUFFIX,
                pack=min(bad, h.pack_count - 1), offset=h.csr_offset + POINTER_DTYPE.itemsize * bad)
        return
    ctx.offsets_ok = True


# --------------------------------------------------------------------------- sources (format 1.2)


def check_sources(ctx: ShardContext) -> None:
    """Every sequence's source id names a source of the metadata, and each source's recorded
    sequence count is the number of ids naming it (a chunk of ids resident at a time)."""
    h, meta = ctx.seq_header, ctx.metadata
    if h is None or not h.has_sources or meta is None or meta.sources is None:
        return
    ids = ctx.view(SEQ_IDX_SUFFIX, SOURCE_DTYPE, h.sequence_count, h.sources_offset)
    n = len(meta.sources)
    counts = np.zeros(MAX_SOURCES + 1, dtype=np.int64)
    for a in range(0, h.sequence_count, _SOURCE_CHUNK):
        b = min(h.sequence_count, a + _SOURCE_CHUNK)
        with resident(ctx, (SEQ_IDX_SUFFIX, h.sources_offset + 2 * a, h.sources_offset + 2 * b)):
            chunk = np.asarray(ids[a:b])
            counts += np.bincount(chunk, minlength=counts.size)
            if int(chunk.max()) >= n:
                bad = a + int(np.flatnonzero(chunk >= n)[0])
                ctx.add("SOURCE_ID_OUT_OF_RANGE", f"sequence {bad}'s source id is {int(ids[bad])}; the metadata names "
                        f"{n} sources", SEQ_IDX_SUFFIX, offset=h.sources_offset + SOURCE_DTYPE.itemsize * bad)
                return
    for j, src in enumerate(meta.sources):
        if int(counts[j]) != src.sequences:
            ctx.add("SOURCES_MISMATCH", f"sources[{j}] ({src.name!r}) records {src.sequences} sequences; "
                    f"{int(counts[j])} source ids name it", SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)
            return


#: Source ids checked (and resident) at a time.
_SOURCE_CHUNK = 1 << 22


# --------------------------------------------------------------------------- packs


def scan(ctx: ShardContext, vocab_size: Optional[int]) -> None:
    """Every pack's invariants, all-zero loss masks, and the statistics recorded in the metadata,
    a chunk of whole packs at a time (its index entries, tokens, loss mask and starts)."""
    h, sh = ctx.idx_header, ctx.seq_header
    itemsize = h.dtype.itemsize
    lengths, pointers, offsets = ctx.lengths(), ctx.pointers(), ctx.seq_offsets()
    tokens, loss, starts = ctx.tokens(), ctx.loss(), ctx.seq_starts()
    n = h.sequence_count
    agg = ScanAggregate(ctx, vocab_size)
    for first, last in data_chunks(pointers, lengths, itemsize, n):
        t0 = int(pointers[first]) // itemsize
        t1 = int(pointers[last - 1]) // itemsize + int(lengths[last - 1])
        s0, s1 = int(offsets[first]), int(offsets[last])
        with resident(ctx, (IDX_SUFFIX, h.lengths_offset + 4 * first, h.lengths_offset + 4 * last),
                      (IDX_SUFFIX, h.pointers_offset + 8 * first, h.pointers_offset + 8 * last),
                      (SEQ_IDX_SUFFIX, sh.csr_offset + 8 * first, sh.csr_offset + 8 * (last + 1)),
                      (BIN_SUFFIX, t0 * itemsize, t1 * itemsize), (LOSS_SUFFIX, t0, t1),
                      (SEQ_BIN_SUFFIX, s0 * SEQ_DTYPE.itemsize, s1 * SEQ_DTYPE.itemsize)):
            local = pointers[first:last] // itemsize - t0
            agg.scan(first, lengths[first:last], local, t0, offsets[first:last + 1], tokens[t0:t1], loss[t0:t1],
                     starts)
    agg.report(_TokenOffsets(pointers, itemsize), n, int(starts.shape[0]), int(tokens.shape[0]))
    ctx.release_all()  # the pages bisecting and the findings touched


def data_chunks(pointers, lengths, itemsize: int, n: int, chunk_tokens: Optional[int] = None,
                chunk_packs: Optional[int] = None) -> Iterator[Tuple[int, int]]:
    """``[first, last)`` pack ranges of at most ``chunk_packs`` packs and about ``chunk_tokens``
    tokens (at least one pack; defaults ``CHUNK_PACKS``, ``CHUNK_TOKENS``), found by bisecting
    the (verified, increasing) pointers."""
    chunk_tokens, chunk_packs = chunk_tokens or CHUNK_TOKENS, chunk_packs or CHUNK_PACKS
    first = 0
    while first < n:
        t0 = int(pointers[first]) // itemsize
        last = int(np.searchsorted(pointers, (t0 + chunk_tokens) * itemsize, "right")) - 1
        last = min(max(last, first + 1), first + chunk_packs, n)
        yield first, last
        first = last


class _TokenOffsets:
    """``token_offsets[i]`` of any pack, computed on demand from the mapped pointers."""

    def __init__(self, pointers, itemsize: int) -> None:
        self.pointers, self.itemsize = pointers, itemsize

    def __getitem__(self, i: int) -> int:
        return int(self.pointers[int(i)]) // self.itemsize


class Shifted:
    """``offsets[i]`` for a global pack ``i``, from a chunk's local array (for finding messages)."""

    def __init__(self, local: np.ndarray, first: int, base: int) -> None:
        self.local, self.first, self.base = local, first, base

    def __getitem__(self, i: int):
        return int(self.local[int(i) - self.first]) + self.base


class ScanAggregate:
    """Findings and statistics of a pack scan done in chunks, combined as one whole-shard scan
    reports them: the total of invariant violations first (when some are not listed), the
    first ``MAX_PACK_FINDINGS`` violations, the all-zero loss masks, then the statistics.
    Findings quote the bytes of their chunk, so they are worded while the chunk is at hand."""

    def __init__(self, ctx: ShardContext, vocab_size: Optional[int]) -> None:
        meta = ctx.metadata
        self.ctx, self.vocab = ctx, vocab_size
        self.pack_size = (meta.pack_size or 0) if meta else 0
        self.pad = meta.pad_seq_to_mult if meta is not None else 1
        self.layout = meta.pad_layout if meta is not None else PAD_LAYOUT_STORED
        self.dtype_max = int(np.iinfo(ctx.idx_header.dtype.numpy).max)
        self.findings: List[tuple] = []
        self.first_rule = None
        self.counts = np.zeros(_kernels.N_RULES, np.int64)
        self.stats = [0, 0, _INT64_MAX, 0, 0, _INT64_MAX, 0]
        self.min_runtime = _INT64_MAX
        self.zero: List[int] = []
        self.zero_count = 0

    def scan(self, first: int, lengths, local_offsets, t0: int, seq_offsets, tokens, loss, starts) -> None:
        """Packs ``[first, first + len(lengths))``: ``local_offsets`` index ``tokens``/``loss``
        (the chunk, starting at global token ``t0``); ``seq_offsets`` (global) index ``starts``."""
        cap = MAX_PACK_FINDINGS
        out = (np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64))
        result = _kernels.scan_packs(lengths, local_offsets, seq_offsets, tokens, loss, starts, self.pack_size,
                                     self.dtype_max, self.vocab or 0, self.pad, 0, lengths.shape[0], cap, *out,
                                     self.counts, pad_offset(self.layout))
        for k in range(int(result[0])):
            if len(self.findings) < cap:
                rule = Rule(int(out[0][k]))
                self.first_rule = rule if self.first_rule is None else self.first_rule
                self.findings.append(_rule_finding(
                    self.ctx, rule, first + int(out[1][k]), int(out[2][k]), Shifted(local_offsets, first, t0),
                    Shifted(seq_offsets, first, 0), self.vocab, f"{self.pad}, pad_layout {self.layout}",
                    tokens=Shifted(tokens, t0, 0), loss=Shifted(loss, t0, 0)))
        s = self.stats
        s[1], s[2] = max(s[1], int(result[1])), min(s[2], int(result[2]))
        s[3] += int(result[3])
        s[4], s[5], s[6] = max(s[4], int(result[4])), min(s[5], int(result[5])), max(s[6], int(result[6]))
        if lengths.shape[0]:
            runtime = lengths.astype(np.int64) - np.diff(np.asarray(seq_offsets, dtype=np.int64))
            self.min_runtime = min(self.min_runtime, int(runtime.min()))
        zero = np.zeros(cap, np.int64)
        count = int(_kernels.zero_loss_packs(lengths, local_offsets, loss, cap, zero))
        self.zero += [first + int(i) for i in zero[:max(0, min(count, cap - len(self.zero)))]]
        self.zero_count += count

    def report(self, token_offsets, n: int, n_seq: int, n_tok: int) -> None:
        ctx, cap = self.ctx, MAX_PACK_FINDINGS
        total = int(self.counts.sum())
        if total > len(self.findings):  # the total first, so a shortened listing still shows it
            per_rule = ", ".join(f"{RULE_CODES[Rule(r)]}: {int(c)}" for r, c in enumerate(self.counts) if c)
            ctx.add(RULE_CODES[self.first_rule], f"{total} packs break an invariant in total, only the first "
                    f"{len(self.findings)} are listed ({per_rule})", severity=ERROR)
        for code, text, suffix, pack, offset in self.findings:
            ctx.add(code, text, suffix, pack=pack, offset=offset)
        if self.zero_count > cap:
            ctx.add("ZERO_LOSS_PACK", f"{self.zero_count} of {n} packs have an all-zero loss mask; the first "
                    f"{cap} are listed", LOSS_SUFFIX)
        lengths = ctx.lengths()
        for i in self.zero:
            ctx.add("ZERO_LOSS_PACK", f"the loss mask is 0 at all {int(lengths[i])} positions", LOSS_SUFFIX,
                    pack=i, offset=int(token_offsets[i]))
        if not self.counts.any() and ctx.metadata is not None:
            self.stats[0] = len(self.findings)
            _compare_stats(ctx, self.stats, n, n_seq, n_tok, self.min_runtime if n else 0)


def _rule_finding(ctx, rule: Rule, i: int, pos: int, token_offsets, offsets, vocab_size, pad, *,
                  tokens, loss) -> tuple:
    """``(code, message, suffix, pack, offset)`` of pack ``i`` breaking ``rule`` at ``pos``."""
    itemsize = ctx.idx_header.dtype.itemsize
    t0, s0 = int(token_offsets[i]), int(offsets[i])
    text = rule.describe
    if rule in (Rule.PACK_EMPTY, Rule.PACK_TOO_LONG):
        suffix, offset = IDX_SUFFIX, ctx.idx_header.lengths_offset + LENGTH_DTYPE.itemsize * i
        text += f" (packed_len {int(ctx.lengths()[i])}, pack_size {getattr(ctx.metadata, 'pack_size', None)})"
    elif rule in (Rule.LOSS_VALUE, Rule.LOSS_ON_LAST, Rule.LENGTH_MISMATCH):
        suffix, offset = LOSS_SUFFIX, t0 + pos
        text += f" (position {pos} of the pack holds {int(loss[t0 + pos])})"
    elif rule in (Rule.TOKEN_NEGATIVE, Rule.TOKEN_TOO_LARGE, Rule.TOKEN_OUT_OF_VOCAB):
        suffix, offset = BIN_SUFFIX, (t0 + pos) * itemsize
        text += f" (position {pos} holds id {int(tokens[t0 + pos])}; vocab_size {vocab_size})"
    else:
        suffix, offset = SEQ_BIN_SUFFIX, (s0 + pos) * SEQ_DTYPE.itemsize
        starts = ctx.seq_starts()[s0:int(offsets[i + 1])]
        shown = ", ".join(str(int(v)) for v in starts[:8]) + (", ..." if starts.shape[0] > 8 else "")
        text += f" (seq_start_id [{shown}], packed_len {int(ctx.lengths()[i])}"
        text += f", pad multiple {pad})" if rule == Rule.SEQ_NOT_PAD_MULTIPLE else ")"
    return RULE_CODES[rule], text, suffix, i, offset


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
    itemsize = h.dtype.itemsize
    dtype_max = int(np.iinfo(h.dtype.numpy).max)
    tokens = ctx.tokens()
    rule, pos = int(Rule.OK), -1
    for a, b in pack_chunks(tokens.shape[0], CHUNK_TOKENS):
        with resident(ctx, (BIN_SUFFIX, a * itemsize, b * itemsize)):
            rule, pos = _kernels.first_bad_token(tokens[a:b], dtype_max, vocab_size or 0)
        if rule != int(Rule.OK):
            pos += a
            break
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
