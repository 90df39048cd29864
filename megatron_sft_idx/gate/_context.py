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


#: Files up to this size are mapped with MAP_POPULATE: the kernel fills the page tables in
#: one call instead of one fault per 4 KiB page (2-3x faster for a pass that reads every
#: byte). Larger files fault lazily so a shard bigger than RAM is not read twice.
POPULATE_LIMIT = 4 << 30


def _map_file(path: str, size: int) -> np.ndarray:
    """Read-only uint8 view of a whole file through mmap."""
    flags = mmap.MAP_SHARED
    if size <= POPULATE_LIMIT:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(mm, dtype=np.uint8, count=size)


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
                    self._maps[suffix] = _map_file(self.path(suffix), size)
                except (OSError, ValueError) as exc:
                    self.add("FILE_UNREADABLE", f"cannot map: {getattr(exc, 'strerror', None) or exc}",
                             suffix)
                    raise UnreadableFile(suffix) from None
        return self._maps[suffix]

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
        self._maps.clear()
