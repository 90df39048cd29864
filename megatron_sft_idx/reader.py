"""Memory-mapped reader of shards: O(1) random access, nothing loaded at open.

``MMapIndexedDataset(prefix)`` composes a *storage source* chosen at open, as
megatron-core's ``IndexedDataset`` composes a ``_BinReader``: for a local prefix the five
files of one generation of the shard (``_files.open_generation``: never files of two
generations, even while the shard is being replaced), for an ``s3://`` / ``msc://`` URL
the objects, with the index files cached on local disk and the data files read by
blocks (``storage/remote.py``). The reader knows packs, a source knows bytes. It reads the
fixed headers and the metadata, checks every size it can check without reading data (the
five files against each other, the headers and the metadata), and maps the files -- from
the descriptors it opened, never by path again -- only when a pack is first read. It
pickles as its prefix (and a URL's storage settings), so each DataLoader worker and each
rank opens the files itself. Example::

    ds = MMapIndexedDataset("/data/train_000")
    pack = ds[17]              # Pack(input_ids, loss_mask, seq_start_id), read-only views
    pack.seq_boundaries        # seq_start_id + [packed_len]
    ds.metadata.stats.max_samples_per_bin

A prefix holding only upstream ``.bin``/``.idx`` opens as pretrain data: each
sequence is a pack of one sequence with a loss mask of ones, and
``metadata.kind == "pretrain"``.
"""

from __future__ import annotations

import mmap
import operator
import os
import sys
import threading
from typing import Dict, NamedTuple, Optional

import numpy as np

from ._files import ShardFiles, open_generation
from .errors import (
    IncompleteShardError,
    MetadataError,
    ShardError,
    SizeMismatchError,
    TruncatedFileError,
    InvariantError,
)
from .format import (
    BIN_SUFFIX,
    IDX_HEADER_SIZE,
    IDX_SUFFIX,
    LENGTH_DTYPE,
    LOSS_SUFFIX,
    METADATA_OFFSET,
    POINTER_DTYPE,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_HEADER_SIZE,
    SEQ_IDX_SUFFIX,
    SFT_SUFFIXES,
    SOURCE_DTYPE,
    READABLE_TOKEN_DTYPES,
    TOKEN_DTYPES,
    IdxHeader,
    Rule,
    SeqIdxHeader,
    ShardPaths,
)
from .metadata import ShardMetadata
from .storage.urls import is_remote

_READ_ONLY_ZERO = np.zeros(1, dtype=SEQ_DTYPE.numpy)
#: ``tuple.__new__`` skips NamedTuple's Python-level constructor on the hot path.
_new_pack = tuple.__new__
_READ_ONLY_ZERO.flags.writeable = False


class Pack(NamedTuple):
    """One pack as read-only views into the shard's files."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    seq_start_id: np.ndarray

    @property
    def packed_len(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_boundaries(self) -> np.ndarray:
        """``seq_start_id + [packed_len]`` (int32): sequence k spans ``[b[k], b[k+1])``."""
        out = np.empty(self.seq_start_id.shape[0] + 1, dtype=np.int32)
        out[:-1] = self.seq_start_id
        out[-1] = self.input_ids.shape[0]
        return out

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_boundaries)

    def as_dict(self) -> dict:
        """Megatron-Bridge's packed-sample keys."""
        return {"input_ids": self.input_ids, "seq_boundaries": self.seq_boundaries,
                "loss_mask": self.loss_mask}


