"""The pack plan file (``*.plan``): which store sequences make each pack, for every split.

Layout, version 1.0 (all integers little-endian; ``docs/STORE.md`` is the specification):

======  ====  ====  ==================  ==================================================
offset  size  type  name                constraint
======  ====  ====  ==================  ==================================================
0       8     bytes magic               ``MSFTPLN\\x00``
8       2     u16   version_major       1; any other major is refused
10      2     u16   version_minor       any; a newer minor only adds metadata keys
12      4     u32   reserved            0
16      8     u64   metadata_offset     where the JSON metadata starts (after the arrays)
24      8     u64   metadata_length     L <= 16 MiB
32      8     u64   file_size           the file's exact size: metadata_offset + L
40      16    --    reserved            0
56      4     u32   body_crc32          CRC-32 of bytes ``[64, file_size)``
60      4     u32   header_crc32        CRC-32 of bytes ``[0, 60)``
64      ...   --    arrays              64-byte aligned, located by the metadata
======  ====  ====  ==================  ==================================================

Per split the metadata names three arrays, ``[offset, count, dtype]`` each:
``shard_starts`` (int64[S+1]: first pack of each output shard, then the pack count),
``pack_offsets`` (int64[P+1]: CSR pointers into ``sequence_ids``), ``pack_loads`` (int32[P]:
padded tokens per pack) and ``sequence_ids`` (int32, or int64 past 2**31 - 2 store
sequences: the store sequences of each pack, ascending inside a pack, in pack order).
The file is written under a temporary name, fsynced and renamed: it exists whole or not at all.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Dict, List, Optional

import numpy as np

from .. import _atomic
from ..errors import HeaderError, ShardError, VersionError

PLAN_MAGIC = b"MSFTPLN\x00"
PLAN_VERSION = (1, 0)
PLAN_FORMAT = "megatron_sft_idx.plan"
HEADER = struct.Struct("<8sHHIQQQ16sII")
HEADER_SIZE = HEADER.size  # 64
_CRC_SPAN = 60
_ALIGN = 64
_MAX_METADATA = 16 << 20
_DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}


class PlanWriter:
    """Streams the arrays of each split, then the metadata; :meth:`close` publishes the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp = _atomic.temporary_path(path)
        self.file = open(self.tmp, "wb")
        self.file.write(b"\0" * HEADER_SIZE)
        self.offset = HEADER_SIZE
        self.crc = 0

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.offset += view.nbytes

    def _pad(self) -> None:
        gap = -self.offset % _ALIGN
        if gap:
            self._write(b"\0" * gap)

    def array(self, values: np.ndarray, dtype: str) -> list:
        """Append one whole array; returns its ``[offset, count, dtype]`` locator."""
        return self.array_chunks([values], dtype)

    def array_chunks(self, chunks, dtype: str) -> list:
        """Append an array given as consecutive chunks (bounded memory); returns its locator."""
        self._pad()
        start, count = self.offset, 0
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk, dtype=_DTYPES[dtype])
            self._write(chunk)
            count += chunk.size
        return [start, count, dtype]

    def close(self, metadata: dict) -> None:
        meta = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
        meta_offset = self.offset
        self._write(meta)
        header = HEADER.pack(PLAN_MAGIC, PLAN_VERSION[0], PLAN_VERSION[1], 0, meta_offset, len(meta),
                             self.offset, b"\0" * 16, self.crc, 0)
        self.file.seek(0)
        self.file.write(header[:_CRC_SPAN] + struct.pack("<I", zlib.crc32(header[:_CRC_SPAN])))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        _atomic.fsync_dir(self.path)

    def abort(self) -> None:
        self.file.close()
        _atomic.remove_quietly([self.tmp])


