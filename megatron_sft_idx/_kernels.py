"""numba kernels: offset accumulation and the per-pack invariant checks.

Every loop over packs or tokens in the project lives here, compiled with
``cache=True`` so a process compiles each signature at most once per machine.
Kernels never raise: they return a rule number (:class:`format.Rule`) and a
position, and the Python caller turns that into the project's error with the
file, pack and field named. Importing this module is what imports numba; the
reader imports it only when asked to validate.

A kernel's answer must depend on its arguments' values only, never on which
specialisation an earlier call compiled: numba types a Python int as int64, or
as uint64 when it does not fit, and reuses an existing int64 specialisation for
a later uint64 argument (or raises OverflowError converting it). So every public
kernel is a thin Python wrapper that passes each scalar as an ``np.int64`` (the
format's limits keep every value in range; ``np.int64`` raises OverflowError
rather than wrap if a caller ever passes one that is not). Arrays are typed by
their dtype, which the bytes determine.
"""

from __future__ import annotations

import numpy as np

from ._numba import numba
from .format import Rule

_OK = int(Rule.OK)
_PACK_EMPTY = int(Rule.PACK_EMPTY)
_PACK_TOO_LONG = int(Rule.PACK_TOO_LONG)
_LENGTH_MISMATCH = int(Rule.LENGTH_MISMATCH)
_LOSS_VALUE = int(Rule.LOSS_VALUE)
_LOSS_ON_LAST = int(Rule.LOSS_ON_LAST)
_SEQ_NONE = int(Rule.SEQ_NONE)
_SEQ_FIRST_NOT_ZERO = int(Rule.SEQ_FIRST_NOT_ZERO)
_SEQ_NOT_INCREASING = int(Rule.SEQ_NOT_INCREASING)
_SEQ_START_OUT_OF_RANGE = int(Rule.SEQ_START_OUT_OF_RANGE)
_SEQ_NOT_PAD_MULTIPLE = int(Rule.SEQ_NOT_PAD_MULTIPLE)
_TOKEN_NEGATIVE = int(Rule.TOKEN_NEGATIVE)
_TOKEN_TOO_LARGE = int(Rule.TOKEN_TOO_LARGE)
_TOKEN_OUT_OF_VOCAB = int(Rule.TOKEN_OUT_OF_VOCAB)
N_RULES = len(Rule)

_INT64_MAX = np.iinfo(np.int64).max

_jit = numba.njit(cache=True, nogil=True)
_i64 = np.int64


@_jit
def _exclusive_cumsum(values, scale, start):
    """``out[i] = start + scale * sum(values[:i])`` in int64, plus the running end (int32 values).

    Returns ``(out, end, bad)`` where ``bad`` is the first index whose value is
    <= 0 or whose addition would overflow int64, or -1 when all is well. Used
    for lengths -> byte pointers (``scale`` = itemsize) and counts -> CSR
    offsets (``scale`` = 1), a block at a time so memory stays flat.
    """
    n = values.shape[0]
    out = np.empty(n, dtype=np.int64)
    acc = np.int64(start)
    limit = _INT64_MAX
    for i in range(n):
        out[i] = acc
        v = np.int64(values[i])
        step = v * scale  # values are int32 and scale <= 8: the product cannot overflow int64
        if v <= 0 or acc > limit - step:  # a compare, not a division per element
            return out, acc, i
        acc += step
    return out, acc, -1


def exclusive_cumsum(values, scale, start):
    """See ``_exclusive_cumsum``; scalars always reach numba as int64."""
    return _exclusive_cumsum(values, _i64(scale), _i64(start))


@_jit
def _all_within(values, low, high):
    """True when every value is in [low, high]. Branch-free min/max reduction, so LLVM
    vectorises it (~10x the branchy scan); the caller locates a violation only on failure."""
    n = values.shape[0]
    if n == 0:
        return True
    mx = values[0]
    mn = values[0]
    for j in range(n):
        v = values[j]
        mx = v if v > mx else mx
        mn = v if v < mn else mn
    return np.int64(mn) >= low and np.int64(mx) <= high


@_jit
def _check_tokens(ids, dtype_max, vocab_size):
    """First bad token: (rule, position) or (OK, -1). vocab_size <= 0 means unknown."""
    limit = dtype_max if vocab_size <= 0 else min(dtype_max, vocab_size - 1)
    if _all_within(ids, 0, limit):
        return _OK, -1
    for j in range(ids.shape[0]):
        t = np.int64(ids[j])
        if t < 0:
            return _TOKEN_NEGATIVE, j
        if t > dtype_max:
            return _TOKEN_TOO_LARGE, j
        if vocab_size > 0 and t >= vocab_size:
            return _TOKEN_OUT_OF_VOCAB, j
    return _OK, -1


