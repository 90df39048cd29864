"""Streaming, atomic writer of five-file shards.

``IndexedDatasetBuilder`` extends the idea of megatron-core's builder of the
same name to packed SFT data: tokens, loss mask and sequence starts stream to
temporary files as packs arrive; per-pack lengths and sequence counts live in
compact int32 blocks (8 bytes per pack); ``finalize()`` computes the byte
pointers and CSR offsets with numba, writes both indexes and publishes all five
files with ``.idx`` last. Example::

    with IndexedDatasetBuilder("/data/train_000", pack_size=4096, vocab_size=32000) as b:
        for ids, mask, starts in packs:
            b.add_packed(ids, mask, starts)
    # /data/train_000.{bin,idx,loss.bin,seq.idx,seq.bin} now exist, or none of them do.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Iterator, Mapping, Optional

import numpy as np

from . import _atomic, _kernels, publishing
from ._crc import crc32
from .errors import BuilderStateError, InvariantError, ShardError
from .format import (
    BIN_SUFFIX,
    IDX_SUFFIX,
    LOSS_SUFFIX,
    METADATA_FIELD_RANGES,
    METADATA_OFFSET,
    POINTER_DTYPE,
    PUBLISH_ORDER,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_HEADER_SIZE,
    SEQ_IDX_SOURCES_VERSION,
    SEQ_IDX_SUFFIX,
    SEQ_IDX_VERSION,
    SOURCE_DTYPE,
    TOKEN_DTYPES,
    UINT16_MAX,
    FLAG_SOURCES,
    DType,
    IdxHeader,
    Rule,
    SeqIdxHeader,
    ShardPaths,
    choose_token_dtype,
)
from .metadata import FileDigest, PackingStats, ShardMetadata, ShardSet, ShardSource, split_user_metadata
from .packing.padding import pad_offset
from .version import __version__

_BLOCK = 1 << 16          # entries per int32 block of per-pack buffers
_COPY_CHUNK = 1 << 24     # elements per chunk when streaming a whole file
_INT32_MAX = int(np.iinfo(np.int32).max)
_SEQ_NP = SEQ_DTYPE.numpy
_SOURCES_SPILL = ".src"   # the source ids while a shard is written (a temporary only: they end in .seq.idx)


class _Int32Blocks:
    """An append-only int32 sequence in fixed-size numpy blocks: 4 bytes per entry,
    no reallocation copies, at most one partly-filled block of slack."""

    def __init__(self) -> None:
        self._blocks = [np.empty(_BLOCK, dtype=np.int32)]
        self._fill = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, value: int) -> None:
        if self._fill == _BLOCK:
            self._blocks.append(np.empty(_BLOCK, dtype=np.int32))
            self._fill = 0
        self._blocks[-1][self._fill] = value
        self._fill += 1
        self._len += 1

    def extend(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int32)
        while values.size:
            if self._fill == _BLOCK:
                self._blocks.append(np.empty(_BLOCK, dtype=np.int32))
                self._fill = 0
            take = min(_BLOCK - self._fill, values.size)
            self._blocks[-1][self._fill:self._fill + take] = values[:take]
            self._fill += take
            self._len += take
            values = values[take:]

    def blocks(self) -> Iterator[np.ndarray]:
        for block in self._blocks[:-1]:
            yield block
        yield self._blocks[-1][:self._fill]


class _CrcWriter:
    """A binary file that keeps the CRC-32 and size of everything written to it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "wb")  # default buffering measured fastest (bench/)
        self.crc = 0
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc = crc32(view, self.crc)
        self.size += view.nbytes

    def close(self) -> None:
        if not self.file.closed:
            self.file.flush()
            self.file.close()

    @property
    def digest(self) -> FileDigest:
        return FileDigest(size=self.size, crc32=self.crc)