class ShardArrays(NamedTuple):
    """Whole-shard typed views, for vectorised consumers (gate, merge, collate)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    seq_starts: np.ndarray
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    seq_offsets: np.ndarray


def pack_index(idx, n: int, source: str) -> int:
    """``idx`` as a pack number in ``[0, n)``; negative counts from the end, as for sequences.

    Raises:
        TypeError: ``idx`` is not an integer (numpy integers are).
        IndexError: out of range.
    """
    try:
        i = operator.index(idx)
    except TypeError:
        raise TypeError(f"pack index must be an integer or a slice, not {type(idx).__name__}") from None
    if i < 0:
        i += n
    if i < 0 or i >= n:
        raise IndexError(f"pack index {idx} out of range for {n} packs in {source}")
    return i


def pack_indices(indices, n: int, source: str) -> np.ndarray:
    """:func:`pack_index` for a sequence or array of indices, vectorised: int64 in ``[0, n)``.

    Raises:
        TypeError: not a 1-D sequence of integers; IndexError: an index out of range.
    """
    if isinstance(indices, range):
        idx = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    else:
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.dtype.kind not in "iub" and idx.size):
            raise TypeError(f"pack indices must be a 1-D integer sequence, not {idx.dtype} of shape {idx.shape}")
        idx = idx.astype(np.int64)
    if idx.size:
        idx = np.where(idx < 0, idx + n, idx)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            raise IndexError(f"pack index {lo if lo < 0 else hi} out of range for {n} packs in {source}")
    return idx


def _view(buf: np.ndarray, dtype, count: int, offset: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _open_source(prefix, config, cache_dir, block_size, object_storage_config) -> ShardFiles:
    """The storage source of ``prefix``, chosen once, at open: one generation of the local files,
    or the objects at a URL (the storage layer, imported only for URLs)."""
    if is_remote(prefix):
        from .storage.remote import RemoteShardFiles, storage_config   # (start-up: local reads never load it)

        return RemoteShardFiles(prefix, storage_config(config, cache_dir, block_size, object_storage_config))
    prefix = os.fspath(prefix)
    return open_generation(prefix, ShardPaths.from_prefix(prefix))


class MMapIndexedDataset:
    """Random access to the packs of one shard (or of upstream pretrain data).

    Args:
        prefix: the shard's path without suffix, or its ``s3://`` / ``msc://`` URL.
        check_packs: also check every pack's invariants as it is read (a few µs
            per pack; the promotion gate is the place for whole-shard checks).
        config, cache_dir, block_size, object_storage_config: for a URL only (ignored for a
            local path, as upstream ignores its object-storage settings there): a
            :class:`~megatron_sft_idx.storage.StorageConfig` (default: from the environment),
            overrides of its cache directory and block size, or megatron-core's
            ``ObjectStorageConfig`` (``path_to_idx_cache``, ``bin_chunk_nbytes``).

    Raises:
        ShardNotFoundError, IncompleteShardError, ShardChangedError, HeaderError, VersionError,
        DTypeError, MetadataError, SizeMismatchError, TruncatedFileError; for a URL also
        RemoteStorageError, RemoteTimeoutError, ResponseMismatchError, ObjectChangedError,
        ChecksumError (a downloaded index file does not match the metadata), MissingExtraError.
    """

    def __init__(self, prefix, *, check_packs: bool = False, config=None, cache_dir: Optional[str] = None,
                 block_size: Optional[int] = None, object_storage_config=None) -> None:
        if sys.byteorder != "little":
            raise ShardError("this reader supports little-endian hosts only", path=str(prefix))
        self.check_packs = check_packs
        self._tokens = None  # mapped lazily, on first access
        self._sources = None  # the source ids (format 1.2), mapped with the rest
        self._hot = None     # everything the per-pack path reads, as one tuple (set by _map_files)
        self._map_lock = threading.Lock()
        self._source = _open_source(prefix, config, cache_dir, block_size, object_storage_config)
        self.prefix = self._source.prefix
        self.paths = self._source.paths
        try:
            self._open_headers()
        except BaseException:
            self._source.close()
            raise
        self._itemsize = self.dtype.itemsize
        self._bin_size = self._sizes[BIN_SUFFIX]
        self._seq_count = 0 if self.is_pretrain else self.seq_header.sequence_count

    # ------------------------------------------------------------------ open

    def _open_headers(self) -> None:
        files = self._source
        self._sizes = sizes = files.sizes
        companions = [s for s in SFT_SUFFIXES if s in sizes]
        if BIN_SUFFIX not in sizes:
            raise IncompleteShardError(".bin is missing", path=self.paths.bin, field="files")
        if companions and len(companions) != len(SFT_SUFFIXES):
            missing = [s for s in SFT_SUFFIXES if s not in sizes]
            raise IncompleteShardError(
                f"SFT companions {companions} exist but {missing} are missing; refusing to read "
                f"it as pretrain data", path=self.prefix + missing[0], field="files")
        self.is_pretrain = not companions
        allowed = READABLE_TOKEN_DTYPES if self.is_pretrain else TOKEN_DTYPES
        self.idx_header = IdxHeader.parse(files.read(IDX_SUFFIX, IDX_HEADER_SIZE, 0), self.paths.idx,
                                          sizes[IDX_SUFFIX], allowed_dtypes=allowed)
        self.dtype = self.idx_header.dtype
        self._n = self.idx_header.sequence_count
        bin_end = self._last_pack_end(files)
        if self.is_pretrain:
            self._check_bin_end(bin_end)
            self.seq_header = None
            self.metadata = ShardMetadata(
                pack_size=None, token_dtype=self.dtype.name, vocab_size=None, stats=None, files={},
                producer={}, loss_mask_convention="pretrain_all_ones", kind="pretrain")
            return
        self.seq_header = h = SeqIdxHeader.parse(files.read(SEQ_IDX_SUFFIX, SEQ_IDX_HEADER_SIZE, 0),
                                                 self.paths.seq_idx, sizes[SEQ_IDX_SUFFIX])
        meta_raw = files.read(SEQ_IDX_SUFFIX, h.metadata_length, METADATA_OFFSET)
        self.metadata = ShardMetadata.decode(meta_raw, path=self.paths.seq_idx)
        self._cross_check()  # sizes against headers and metadata first: the more precise finding
        self._check_bin_end(bin_end)

    def _cross_check(self) -> None:
        """Everything that can disagree between headers, metadata and file sizes, checked at open."""
        h, ih, m, sizes = self.seq_header, self.idx_header, self.metadata, self._sizes

        def agree(what, path, field, expected, actual, err=SizeMismatchError):
            if expected != actual:
                raise err(what, path=path, field=field, expected=expected, actual=actual)

        agree("pack count differs between .idx and .seq.idx (companion from another shard?)",
              self.paths.seq_idx, "pack_count", ih.sequence_count, h.pack_count)
        agree("an SFT shard has one document per pack", self.paths.idx, "document_count",
              ih.sequence_count + 1, ih.document_count)
        agree("token dtype differs between .idx and .seq.idx", self.paths.seq_idx, "token_dtype_code",
              ih.dtype_code, h.token_dtype_code)
        agree("metadata token_dtype differs from the header", self.paths.seq_idx, "token_dtype",
              self.dtype.name, m.token_dtype, MetadataError)
        if h.has_sources != (m.sources is not None):
            raise MetadataError("the .seq.idx header and metadata disagree on whether the shard records sources",
                                path=self.paths.seq_idx, field="sources",
                                expected="both" if h.has_sources else "neither",
                                actual="the metadata's sources" if m.sources is not None else "the header's flag")
        for field, value in (("pack_count", h.pack_count), ("sequence_count", h.sequence_count),
                             ("token_count", h.token_count)):
            agree("metadata statistics disagree with the header", self.paths.seq_idx, f"stats.{field}",
                  value, getattr(m.stats, field), MetadataError)
        expected_sizes = {BIN_SUFFIX: h.token_count * self.dtype.itemsize, LOSS_SUFFIX: h.token_count,
                          SEQ_BIN_SUFFIX: h.sequence_count * SEQ_DTYPE.itemsize,
                          IDX_SUFFIX: ih.file_size}
        for suffix, expected in expected_sizes.items():
            path = self.prefix + suffix
            actual = sizes[suffix]
            err = TruncatedFileError if actual < expected else SizeMismatchError
            agree("file size disagrees with the .seq.idx header", path, "size", expected, actual, err)
            agree("file size disagrees with the size recorded in the metadata", path, "size",
                  m.files[suffix].size, actual, err)

    def _last_pack_end(self, files: ShardFiles) -> int:
        """Byte offset where the last pack ends in .bin, from two index entries (0 without packs)."""
        n, ih = self._n, self.idx_header
        if n == 0:
            return 0
        last_len = int.from_bytes(files.read(IDX_SUFFIX, 4, ih.lengths_offset + 4 * (n - 1)), "little", signed=True)
        last_ptr = int.from_bytes(files.read(IDX_SUFFIX, 8, ih.pointers_offset + 8 * (n - 1)), "little",
                                  signed=True)
        return last_ptr + last_len * self.dtype.itemsize

    def _check_bin_end(self, end: int) -> None:
        """The last pack must end exactly at the end of .bin."""
        if end != self._sizes[BIN_SUFFIX]:
            err = TruncatedFileError if end > self._sizes[BIN_SUFFIX] else SizeMismatchError
            raise err("the last pack does not end at the end of .bin", path=self.paths.bin,
                      field="sequence_pointers[-1] + sequence_lengths[-1] * itemsize",
                      expected=end, actual=self._sizes[BIN_SUFFIX])

    # ------------------------------------------------------------------ maps (lazy)

    def _ensure_maps(self) -> None:
        """Map the files (first access only) and keep whole-file typed arrays: a pack is then
        three slices of them, which is cheaper than building three arrays from buffers."""
        if self._tokens is not None:
            return
        with self._map_lock:  # each descriptor is mapped once: threads racing to the first read wait
            if self._tokens is None:
                self._map_files()

    def _map_files(self) -> None:
        ih, source = self.idx_header, self._source
        idx = source.map(IDX_SUFFIX)[0]
        self._lengths = _view(idx, LENGTH_DTYPE, self._n, ih.lengths_offset)
        self._pointers = _view(idx, POINTER_DTYPE, self._n, ih.pointers_offset)
        self._documents = _view(idx, POINTER_DTYPE, ih.document_count, ih.document_indices_offset)
        # memoryviews index to Python ints several times faster than numpy scalars.
        self._len_mv = memoryview(self._lengths).cast("B").cast("i")
        self._ptr_mv = memoryview(self._pointers).cast("B").cast("q")
        itemsize = self._itemsize
        tokens = source.data_array(BIN_SUFFIX, self.dtype.numpy, self._sizes[BIN_SUFFIX] // itemsize,
                                   self._pack_end, itemsize)
        if self.is_pretrain:
            self._off_mv = self._loss = self._starts = None
        else:
            h = self.seq_header
            seq_idx = source.map(SEQ_IDX_SUFFIX)[0]
            self._offsets = _view(seq_idx, POINTER_DTYPE, self._n + 1, h.csr_offset)
            if h.has_sources:   # format 1.2: each sequence's source, after the offsets
                self._sources = _view(seq_idx, SOURCE_DTYPE, h.sequence_count, h.sources_offset)
            self._off_mv = memoryview(self._offsets).cast("B").cast("q")
            self._loss = source.data_array(LOSS_SUFFIX, np.uint8, h.token_count, self._pack_end, itemsize)
            self._starts = source.data_array(SEQ_BIN_SUFFIX, SEQ_DTYPE.numpy, h.sequence_count)
        source.close()  # every map holds its own descriptor now
        if not source.batched:
            # The per-pack path unpacks this one tuple instead of reading nine attributes. A
            # source that fetches blocks leaves it unset: its packs go through get_many.
            self._hot = (self._len_mv, self._ptr_mv, self._off_mv, tokens, self._loss, self._starts,
                         self._itemsize, self._bin_size, self._seq_count)
        self._tokens = tokens  # set last: it marks "mapped"

    def _pack_end(self, token: int) -> int:
        """Token index where the pack straddling ``token`` ends (``token`` if none does): a
        source reading blocks extends a fetch to it, so each pack is served by its first block's GET."""
        ptrs, itemsize = self._pointers, self._itemsize
        i = int(ptrs.searchsorted(token * itemsize, "left")) - 1
        if i < 0:
            return token
        return max(token, int(ptrs[i]) // itemsize + int(self._lengths[i]))

    def advise(self, advice: int) -> None:
        """``madvise`` every mapped file of the shard (maps them first); a no-op where the
        platform lacks ``madvise``. E.g. ``mmap.MADV_RANDOM`` for scattered reads: no
        read-ahead (a fault still maps the page-cache folio around it, 64 KiB or more)."""
        self._ensure_maps()
        for mm in self._source.mmaps:
            if hasattr(mm, "madvise"):
                mm.madvise(advice)

    @property
    def file_sizes(self) -> Dict[str, int]:
        """Bytes of each of the shard's files (or objects) found at open, by suffix."""
        return dict(self._sizes)

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapped files (``MADV_DONTNEED``).

        The data stays in the OS page cache and is faulted back on the next access. A long
        scan over a large shard calls this between chunks, so that its RSS is bounded by one
        chunk rather than growing to the size of the files.
        """
        if self._tokens is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.advise(mmap.MADV_DONTNEED)

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, idx):
        # The hot path of training: every line here costs time per sample (see bench.compare).
        if idx.__class__ is not int or idx < 0 or idx >= self._n:
            if isinstance(idx, slice):
                start, stop, step = idx.indices(self._n)
                if step != 1:
                    raise ValueError("slices of a shard must be contiguous (step 1)")
                return self.get_many(range(start, stop))
            idx = pack_index(idx, self._n, self.prefix)
        hot = self._hot
        if hot is None:
            self._ensure_maps()
            hot = self._hot
            if hot is None:  # a source that fetches blocks: one pack's GETs go out in parallel
                return self.get_many((idx,))[0]
        len_mv, ptr_mv, off_mv, tokens, loss, starts, itemsize, bin_size, seq_count = hot
        length = len_mv[idx]
        ptr = ptr_mv[idx]
        # Untrusted numbers: a corrupt index must become our error, never a numpy traceback
        # or a silently short slice.
        if length <= 0 or ptr < 0 or ptr % itemsize or ptr + length * itemsize > bin_size:
            raise self._corrupt_pointer(idx, ptr, length)
        t0 = ptr // itemsize
        t1 = t0 + length
        if off_mv is None:  # pretrain data: one sequence per pack, a loss mask of ones
            return _new_pack(Pack, (tokens[t0:t1], self._ones(length), _READ_ONLY_ZERO))
        s0 = off_mv[idx]
        s1 = off_mv[idx + 1]
        if s0 < 0 or s1 <= s0 or s1 > seq_count:
            raise self._corrupt_offsets(idx, s0, s1)
        pack = _new_pack(Pack, (tokens[t0:t1], loss[t0:t1], starts[s0:s1]))
        if self.check_packs:
            self._check_pack(idx, pack)
        return pack

    _pack = __getitem__

    def get_many(self, indices) -> list:
        """Packs ``indices`` (any integer sequence or array), as a list of :class:`Pack`.

        Locally, each pack through the per-pack path. A remote shard checks every index,
        pointer and offset in one vectorised pass, then fetches every block the packs need
        with parallel requests. For collates and samplers that take a batch at a time.

        Raises:
            IndexError, TypeError: an index is out of range or not an integer.
            InvariantError: an index entry of the shard is corrupt.
        """
        if not self._source.batched:  # local maps: the per-pack path is the cheapest (ShardFiles.batched)
            if isinstance(indices, np.ndarray):
                if indices.ndim != 1:
                    raise TypeError(f"pack indices must be a 1-D integer sequence, not shape {indices.shape}")
                indices = indices.tolist()
            get = self._pack
            return [get(i) for i in indices]
        idx = pack_indices(indices, self._n, self.prefix)
        if self._hot is None:
            self._ensure_maps()
        lengths = self._lengths[idx].astype(np.int64)
        ptrs = self._pointers[idx]
        itemsize = self._itemsize
        bad = (lengths <= 0) | (ptrs < 0) | (ptrs % itemsize != 0) | (ptrs + lengths * itemsize > self._bin_size)
        if bad.any():
            k = int(np.argmax(bad))
            raise self._corrupt_pointer(int(idx[k]), int(ptrs[k]), int(lengths[k]))
        t0 = ptrs // itemsize
        t1 = (t0 + lengths).tolist()
        t0 = t0.tolist()
        if self.is_pretrain:
            tokens, = self._source.gather(((self._tokens, t0, t1),))
            return [_new_pack(Pack, (ids, self._ones(ids.shape[0]), _READ_ONLY_ZERO)) for ids in tokens]
        s0, s1 = self._offsets[idx], self._offsets[idx + 1]
        bad = (s0 < 0) | (s1 <= s0) | (s1 > self._seq_count)
        if bad.any():
            k = int(np.argmax(bad))
            raise self._corrupt_offsets(int(idx[k]), int(s0[k]), int(s1[k]))
        packs = [_new_pack(Pack, parts) for parts in zip(*self._source.gather(
            ((self._tokens, t0, t1), (self._loss, t0, t1), (self._starts, s0.tolist(), s1.tolist()))))]
        if self.check_packs:
            for i, pack in zip(idx.tolist(), packs):
                self._check_pack(i, pack)
        return packs

    def _corrupt_pointer(self, i: int, ptr: int, length: int) -> ShardError:
        return self._corrupt(i, "sequence_pointers/sequence_lengths", "pointer/length fall outside .bin",
                             f"<= {self._bin_size}", f"pointer {ptr}, length {length}")

    def _corrupt_offsets(self, i: int, s0: int, s1: int) -> ShardError:
        return self._corrupt(i, "seq_offsets", "CSR offsets are not increasing within .seq.bin",
                             f"0 <= start < end <= {self._seq_count}", (s0, s1))

    def _corrupt(self, i: int, field: str, what: str, expected=None, actual=None) -> ShardError:
        return InvariantError(f"pack {i} is corrupt: {what}", path=self.prefix, pack=i, field=field,
                              expected=expected, actual=actual,
                              hint="run tools/check_idx.py on this shard and rebuild it")

    def _check_pack(self, i: int, pack: Pack) -> None:
        from . import _kernels   # (numba: a reader that checks no pack never compiles or imports it)

        m = self.metadata
        rule, pos, *_ = _kernels.check_pack(
            pack.input_ids, pack.loss_mask, pack.seq_start_id, m.pack_size or 0,
            int(np.iinfo(self.dtype.numpy).max), m.vocab_size or 0, m.pad_seq_to_mult)
        if rule != Rule.OK:
            rule = Rule(rule)
            raise InvariantError(f"pack {i} breaks an invariant at position {pos}: {rule.describe}",
                                 path=self.prefix, pack=i, rule=rule.name,
                                 hint="run tools/check_idx.py on this shard and rebuild it")

    def _ones(self, length: int) -> np.ndarray:
        ones = getattr(self, "_ones_buf", None)
        if ones is None or ones.shape[0] < length:
            ones = np.ones(max(length, 4096), dtype=np.uint8)
            ones.flags.writeable = False
            self._ones_buf = ones
        return ones[:length]

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> Pack:
        """Tokens ``[offset, offset + length)`` of pack ``idx`` (to its end when ``length`` is None).

        The window's ``seq_start_id`` is 0 followed by the starts that fall strictly
        inside it, shifted by ``-offset``, so the pack invariants hold for the window.
        ``get(i)`` is ``self[i]``.
        """
        pack = self[idx]
        if offset == 0 and length is None:
            return pack
        n = pack.input_ids.shape[0]
        if length is None:
            length = n - offset
        if not (0 <= offset < n and 0 < length <= n - offset):
            raise IndexError(f"window [{offset}, {offset + length}) is outside pack {idx} of length {n}")
        starts = pack.seq_start_id
        end = offset + length
        lo = int(starts.searchsorted(offset, "right"))
        hi = int(starts.searchsorted(end, "left"))
        window_starts = np.empty(1 + max(hi - lo, 0), dtype=SEQ_DTYPE.numpy)
        window_starts[0] = 0
        np.subtract(starts[lo:hi], offset, out=window_starts[1:])
        window_starts.flags.writeable = False
        return _new_pack(Pack, (pack.input_ids[offset:end], pack.loss_mask[offset:end], window_starts))

    # ------------------------------------------------------------------ upstream names

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 packed length of every pack (upstream's name)."""
        self._ensure_maps()
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every pack in ``.bin`` (upstream's name)."""
        self._ensure_maps()
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        self._ensure_maps()
        return self._documents

    @property
    def seq_offsets(self) -> np.ndarray:
        """int64 CSR offsets into ``.seq.bin``, ``len(self) + 1`` entries."""
        if self.is_pretrain:
            return np.arange(self._n + 1, dtype=np.int64)
        self._ensure_maps()
        return self._offsets

    @property
    def sources(self) -> Optional[tuple]:
        """The names of the sources the shard's source ids name (format 1.2), None when it records none."""
        recorded = self.metadata.sources
        return None if recorded is None else tuple(s.name for s in recorded)

    @property
    def sequence_source_ids(self) -> np.ndarray:
        """uint16 source id of every sequence of the shard (``P.seq.bin`` order): an index into
        :attr:`sources`.

        Raises:
            ShardError: the shard records no sources (it was not written from a mixture).
        """
        if self.sources is None:
            raise ShardError("the shard records no sources (it was not written from a mixture)",
                             path=self.paths.seq_idx, field="sources",
                             hint="write it with preprocess-sft/repack-sft --mix to record each sequence's source")
        self._ensure_maps()
        return self._sources

    def source_ids(self, idx: int) -> np.ndarray:
        """The source id of each sequence of pack ``idx`` (uint16, read-only; an index into
        :attr:`sources`): what a trainer logs loss per source by.

        Raises:
            ShardError: the shard records no sources; an index out of range; a corrupt offset.
        """
        ids = self.sequence_source_ids
        idx = pack_index(idx, self._n, self.prefix)
        s0, s1 = int(self._offsets[idx]), int(self._offsets[idx + 1])
        if s0 < 0 or s1 <= s0 or s1 > self._seq_count:
            raise self._corrupt_offsets(idx, s0, s1)
        return ids[s0:s1]

    @property
    def is_mapped(self) -> bool:
        """Whether the files are mapped yet (they are not after open or unpickling)."""
        return self._tokens is not None

    @property
    def num_tokens(self) -> int:
        return self._sizes[BIN_SUFFIX] // self.dtype.itemsize

    @property
    def pack_size(self) -> Optional[int]:
        return self.metadata.pack_size

    def arrays(self) -> ShardArrays:
        """Whole-shard typed views (no copy) of every array of the shard."""
        self._ensure_maps()
        if self.is_pretrain:
            loss = np.ones(self.num_tokens, dtype=np.uint8)
            starts = np.zeros(self._n, dtype=SEQ_DTYPE.numpy)
        else:
            loss, starts = self._loss, self._starts
        return ShardArrays(self._tokens, loss, starts, self._lengths, self._pointers, self.seq_offsets)

    @staticmethod
    def exists(prefix) -> bool:
        """True when ``prefix.idx`` and ``prefix.bin`` exist (upstream's test; URLs too)."""
        prefix = os.fspath(prefix)
        if is_remote(prefix):
            from .storage.remote import remote_shard_exists   # (start-up: local reads never load it)
            return remote_shard_exists(prefix)
        return os.path.exists(prefix + IDX_SUFFIX) and os.path.exists(prefix + BIN_SUFFIX)

    # ------------------------------------------------------------------ storage

    @property
    def is_remote(self) -> bool:
        """Whether the shard is read from object storage (an ``s3://`` / ``msc://`` URL)."""
        return self._source.remote

    @property
    def config(self):
        """The :class:`~megatron_sft_idx.storage.StorageConfig` a URL is read with (None locally)."""
        return self._source.config

    @property
    def local_index_prefix(self) -> Optional[str]:
        """Where this node's verified copies of a URL's index files are (None locally)."""
        return self._source.local_index_prefix

    def block_stats(self) -> dict:
        """Block-cache hits and misses of each remotely read file in this process (``{}`` locally)."""
        self._ensure_maps()
        return self._source.block_stats()

    def clear_block_cache(self) -> None:
        """Forget every cached block of this process (the next reads fetch again; a no-op locally)."""
        if self.is_mapped:
            self._source.clear_blocks()

    # ------------------------------------------------------------------ pickling

    def __getstate__(self):
        state = {"prefix": self.prefix, "check_packs": self.check_packs}
        if self._source.remote:
            state["config"] = self._source.config
        return state

    def __setstate__(self, state) -> None:
        self.__init__(state["prefix"], check_packs=state["check_packs"], config=state.get("config"))

    def __repr__(self) -> str:
        kind = "pretrain" if self.is_pretrain else "sft"
        return (f"{'Remote' if self._source.remote else ''}MMapIndexedDataset({self.prefix!r}, packs={self._n}, "
                f"dtype={self.dtype.name}, kind={kind})")