@_jit
def _check_layout(n_tokens, loss, starts, pack_size, pad_mult, pad_offset):
    """Checks that need no token values: lengths, loss values, sequence starts.

    Returns ``(rule, position, max_seqlen, min_seqlen, loss_sum)``; position is a
    token index for loss rules and an index into ``starts`` for sequence rules.
    ``pad_offset`` is 0 for the "stored" padding layout (length % pad_mult == 0) and 1
    for "runtime" ((length - 1) % pad_mult == 0).
    """
    if n_tokens <= 0:
        return _PACK_EMPTY, 0, 0, 0, 0
    if pack_size > 0 and n_tokens > pack_size:
        return _PACK_TOO_LONG, n_tokens, 0, 0, 0
    if loss.shape[0] != n_tokens:
        return _LENGTH_MISMATCH, loss.shape[0], 0, 0, 0
    n_seq = starts.shape[0]
    if n_seq == 0:
        return _SEQ_NONE, 0, 0, 0, 0
    if starts[0] != 0:
        return _SEQ_FIRST_NOT_ZERO, 0, 0, 0, 0
    max_len = 0
    min_len = n_tokens
    for k in range(n_seq):
        begin = np.int64(starts[k])
        if k + 1 < n_seq:
            end = np.int64(starts[k + 1])
            if end <= begin:
                return _SEQ_NOT_INCREASING, k + 1, 0, 0, 0
            if end >= n_tokens:
                return _SEQ_START_OUT_OF_RANGE, k + 1, 0, 0, 0
        else:
            end = np.int64(n_tokens)
        seqlen = end - begin
        if pad_mult > 1 and (seqlen - pad_offset) % pad_mult != 0:
            return _SEQ_NOT_PAD_MULTIPLE, k, 0, 0, 0
        if seqlen > max_len:
            max_len = seqlen
        if seqlen < min_len:
            min_len = seqlen
    # Sum and OR in one vectorisable pass; any value outside {0, 1} leaves a bit above bit 0.
    loss_sum = 0
    bits = 0
    for j in range(n_tokens):
        v = loss[j]
        loss_sum += v
        bits |= v
    if bits < 0 or bits > 1:
        for j in range(n_tokens):
            v = np.int64(loss[j])
            if v != 0 and v != 1:
                return _LOSS_VALUE, j, 0, 0, 0
    # Label-aligned: position end-1 of each sequence has no next token in that sequence.
    for k in range(n_seq):
        last = (np.int64(starts[k + 1]) if k + 1 < n_seq else np.int64(n_tokens)) - 1
        if loss[last] != 0:
            return _LOSS_ON_LAST, last, 0, 0, 0
    return _OK, -1, max_len, min_len, loss_sum


@_jit
def _check_pack(ids, loss, starts, pack_size, dtype_max, vocab_size, pad_mult, pad_offset):
    """All invariants of one pack. Returns ``(rule, position, max_seqlen, min_seqlen, loss_sum)``."""
    result = _check_layout(ids.shape[0], loss, starts, pack_size, pad_mult, pad_offset)
    if result[0] != _OK:
        return result
    rule, pos = _check_tokens(ids, dtype_max, vocab_size)
    if rule != _OK:
        return rule, pos, 0, 0, 0
    return result


def check_pack(ids, loss, starts, pack_size, dtype_max, vocab_size, pad_mult, pad_offset=0):
    """See ``_check_pack``; scalars always reach numba as int64."""
    return _check_pack(ids, loss, starts, _i64(pack_size), _i64(dtype_max), _i64(vocab_size), _i64(pad_mult),
                       _i64(pad_offset))


@_jit
def max_token(ids):
    """Largest id in a block (-1 for an empty block); used when widening uint16 -> int32."""
    best = np.int64(-1)
    for j in range(ids.shape[0]):
        t = np.int64(ids[j])
        if t > best:
            best = t
    return best