class PackPlan:
    """A plan file opened for reading: ``metadata`` and the arrays of each split (mapped).

    Raises:
        ShardError (HeaderError, VersionError): not a plan, a corrupt one, or an unknown major.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
                header = self._parse_header(raw, size)
                f.seek(header["metadata_offset"])
                meta = f.read(header["metadata_length"])
        except OSError as exc:
            raise ShardError(f"cannot read the pack plan ({exc.strerror or exc})", path=self.path) from None
        self._map: Optional[np.ndarray] = None
        if verify:
            self._verify_body(header["body_crc32"], size)
        try:
            self.metadata = json.loads(meta)
        except ValueError as exc:
            raise HeaderError(f"plan metadata is not JSON ({exc})", path=self.path, field="metadata") from None
        if not isinstance(self.metadata, dict) or self.metadata.get("format") != PLAN_FORMAT:
            raise HeaderError("plan metadata names another format", path=self.path, field="format",
                              expected=PLAN_FORMAT)

    def _parse_header(self, raw: bytes, size: int) -> dict:
        if len(raw) < HEADER_SIZE:
            raise HeaderError("file is shorter than a plan header", path=self.path, field="header")
        magic, major, minor, _, meta_off, meta_len, file_size, _, body_crc, header_crc = HEADER.unpack(raw)
        if magic != PLAN_MAGIC:
            raise HeaderError("not a pack plan: bad magic", path=self.path, field="magic",
                              expected=PLAN_MAGIC, actual=magic)
        if major != PLAN_VERSION[0]:
            raise VersionError(f"unsupported plan major version {major}.{minor}; supported: {PLAN_VERSION[0]}",
                               path=self.path, field="version_major", hint="re-plan with this version")
        if zlib.crc32(raw[:_CRC_SPAN]) != header_crc:
            raise HeaderError("plan header CRC-32 mismatch", path=self.path, field="header_crc32")
        if file_size != size or meta_len > _MAX_METADATA or meta_off + meta_len != file_size:
            raise HeaderError("plan file size disagrees with its header (truncated or extended)",
                              path=self.path, field="file_size", expected=file_size, actual=size)
        return {"metadata_offset": meta_off, "metadata_length": meta_len, "body_crc32": body_crc}

    def _verify_body(self, expected: int, size: int) -> None:
        crc = 0
        with open(self.path, "rb") as f:
            f.seek(HEADER_SIZE)
            for block in iter(lambda: f.read(1 << 22), b""):
                crc = zlib.crc32(block, crc)
        if crc != expected:
            raise HeaderError("plan body CRC-32 mismatch: the file was modified or is corrupt", path=self.path,
                              field="body_crc32", expected=expected, actual=crc)

    @property
    def splits(self) -> List[dict]:
        return self.metadata["splits"]

    def split_index(self, name: str) -> int:
        for i, split in enumerate(self.splits):
            if split["name"] == name:
                return i
        raise ShardError(f"the plan has no split {name!r}", path=self.path, field="split",
                         expected=[s["name"] for s in self.splits], actual=name)

    def arrays(self, split: int) -> Dict[str, np.ndarray]:
        """Read-only views of split ``split``'s arrays, mapped (nothing is read until used)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        out = {}
        for name, (offset, count, dtype) in self.splits[split]["arrays"].items():
            dt = _DTYPES.get(dtype)
            if dt is None:
                raise HeaderError(f"plan array {name} has unknown dtype {dtype!r}", path=self.path,
                                  field=f"splits[{split}].arrays.{name}", expected=sorted(_DTYPES))
            end = offset + count * dt.itemsize
            if offset < HEADER_SIZE or end > self.metadata_offset_bound:
                raise HeaderError(f"plan array {name} lies outside the arrays section", path=self.path,
                                  field=f"splits[{split}].arrays.{name}")
            out[name] = np.frombuffer(self._map, dtype=dt, count=count, offset=offset)
        return out

    @property
    def metadata_offset_bound(self) -> int:
        return self._map.shape[0] if self._map is not None else os.path.getsize(self.path)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state) -> None:
        self.__init__(state["path"], verify=False)