def _int_array(values, name: str, pack: int, allow_bool: bool = False) -> np.ndarray:
    """Coerce a pack field to a 1-D int64 array, refusing floats, objects and N-d input."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InvariantError(f"{name} must be one-dimensional", pack=pack, field=name,
                             expected="1-D", actual=f"{arr.ndim}-D shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "b" and allow_bool:
        return arr.astype(np.int64)
    if kind not in "iu":
        raise InvariantError(f"{name} must hold integers", pack=pack, field=name,
                             expected="integer dtype", actual=str(arr.dtype))
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise InvariantError(f"{name} holds a value beyond int64", pack=pack, field=name,
                             rule=Rule.TOKEN_TOO_LARGE.name)
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int_view(values, name: str, pack: int) -> np.ndarray:
    """A 1-D integer array without converting its dtype (no copy for a contiguous one);
    bools are viewed as uint8. The numba scan reads any integer dtype."""
    arr = np.asarray(values)
    if arr.dtype.kind == "b":
        arr = arr.view(np.uint8)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvariantError(f"{name} must be a one-dimensional integer array", pack=pack, field=name,
                             expected="1-D integers", actual=f"{arr.ndim}-D {arr.dtype}")
    if arr.dtype == np.uint64:  # the kernels compare in int64
        return _int_array(arr, name, pack)
    return np.ascontiguousarray(arr)


class IndexedDatasetBuilder:
    """Write one shard, streaming, and publish it atomically.

    Args:
        prefix: the shard's path without suffix; parent directories are created.
        dtype: token dtype, ``numpy.uint16`` or ``numpy.int32``. ``None`` picks
            uint16 when ``vocab_size`` fits it, else int32; with neither given the
            builder starts with uint16 and widens once to int32 if an id needs it.
        vocab_size: when given, every token id must be ``< vocab_size``.
        pack_size: when given, every pack must hold at most this many tokens.
        metadata: extra shard metadata: ``pad_seq_to_mult`` (enforced on every
            sequence), ``tokenizer``, ``packing``, ``parallelism``, ``source``, ``set``;
            other keys are kept under ``extra``.
        overwrite: replace an existing shard at ``prefix`` (otherwise refused). The five files
            are published by :func:`megatron_sft_idx.publishing.commit_shard` (``.idx`` last).

    Raises:
        ShardExistsError: a shard exists at ``prefix`` and ``overwrite`` is false.
        ShardError: an argument is invalid.
    """

    def __init__(self, prefix, dtype=None, vocab_size: Optional[int] = None,
                 pack_size: Optional[int] = None, metadata: Optional[Mapping[str, Any]] = None,
                 *, overwrite: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.paths = ShardPaths.from_prefix(self.prefix)
        for name, value in (("pack_size", pack_size), ("vocab_size", vocab_size)):
            low, high = METADATA_FIELD_RANGES[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or not low <= value <= high):
                raise ShardError(f"{name} must be an integer in {low}..{high} or None", field=name,
                                 expected=f"{low}..{high}", actual=value)
        self.pack_size = None if pack_size is None else int(pack_size)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self._user_metadata = split_user_metadata(metadata)
        self._pad_mult = int(self._user_metadata["pad_seq_to_mult"])
        self._pad_offset = pad_offset(self._user_metadata["pad_layout"])
        self._auto_dtype = dtype is None and self.vocab_size is None
        if dtype is None:
            self.dtype = choose_token_dtype(None if self.vocab_size is None else self.vocab_size - 1)
            if self._auto_dtype:
                self.dtype = DType.uint16
        else:
            self.dtype = DType.from_numpy(dtype)
            if self.dtype not in TOKEN_DTYPES:
                raise ShardError("token dtype must be uint16 or int32", field="dtype",
                                 expected=[d.name for d in TOKEN_DTYPES], actual=self.dtype.name)
            if self.vocab_size is not None and self.vocab_size - 1 > self._dtype_max(self.dtype):
                raise ShardError(f"vocab_size {self.vocab_size} does not fit {self.dtype.name}",
                                 field="dtype", expected="int32", actual=self.dtype.name,
                                 hint="use dtype=numpy.int32 or leave dtype=None")
        # Only the .idx (published last) makes a shard; companions without it are the leftovers
        # of an interrupted build, which the next build replaces without being asked to.
        if not overwrite:
            publishing.refuse_existing(publishing.existing_shard(self.prefix, committed=True),
                                       replace_with="overwrite=True")
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        _atomic.clear_stale_temporaries(tuple(self.paths) + (self.prefix + _SOURCES_SPILL,))

        self._tmp = {suffix: _atomic.temporary_path(self.prefix + suffix) for suffix in PUBLISH_ORDER}
        self._bin = _CrcWriter(self._tmp[BIN_SUFFIX])
        self._loss = _CrcWriter(self._tmp[LOSS_SUFFIX])
        self._seq = _CrcWriter(self._tmp[SEQ_BIN_SUFFIX])
        self._lengths = _Int32Blocks()
        self._seq_counts = _Int32Blocks()
        self._tokens = 0
        self._sequences = 0
        self._loss_tokens = 0
        self._max_seqlen = 0
        self._min_seqlen = None
        self._max_samples = 0
        self._min_packed = None
        self._min_runtime = None  # min over packs of packed_len - sequences (Bridge's min_packed_seqlen)
        # format 1.2: each sequence's source (metadata "sources"), spilled to a temporary file
        self._sources = self._user_metadata.get("sources")
        self._source_counts = np.zeros(len(self._sources) if self._sources else 0, dtype=np.int64)
        self._src = _CrcWriter(_atomic.temporary_path(self.prefix + _SOURCES_SPILL)) if self._sources else None
        self._max_packed = 0
        self._state = "open"
        self.metadata: Optional[ShardMetadata] = None
        self._set_dtype(self.dtype)

    # ------------------------------------------------------------------ adding

    @staticmethod
    def _dtype_max(dtype: DType) -> int:
        return int(np.iinfo(dtype.numpy).max)

    def _set_dtype(self, dtype: DType) -> None:
        """Fix the token dtype and the per-pack constants derived from it (hot path)."""
        self.dtype = dtype
        self._token_np = dtype.numpy
        # While the dtype is automatic, ids up to int32 are accepted (uint16 widens on demand).
        self._check_max = _INT32_MAX if self._auto_dtype else self._dtype_max(dtype)

    def __len__(self) -> int:
        return len(self._lengths)

    def _require_open(self) -> None:
        if self._state != "open":
            raise BuilderStateError(f"the builder is {self._state}; no more packs can be added",
                                    path=self.prefix)

    def add_packed(self, input_ids, loss_mask, seq_start_id, source_ids=None) -> int:
        """Append one pack after checking every invariant (:class:`~megatron_sft_idx.format.Rule`).

        ``loss_mask`` is label-aligned (1 at j trains predicting token j+1) and may
        be bool or integer; ``seq_start_id`` lists each sequence's first position.
        ``source_ids`` (a builder whose metadata names ``sources``, and only then): each
        sequence's source, an index into them. Returns the pack's index.

        Raises:
            InvariantError: naming the pack index and the rule; nothing of the pack
                is written and the builder stays usable.
        """
        self._require_open()
        index = len(self._lengths)
        ids = _int_array(input_ids, "input_ids", index)
        loss = _int_array(loss_mask, "loss_mask", index, allow_bool=True)
        starts = _int_array(seq_start_id, "seq_start_id", index)
        sources = self._checked_sources(source_ids, starts.size, index)
        rule, pos, max_len, min_len, loss_sum = _kernels.check_pack(
            ids, loss, starts, self.pack_size or 0, self._check_max, self.vocab_size or 0, self._pad_mult,
            self._pad_offset)
        if rule != Rule.OK:
            raise self._violation(Rule(rule), index, pos, ids, loss, starts)
        if self._auto_dtype and self.dtype == DType.uint16 and int(ids.max()) > UINT16_MAX:
            self._widen_tokens()
        self._bin.write(ids.astype(self._token_np))
        self._loss.write(loss.astype(np.uint8))
        self._seq.write(starts.astype(_SEQ_NP))
        if sources is not None:
            self._src.write(sources.astype(SOURCE_DTYPE))
            self._source_counts += np.bincount(sources, minlength=self._source_counts.size)
        self._record(ids.size, starts.size, loss_sum, max_len, min_len)
        return index

    def _checked_sources(self, source_ids, count: int, index: int) -> Optional[np.ndarray]:
        """``source_ids`` as int64, one per sequence and each naming a source, for a builder that
        records sources (None for one that does not, which takes none).

        Raises:
            InvariantError: missing, given to a builder without sources, of the wrong length, or
                naming no source.
        """
        if not self._sources:
            if source_ids is not None:
                raise InvariantError("source_ids given, but the builder's metadata names no sources", pack=index,
                                     field="source_ids", hint="pass metadata={'sources': [{'name': ...}, ...]}")
            return None
        if source_ids is None:
            raise InvariantError("this builder records each sequence's source: pass source_ids", pack=index,
                                 field="source_ids")
        ids = _int_array(source_ids, "source_ids", index)
        if ids.size != count or (ids.size and (ids.min() < 0 or ids.max() >= len(self._sources))):
            raise InvariantError(f"source_ids must hold one id in [0, {len(self._sources)}) per sequence", pack=index,
                                 field="source_ids", expected=f"{count} ids", actual=ids.tolist()[:8],
                                 hint="fix the pack; the builder is still usable")
        return ids

    def _refuse_without_sources(self, what: str) -> None:
        if self._sources:
            raise BuilderStateError(f"{what} cannot record sources: this builder records each sequence's source; "
                                    "add its packs with add_packed(..., source_ids=...)", path=self.prefix)

    def add_sequences(self, tokens, loss_mask, lengths) -> int:
        """Append many one-sequence packs at once: pack i is ``tokens[o_i:o_i + lengths[i]]``
        (``o`` the running sum of ``lengths``), its ``seq_start_id`` is ``[0]``. Same checks as
        :meth:`add_packed` on every pack, in one numba pass. Returns the first new pack's index.

        Raises:
            InvariantError: naming the first bad pack; nothing of the batch is written.
        """
        self._require_open()
        self._refuse_without_sources("add_sequences")
        first = len(self._lengths)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        ids = _int_array(tokens, "input_ids", first)
        loss = _int_array(loss_mask, "loss_mask", first, allow_bool=True)
        n = lengths.size
        if n == 0:
            return first
        offsets = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        if int(offsets[-1] + lengths[-1]) != ids.size or ids.size != loss.size or int(lengths.min()) < 0:
            raise ShardError("add_sequences: lengths do not add up to the token and loss arrays",
                             path=self.prefix, field="lengths",
                             actual=f"{int(lengths.sum())} vs {ids.size} tokens, {loss.size} loss values")
        starts = np.zeros(n, dtype=np.int64)
        out_rule, out_pack, out_pos = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
        counts = np.zeros(_kernels.N_RULES, np.int64)
        rec, max_len, min_len, loss_sum, max_samples, min_packed, max_packed = _kernels.scan_packs(
            lengths, offsets, np.arange(n + 1, dtype=np.int64), ids, loss, starts, self.pack_size or 0,
            self._check_max, self.vocab_size or 0, self._pad_mult, 0, n, 1, out_rule, out_pack, out_pos, counts,
            self._pad_offset)
        if rec:
            bad = int(out_pack[0])
            a = int(offsets[bad])
            piece = slice(a, a + int(lengths[bad]))
            raise self._violation(Rule(int(out_rule[0])), first + bad, int(out_pos[0]), ids[piece], loss[piece],
                                  starts[:1])
        if self._auto_dtype and self.dtype == DType.uint16 and _kernels.max_token(ids) > UINT16_MAX:
            self._widen_tokens()
        self._bin.write(ids.astype(self._token_np))
        self._loss.write(loss.astype(np.uint8))
        self._seq.write(starts.astype(_SEQ_NP))
        self._lengths.extend(lengths)
        self._seq_counts.extend(np.ones(n, dtype=np.int64))
        self._merge_stats(ids.size, n, int(loss_sum), int(max_len), int(min_len), int(max_samples),
                          int(min_packed), int(max_packed), int(lengths.min()) - 1)
        return first

    def _record(self, n_tokens: int, n_seq: int, loss_sum: int, max_len: int, min_len: int) -> None:
        self._lengths.append(n_tokens)
        self._seq_counts.append(n_seq)
        self._merge_stats(n_tokens, n_seq, loss_sum, max_len, min_len, n_seq, n_tokens, n_tokens,
                          n_tokens - n_seq)

    def _merge_stats(self, tokens: int, sequences: int, loss_sum: int, max_seqlen: int, min_seqlen: int,
                     max_samples: int, min_packed: int, max_packed: int, min_runtime: int) -> None:
        """Fold the statistics of one pack, or of a run of packs, into the shard's."""
        self._tokens += tokens
        self._sequences += sequences
        self._loss_tokens += loss_sum
        self._max_seqlen = max(self._max_seqlen, max_seqlen)
        self._min_seqlen = min_seqlen if self._min_seqlen is None else min(self._min_seqlen, min_seqlen)
        self._max_samples = max(self._max_samples, max_samples)
        self._min_packed = min_packed if self._min_packed is None else min(self._min_packed, min_packed)
        self._max_packed = max(self._max_packed, max_packed)
        self._min_runtime = min_runtime if self._min_runtime is None else min(self._min_runtime, min_runtime)

    def _violation(self, rule: Rule, index: int, pos: int, ids, loss, starts) -> InvariantError:
        field = {Rule.LOSS_VALUE: "loss_mask", Rule.LOSS_ON_LAST: "loss_mask",
                 Rule.LENGTH_MISMATCH: "loss_mask", Rule.TOKEN_NEGATIVE: "input_ids",
                 Rule.TOKEN_TOO_LARGE: "input_ids", Rule.TOKEN_OUT_OF_VOCAB: "input_ids",
                 Rule.PACK_EMPTY: "input_ids", Rule.PACK_TOO_LONG: "input_ids"}.get(rule, "seq_start_id")
        actual = None
        if rule in (Rule.TOKEN_NEGATIVE, Rule.TOKEN_TOO_LARGE, Rule.TOKEN_OUT_OF_VOCAB):
            actual = int(ids[pos])
        elif rule in (Rule.LOSS_VALUE, Rule.LOSS_ON_LAST):
            actual = int(loss[pos])
        elif rule == Rule.LENGTH_MISMATCH:
            actual = f"{len(loss)} loss values for {len(ids)} tokens"
        elif rule == Rule.PACK_TOO_LONG:
            actual = f"packed_len {len(ids)} > pack_size {self.pack_size}"
        elif rule in (Rule.SEQ_FIRST_NOT_ZERO, Rule.SEQ_NOT_INCREASING, Rule.SEQ_START_OUT_OF_RANGE,
                      Rule.SEQ_NOT_PAD_MULTIPLE) and len(starts):
            actual = f"seq_start_id[{pos}] = {int(starts[pos])}"
        limit = {Rule.TOKEN_OUT_OF_VOCAB: f"vocab_size {self.vocab_size}",
                 Rule.TOKEN_TOO_LARGE: f"dtype {self.dtype.name}",
                 Rule.SEQ_NOT_PAD_MULTIPLE: f"multiple {self._pad_mult} "
                                            f"(pad_layout {self._user_metadata['pad_layout']})"}.get(rule)
        where = f" at position {pos}" if pos >= 0 else ""
        return InvariantError(f"pack {index} rejected{where}: {rule.describe}", path=self.prefix,
                              pack=index, field=field, rule=rule.name, expected=limit, actual=actual,
                              hint="fix the pack; the builder is still usable")

    def _widen_tokens(self) -> None:
        """Rewrite the tokens written so far as int32 (once, streaming) and continue in int32."""
        self._bin.close()
        old_path = self._bin.path
        widened = _CrcWriter(_atomic.temporary_path(self.prefix + BIN_SUFFIX))
        old = np.memmap(old_path, dtype=np.uint16, mode="r") if self._bin.size else np.empty(0, np.uint16)
        for start in range(0, old.size, _COPY_CHUNK):
            widened.write(np.asarray(old[start:start + _COPY_CHUNK], dtype=np.int32))
        del old
        os.unlink(old_path)
        self._bin = widened
        self._tmp[BIN_SUFFIX] = widened.path
        self._set_dtype(DType.int32)

    def add_shard(self, prefix) -> None:
        """Append every pack of an existing SFT shard, streaming (memory flat in its size).

        The source is opened with the reader's checks and every pack is
        re-validated against *this* builder's pack_size, vocab_size, dtype and
        pad multiple, a chunk at a time in numba.

        Raises:
            InvariantError: a source pack breaks a rule of this builder (named by
                the source path and the source pack index); packs of the source
                before it have been appended, so discard the builder.
        """
        from .reader import MMapIndexedDataset

        self._require_open()
        self._refuse_without_sources("add_shard")
        src = MMapIndexedDataset(prefix)
        if src.metadata.sources is not None:
            raise ShardError("the shard records its sequences' sources, which add_shard would drop", path=src.prefix,
                             field="sources", hint="merging shards of a mixture is not supported: repack the "
                                                  "mixture (repack-sft --mix) instead")
        if src.is_pretrain:
            raise ShardError("add_shard takes SFT shards; this prefix holds upstream pretrain data "
                             "without a loss mask or sequence starts", path=src.prefix,
                             hint="write its sequences with add_packed and the loss mask you want")
        lengths, offsets = src.sequence_lengths, src.seq_offsets
        pointers = src.sequence_pointers
        itemsize = src.dtype.itemsize
        arrays = src.arrays()
        tokens, loss, starts = arrays.tokens, arrays.loss_mask, arrays.seq_starts
        n = len(src)
        # Chunks are copied as contiguous runs, so the packs validated must be exactly those
        # runs: refuse pointers or CSR offsets that are not the cumulative sums they claim to be.
        bad, _ = _kernels.first_pointer_mismatch(lengths, pointers, itemsize, tokens.size * itemsize)
        bad_csr = _kernels.first_offset_mismatch(offsets, starts.size)
        if bad >= 0 or bad_csr >= 0:
            field = "sequence_pointers/sequence_lengths" if bad >= 0 else "seq_offsets"
            raise InvariantError("source shard index is corrupt: not contiguous cumulative offsets",
                                 path=src.prefix, pack=int(bad if bad >= 0 else bad_csr), field=field,
                                 hint="run tools/check_idx.py on the source and rebuild it")
        first = 0
        while first < n:
            # Chunk by packs so that each chunk's tokens are about _COPY_CHUNK elements.
            t_first = int(pointers[first]) // itemsize
            last = int(np.searchsorted(pointers, (t_first + _COPY_CHUNK) * itemsize, side="left"))
            last = min(max(last, first + 1), n)
            self._add_chunk(src, first, last, lengths, offsets, pointers, tokens, loss, starts)
            first = last

    def _add_chunk(self, src, first, last, lengths, offsets, pointers, tokens, loss, starts) -> None:
        itemsize = src.dtype.itemsize
        t0 = int(pointers[first]) // itemsize
        t1 = int(pointers[last - 1]) // itemsize + int(lengths[last - 1])
        s0, s1 = int(offsets[first]), int(offsets[last])
        token_offsets = np.empty(last - first + 1, dtype=np.int64)
        token_offsets[:-1] = np.asarray(pointers[first:last], dtype=np.int64) // itemsize - t0
        token_offsets[-1] = t1 - t0
        self.add_packs(tokens[t0:t1], loss[t0:t1], starts[s0:s1], token_offsets,
                       np.asarray(offsets[first:last + 1], dtype=np.int64) - s0,
                       source=src.prefix, first_pack=first,
                       hint="this builder's pack_size/vocab_size/dtype/pad multiple is stricter "
                            "than the source shard's")

    def add_packs(self, input_ids, loss_mask, seq_start_id, token_offsets, seq_offsets, *,
                  source: Optional[str] = None, first_pack: int = 0, hint: Optional[str] = None) -> int:
        """Append a run of packs given as flat arrays: pack i is ``input_ids`` and ``loss_mask``
        ``[token_offsets[i]:token_offsets[i+1]]`` and ``seq_start_id[seq_offsets[i]:seq_offsets[i+1]]``.

        The vectorised twin of :meth:`add_packed` (converters feed it thousands of packs at
        once): every invariant is checked in one numba pass before anything is written.
        Returns the number of packs appended.

        Raises:
            InvariantError: a pack breaks a rule, named by ``first_pack`` + its index in the
                run and by ``source`` (the input's path); nothing of the run is written.
        """
        self._require_open()
        self._refuse_without_sources("add_packs")
        label = self.prefix if source is None else str(source)
        token_offsets = np.ascontiguousarray(token_offsets, dtype=np.int64)
        seq_offsets = np.ascontiguousarray(seq_offsets, dtype=np.int64)
        tokens = _int_view(input_ids, "input_ids", first_pack)
        loss = _int_view(loss_mask, "loss_mask", first_pack)
        starts = _int_view(seq_start_id, "seq_start_id", first_pack)
        n = token_offsets.size - 1
        if (n < 1 or seq_offsets.size != n + 1 or token_offsets[0] != 0 or seq_offsets[0] != 0
                or token_offsets[-1] != tokens.size or seq_offsets[-1] != starts.size or loss.size != tokens.size):
            raise InvariantError("a run of packs needs n+1 offsets from 0 to the end of each array",
                                 path=label, pack=first_pack, field="token_offsets/seq_offsets",
                                 expected=f"[0 .. {tokens.size}] and [0 .. {starts.size}], equal lengths",
                                 actual=f"{token_offsets.size} and {seq_offsets.size} offsets",
                                 rule=Rule.LENGTH_MISMATCH.name if loss.size != tokens.size else None)
        lengths = np.diff(token_offsets)
        out_rule, out_pack, out_pos = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
        counts = np.zeros(_kernels.N_RULES, np.int64)
        dtype_max = _INT32_MAX if self._auto_dtype else self._dtype_max(self.dtype)
        rec, max_len, min_len, loss_sum, max_samples, min_packed, max_packed = _kernels.scan_packs(
            lengths, token_offsets, seq_offsets, tokens, loss, starts, self.pack_size or 0, dtype_max,
            self.vocab_size or 0, self._pad_mult, 0, n, 1, out_rule, out_pack, out_pos, counts, self._pad_offset)
        if rec:
            rule = Rule(int(out_rule[0]))
            raise InvariantError(f"source pack rejected: {rule.describe}", path=label,
                                 pack=first_pack + int(out_pack[0]), rule=rule.name,
                                 hint=hint or "fix the pack; the builder is still usable")
        if self._auto_dtype and self.dtype == DType.uint16 and _kernels.max_token(tokens) > UINT16_MAX:
            self._widen_tokens()
        for start in range(0, tokens.size, _COPY_CHUNK):
            self._bin.write(np.asarray(tokens[start:start + _COPY_CHUNK], dtype=self._token_np))
        self._loss.write(np.ascontiguousarray(loss, dtype=np.uint8))
        self._seq.write(np.ascontiguousarray(starts, dtype=_SEQ_NP))
        counts = np.diff(seq_offsets)
        self._lengths.extend(lengths)
        self._seq_counts.extend(counts)
        self._merge_stats(int(tokens.size), int(starts.size), int(loss_sum), int(max_len), int(min_len),
                          int(max_samples), int(min_packed), int(max_packed), int((lengths - counts).min()))
        return n

    # ------------------------------------------------------------------ finishing

    def _stats(self) -> PackingStats:
        return PackingStats.from_counts(
            pack_count=len(self._lengths), sequence_count=self._sequences, token_count=self._tokens,
            loss_token_count=self._loss_tokens, max_samples_per_bin=self._max_samples,
            dataset_max_seqlen=self._max_seqlen, min_seqlen=self._min_seqlen,
            min_packed_seqlen=self._min_packed, max_packed_seqlen=self._max_packed,
            min_packed_runtime_len=self._min_runtime, pack_size=self.pack_size)

    def _write_idx(self) -> FileDigest:
        n = len(self._lengths)
        out = _CrcWriter(self._tmp[IDX_SUFFIX])
        try:
            out.write(IdxHeader(int(self.dtype), n, n + 1).pack())
            for block in self._lengths.blocks():
                out.write(block)
            acc = 0
            for block in self._lengths.blocks():
                pointers, acc, bad = _kernels.exclusive_cumsum(block, self.dtype.itemsize, acc)
                if bad >= 0:
                    raise ShardError("sequence pointers overflow int64", path=self.paths.idx,
                                     field="sequence_pointers")
                out.write(pointers)
            if acc != self._bin.size:
                raise ShardError("internal error: pointers do not end at the size of .bin",
                                 path=self.paths.idx, expected=self._bin.size, actual=acc)
            for start in range(0, n + 1, _BLOCK):
                out.write(np.arange(start, min(start + _BLOCK, n + 1), dtype=np.int64))
        finally:
            out.close()
        return out.digest

    def _write_seq_idx(self, metadata: ShardMetadata) -> None:
        n = len(self._lengths)
        meta_bytes = metadata.encode()
        ShardMetadata.decode(meta_bytes, path=self.paths.seq_idx)  # never write what a reader refuses
        version = SEQ_IDX_SOURCES_VERSION if self._sources else SEQ_IDX_VERSION   # (no sources: 1.1's bytes)
        flags = FLAG_SOURCES if self._sources else 0
        header = SeqIdxHeader(token_dtype_code=int(self.dtype), pack_count=n,
                              sequence_count=self._sequences, token_count=self._tokens,
                              metadata_length=len(meta_bytes), version_minor=version[1], flags=flags)
        path = self._tmp[SEQ_IDX_SUFFIX]
        with open(path, "wb") as f:
            f.write(b"\0" * SEQ_IDX_HEADER_SIZE)
            body = bytes(meta_bytes) + b"\0" * (header.csr_offset - METADATA_OFFSET - len(meta_bytes))
            f.write(body)
            crc = crc32(body)
            acc = 0
            first = np.zeros(1, dtype=POINTER_DTYPE)
            f.write(first.tobytes())
            crc = crc32(first, crc)
            for block in self._seq_counts.blocks():
                offsets, acc, bad = _kernels.exclusive_cumsum(block, 1, acc)
                if bad >= 0:
                    raise ShardError("CSR offsets overflow int64", path=self.paths.seq_idx, field="seq_offsets")
                ends = offsets[1:] if offsets.size else offsets
                f.write(memoryview(ends))
                crc = crc32(ends, crc)
                tail = np.array([acc], dtype=POINTER_DTYPE) if block.size else np.empty(0, POINTER_DTYPE)
                f.write(tail.tobytes())
                crc = crc32(tail, crc)
            if self._sources:   # the source ids, 64-byte aligned after the offsets (FORMAT.md)
                gap = b"\0" * (header.sources_offset - header.csr_offset - header.csr_nbytes)
                f.write(gap)
                crc = crc32(gap, crc)
                with open(self._src.path, "rb") as src:
                    for block in iter(lambda: src.read(_COPY_CHUNK), b""):
                        f.write(block)
                        crc = crc32(block, crc)
            f.seek(0)
            f.write(SeqIdxHeader(token_dtype_code=int(self.dtype), pack_count=n,
                                 sequence_count=self._sequences, token_count=self._tokens,
                                 metadata_length=len(meta_bytes), body_crc32=crc, version_minor=version[1],
                                 flags=flags).pack())
        if os.path.getsize(path) != header.file_size:
            raise ShardError("internal error: .seq.idx size disagrees with its header", path=path,
                             expected=header.file_size, actual=os.path.getsize(path))

    def finalize(self) -> ShardMetadata:
        """Write both indexes and publish the five files (``.idx`` last). Returns the metadata.

        Raises:
            BuilderStateError: no pack was added, or the builder is already finished.
        """
        self._require_open()
        try:
            if not len(self._lengths):
                raise BuilderStateError("no packs were added; an empty shard is not written",
                                        path=self.prefix)
            for writer in (self._bin, self._loss, self._seq) + ((self._src,) if self._src else ()):
                writer.close()
            idx_digest = self._write_idx()
            known = dict(self._user_metadata)
            self.metadata = ShardMetadata(
                pack_size=self.pack_size, token_dtype=self.dtype.name, vocab_size=self.vocab_size,
                stats=self._stats(),
                files={BIN_SUFFIX: self._bin.digest, IDX_SUFFIX: idx_digest,
                       LOSS_SUFFIX: self._loss.digest, SEQ_BIN_SUFFIX: self._seq.digest},
                producer={"name": "megatron_sft_idx", "version": __version__},
                pad_seq_to_mult=known["pad_seq_to_mult"], pad_layout=known["pad_layout"],
                tokenizer=known.get("tokenizer"),
                packing=known.get("packing"), parallelism=known.get("parallelism"),
                source=known.get("source"), extra=known["extra"],
                shard_set=ShardSet.from_dict(known["set"]) if known.get("set") else None,
                sources=self._counted_sources())
            self._write_seq_idx(self.metadata)
            publishing.commit_shard(self._tmp, self.prefix)
            if self._src is not None:
                _atomic.remove_quietly([self._src.path])
        except BaseException:
            self.abort()
            raise
        self._state = "finalized"
        return self.metadata

    def _counted_sources(self) -> Optional[tuple]:
        """The metadata's ``sources`` with each one's sequence count (None without sources)."""
        if not self._sources:
            return None
        return tuple(ShardSource(s["name"], int(c), {k: v for k, v in s.items() if k not in ("name", "sequences")})
                     for s, c in zip(self._sources, self._source_counts))

    def abort(self) -> None:
        """Discard everything written; no file appears under the final names."""
        if self._state == "open":
            self._state = "aborted"
        src = getattr(self, "_src", None)
        for writer in (self._bin, self._loss, self._seq) + ((src,) if src else ()):
            writer.close()
        _atomic.remove_quietly(list(self._tmp.values()) + ([src.path] if src else []))

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if self._state == "open":
                self.abort()
            return
        if self._state == "open":
            self.finalize()

    def __del__(self) -> None:  # an abandoned builder must not leave temporaries behind
        try:
            if getattr(self, "_state", None) == "open":
                self.abort()
        except Exception:
            pass