@_jit
def _scan_packs(lengths, token_offsets, seq_offsets, tokens, loss, starts,
                pack_size, dtype_max, vocab_size, pad_mult, first, last,
                max_findings, out_rule, out_pack, out_pos, rule_counts, pad_offset):
    """Check packs ``[first, last)`` of a whole shard.

    ``token_offsets[i]`` is pack i's first element in ``tokens``/``loss`` (already
    checked to be in bounds by the caller's structural pass). Records up to
    ``max_findings`` findings into the ``out_*`` arrays, counts every violation
    per rule in ``rule_counts`` and returns the number recorded. Also returns
    the aggregate statistics of the range for comparison with the metadata:
    ``(n_recorded, max_seqlen, min_seqlen, loss_sum, max_samples, min_packed, max_packed)``.
    """
    n_rec = 0
    max_seqlen = 0
    min_seqlen = _INT64_MAX
    loss_sum = 0
    max_samples = 0
    min_packed = _INT64_MAX
    max_packed = 0
    for i in range(first, last):
        n = np.int64(lengths[i])
        t0 = np.int64(token_offsets[i])
        s0 = np.int64(seq_offsets[i])
        s1 = np.int64(seq_offsets[i + 1])
        res = _check_layout(n, loss[t0:t0 + n], starts[s0:s1], pack_size, pad_mult, pad_offset)
        rule = res[0]
        pos = res[1]
        if rule == _OK:
            rule, pos = _check_tokens(tokens[t0:t0 + n], dtype_max, vocab_size)
        if rule != _OK:
            rule_counts[rule] += 1
            if n_rec < max_findings:
                out_rule[n_rec] = rule
                out_pack[n_rec] = i
                out_pos[n_rec] = pos
                n_rec += 1
            continue
        if res[2] > max_seqlen:
            max_seqlen = res[2]
        if res[3] < min_seqlen:
            min_seqlen = res[3]
        loss_sum += res[4]
        if s1 - s0 > max_samples:
            max_samples = s1 - s0
        if n < min_packed:
            min_packed = n
        if n > max_packed:
            max_packed = n
    return n_rec, max_seqlen, min_seqlen, loss_sum, max_samples, min_packed, max_packed


def scan_packs(lengths, token_offsets, seq_offsets, tokens, loss, starts, pack_size, dtype_max, vocab_size,
               pad_mult, first, last, max_findings, out_rule, out_pack, out_pos, rule_counts, pad_offset=0):
    """See ``_scan_packs``; scalars always reach numba as int64."""
    return _scan_packs(lengths, token_offsets, seq_offsets, tokens, loss, starts, _i64(pack_size),
                       _i64(dtype_max), _i64(vocab_size), _i64(pad_mult), _i64(first), _i64(last),
                       _i64(max_findings), out_rule, out_pack, out_pos, rule_counts, _i64(pad_offset))


@_jit
def _pointer_chain(lengths, pointers, itemsize, limit, expected):
    """Structural check of (a chunk of) an ``.idx``: pointers must be the exclusive cumsum of
    lengths × itemsize, the first one equal to ``expected`` (0 for a whole index; where the
    previous chunk ended for the next), every pack inside ``limit`` bytes.

    Returns ``(index, kind, end)``: the chunk-local index and kind of the first problem
    (kind 1: length <= 0, 2: pointer disagrees, 3: pack runs past ``limit``) or ``(-1, 0)``,
    and the byte where the next pack must start.
    """
    for i in range(lengths.shape[0]):
        n = np.int64(lengths[i])
        if n <= 0:
            return i, 1, expected
        if np.int64(pointers[i]) != expected:
            return i, 2, expected
        if n > (limit - expected) // itemsize:
            return i, 3, expected
        expected += n * itemsize
    return -1, 0, expected


def pointer_chain(lengths, pointers, itemsize, limit, expected):
    """See ``_pointer_chain``; scalars always reach numba as int64."""
    return _pointer_chain(lengths, pointers, _i64(itemsize), _i64(limit), _i64(expected))


def first_pointer_mismatch(lengths, pointers, itemsize, limit):
    """``(index, kind)`` of the first problem of a whole index's pointers (``_pointer_chain`` from 0)."""
    bad, kind, _ = pointer_chain(lengths, pointers, itemsize, limit, 0)
    return bad, kind


@_jit
def _offset_chain(offsets, first, previous, total):
    """CSR offsets ``[first, first + len)``: [0] == 0, strictly increasing (from ``previous``,
    the entry before the chunk), at most ``total``. Returns the first bad global index, or -1."""
    for j in range(offsets.shape[0]):
        i = first + j
        value = offsets[j]
        if i == 0:
            if value != 0:
                return 0
        elif value <= previous or value > total:
            return i
        previous = value
    return -1


