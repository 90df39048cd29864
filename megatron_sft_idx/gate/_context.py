"""The state one shard's check passes share: paths, sizes, parsed headers, maps, findings.

Passes read what earlier passes established (``idx_header``, ``seq_header``,
``metadata``, the ``*_ok`` flags) and skip themselves, saying so, when an
input they need is untrustworthy.
"""

from __future__ import annotations

import mmap
from typing import Dict, Optional

import numpy as np

from ..format import (
    BIN_SUFFIX,
    IDX_SUFFIX,
    LENGTH_DTYPE,
    LOSS_SUFFIX,
    POINTER_DTYPE,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_SUFFIX,
    IdxHeader,
    SeqIdxHeader,
    ShardPaths,
)
from ..metadata import ShardMetadata
from .report import Finding, ShardReport, make_finding


#: ``madvise`` advice that faults a range's pages in with one call (Linux >= 5.14; absent from
#: the ``mmap`` module before Python 3.13). Elsewhere ``MADV_WILLNEED`` starts read-ahead instead.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_PAGE = mmap.PAGESIZE


def _map_file(path: str, size: int) -> mmap.mmap:
    """Read-only shared map of a whole file. Nothing is faulted in here: the passes bring in
    and release one chunk at a time (:meth:`ShardContext.populate` / :meth:`ShardContext.release`),
    so the gate's resident memory is bounded by a chunk, not by the shard."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


class UnreadableFile(Exception):
    """A file could not be opened or mapped (already reported as FILE_UNREADABLE)."""


class ShardContext:
    """Everything the passes know about one shard so far."""

    def __init__(self, prefix: str, report: ShardReport) -> None:
        self.prefix = prefix
        self.paths = ShardPaths.from_prefix(prefix)
        self.report = report
        self.sizes: Dict[str, int] = {}
        self.idx_header: Optional[IdxHeader] = None
        self.idx_arrays_ok = False      # header parsed and the file size matches its counts
        self.seq_header: Optional[SeqIdxHeader] = None
        self.csr_ok = False             # header parsed and the file size matches it
        self.metadata: Optional[ShardMetadata] = None
        self.sizes_ok = False           # every file size agrees with the headers
        self.pointers_ok = False        # pointer chain verified: every pack inside .bin
        self.offsets_ok = False         # CSR offsets verified
        self.headers_clean = False      # no error from the header, metadata and cross-file passes
        self._maps: Dict[str, np.ndarray] = {}
        self._mmaps: Dict[str, mmap.mmap] = {}

    # ------------------------------------------------------------------ findings

    def path(self, suffix: Optional[str]) -> str:
        return self.prefix + suffix if suffix else self.prefix

    def add(self, code: str, message: str, suffix: Optional[str] = None, *, pack=None, offset=None,
            severity: Optional[str] = None) -> Finding:
        return self.report.add(make_finding(code, message, self.path(suffix), pack=pack, offset=offset,
                                            severity=severity))

    def skip(self, check: str, reason: str) -> None:
        self.add("CHECK_SKIPPED", f"{check} skipped: {reason}")

    # ------------------------------------------------------------------ bytes

    def read(self, suffix: str, size: int, offset: int = 0) -> bytes:
        try:
            with open(self.path(suffix), "rb") as f:
                f.seek(offset)
                return f.read(size)
        except OSError as exc:
            self.add("FILE_UNREADABLE", f"cannot read: {exc.strerror or exc}", suffix)
            raise UnreadableFile(suffix) from None

    def map(self, suffix: str) -> np.ndarray:
        """Read-only uint8 map of a whole file (empty array for an empty file)."""
        if suffix not in self._maps:
            size = self.sizes[suffix]
            if size == 0:
                self._maps[suffix] = np.empty(0, dtype=np.uint8)
            else:
                try:
                    mm = _map_file(self.path(suffix), size)
                except (OSError, ValueError) as exc:
                    self.add("FILE_UNREADABLE", f"cannot map: {getattr(exc, 'strerror', None) or exc}",
                             suffix)
                    raise UnreadableFile(suffix) from None
                self._mmaps[suffix] = mm
                self._maps[suffix] = np.frombuffer(mm, dtype=np.uint8, count=size)
        return self._maps[suffix]

    def populate(self, suffix: str, start: int, stop: int) -> None:
        """Fault bytes ``[start, stop)`` of a mapped file in with one call (a pass that reads every
        byte of a range runs 2-3x faster than with a fault per page). Best effort."""
        mm = self._mmaps.get(suffix)
        if mm is None or stop <= start:
            return
        lo = start - start % _PAGE
        try:
            mm.madvise(MADV_POPULATE_READ, lo, min(stop, len(mm)) - lo)
        except (OSError, ValueError, AttributeError):
            try:
                mm.madvise(mmap.MADV_WILLNEED, lo, min(stop, len(mm)) - lo)
            except (OSError, ValueError, AttributeError):
                pass

    def release(self, suffix: str, start: int = 0, stop: Optional[int] = None) -> None:
        """Drop this process's pages of bytes ``[start, stop)`` of a mapped file (``MADV_DONTNEED``:
        they stay in the page cache and fault back if read again). Best effort."""
        mm = self._mmaps.get(suffix)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        stop = len(mm) if stop is None else min(stop, len(mm))
        lo = start - start % _PAGE
        if stop > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, stop - lo)
            except (OSError, ValueError):
                pass

    def release_all(self) -> None:
        for suffix in list(self._mmaps):
            self.release(suffix)

    def view(self, suffix: str, dtype, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self.map(suffix), dtype=dtype, count=count, offset=offset)

    # ------------------------------------------------------------------ typed arrays

    def lengths(self) -> np.ndarray:
        h = self.idx_header
        return self.view(IDX_SUFFIX, LENGTH_DTYPE, h.sequence_count, h.lengths_offset)

    def pointers(self) -> np.ndarray:
        h = self.idx_header
        return self.view(IDX_SUFFIX, POINTER_DTYPE, h.sequence_count, h.pointers_offset)

    def documents(self) -> np.ndarray:
        h = self.idx_header
        return self.view(IDX_SUFFIX, POINTER_DTYPE, h.document_count, h.document_indices_offset)

    def seq_offsets(self) -> np.ndarray:
        h = self.seq_header
        return self.view(SEQ_IDX_SUFFIX, POINTER_DTYPE, h.pack_count + 1, h.csr_offset)

    def tokens(self) -> np.ndarray:
        dtype = self.idx_header.dtype
        return self.view(BIN_SUFFIX, dtype.numpy, self.sizes[BIN_SUFFIX] // dtype.itemsize)

    def loss(self) -> np.ndarray:
        return self.map(LOSS_SUFFIX)

    def seq_starts(self) -> np.ndarray:
        return self.view(SEQ_BIN_SUFFIX, SEQ_DTYPE.numpy, self.sizes[SEQ_BIN_SUFFIX] // SEQ_DTYPE.itemsize)

    def close(self) -> None:
        if self.metadata is not None:
            self.report.shard_set = self.metadata.shard_set
        self._maps.clear()
        self._mmaps.clear()