def offset_chain(offsets, first, previous, total):
    """See ``_offset_chain``; scalars always reach numba as int64."""
    return _offset_chain(offsets, _i64(first), _i64(previous), _i64(total))


def first_offset_mismatch(offsets, total):
    """CSR offsets: [0] == 0, strictly increasing, last == total. Returns first bad index or -1."""
    n = offsets.shape[0]
    if n == 0:
        return 0
    bad = offset_chain(offsets, 0, 0, total)
    if bad >= 0:
        return bad
    return n - 1 if offsets[n - 1] != total else -1


# ---- gate kernels (used by megatron_sft_idx.gate; appended, the kernels above are unchanged)


@_jit
def _document_chain(documents, first, previous, n_sequences, one_per_sequence):
    """``document_indices`` ``[first, first + len)``: [0] == 0, non-decreasing (from ``previous``,
    the entry before the chunk), at most ``n_sequences``; with ``one_per_sequence`` (SFT shards:
    one document per pack) every entry equals its index. Returns the first bad global index, or -1.
    """
    for j in range(documents.shape[0]):
        i = first + j
        d = np.int64(documents[j])
        if i == 0:
            if d != 0:
                return 0
        elif (one_per_sequence and d != i) or d < previous or d > n_sequences:
            return i
        previous = d
    return -1


def document_chain(documents, first, previous, n_sequences, one_per_sequence):
    """See ``_document_chain``; scalars always reach numba as int64."""
    return _document_chain(documents, _i64(first), _i64(previous), _i64(n_sequences), bool(one_per_sequence))


def first_document_mismatch(documents, n_sequences, one_per_sequence):
    """Every rule of ``_document_chain`` over a whole array, and the last entry == ``n_sequences``."""
    n = documents.shape[0]
    if n == 0:
        return 0
    bad = document_chain(documents, 0, 0, n_sequences, one_per_sequence)
    if bad >= 0:
        return bad
    return n - 1 if documents[n - 1] != n_sequences else -1


@_jit
def _zero_loss_packs(lengths, token_offsets, loss, max_out, out):
    """Packs whose loss mask is all zero (nothing to train on).

    Stops reading a pack at its first non-zero value, so a normal shard costs
    far less than a full pass. Records up to ``max_out`` pack indices in
    ``out`` and returns the total count.
    """
    count = 0
    for i in range(lengths.shape[0]):
        t0 = np.int64(token_offsets[i])
        t1 = t0 + np.int64(lengths[i])
        empty = True
        for j in range(t0, t1):
            if loss[j] != 0:
                empty = False
                break
        if empty:
            if count < max_out:
                out[count] = i
            count += 1
    return count


def zero_loss_packs(lengths, token_offsets, loss, max_out, out):
    """See ``_zero_loss_packs``; scalars always reach numba as int64."""
    return _zero_loss_packs(lengths, token_offsets, loss, _i64(max_out), out)


@_jit
def _first_bad_token(ids, dtype_max, vocab_size):
    """Token range of a whole ``.bin`` (pretrain shards): ``(rule, position)`` or ``(OK, -1)``."""
    return _check_tokens(ids, dtype_max, vocab_size)


def first_bad_token(ids, dtype_max, vocab_size):
    """See ``_first_bad_token``; scalars always reach numba as int64."""
    return _first_bad_token(ids, _i64(dtype_max), _i64(vocab_size))


# ---- shard tools kernels (merge, inspect; appended)


@_jit
def sequence_lengths_of(lengths, seq_offsets, starts, out):
    """Every sequence's length into ``out`` (``seq_offsets[-1] - seq_offsets[0]`` entries)."""
    base = np.int64(seq_offsets[0])
    for i in range(lengths.shape[0]):
        s0 = np.int64(seq_offsets[i])
        s1 = np.int64(seq_offsets[i + 1])
        for k in range(s0, s1):
            end = np.int64(starts[k + 1]) if k + 1 < s1 else np.int64(lengths[i])
            out[k - base] = end - np.int64(starts[k])


@_jit
def segment_sums(values, offsets, out):
    """``out[i] = sum(values[offsets[i]:offsets[i+1]])`` (e.g. trained positions per pack)."""
    for i in range(out.shape[0]):
        acc = np.int64(0)
        for j in range(np.int64(offsets[i]), np.int64(offsets[i + 1])):
            acc += values[j]
        out[i] = acc
