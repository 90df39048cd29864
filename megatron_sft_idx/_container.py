"""The container of the project's derived files: the pack plan (``*.plan``,
:mod:`megatron_sft_idx.preprocess.planfile`) and a balanced order (``*.order``,
:mod:`megatron_sft_idx.batching.order`). Each states its magic, version and metadata; the
64-byte header that frames them is stated, packed and parsed here, once.

======  ====  ====  ==================  ==================================================
offset  size  type  name                constraint
======  ====  ====  ==================  ==================================================
0       8     bytes magic               the file kind's
8       2     u16   version_major       the kind's; any other major is refused
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
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

from .errors import HeaderError, VersionError

HEADER = struct.Struct("<8sHHIQQQ16sII")
HEADER_SIZE = HEADER.size  # 64
CRC_SPAN = 60
ALIGN = 64
MAX_METADATA = 16 << 20


@dataclass(frozen=True)
class Kind:
    """One file kind in the container: its magic and version, and the words its errors use."""

    magic: bytes
    version: Tuple[int, int]
    name: str       # "plan": in "plan header CRC-32 mismatch"
    a_name: str     # "a plan": in "file is shorter than a plan header"
    title: str      # "a pack plan": in "not a pack plan: bad magic"
    redo: str       # the hint of an unknown major version

    def pack_header(self, metadata_offset: int, metadata_length: int, body_crc32: int) -> bytes:
        """The 64 header bytes of a file whose metadata is ``[metadata_offset, + metadata_length)``
        (the file's end) and whose body (bytes ``[64, end)``) has CRC-32 ``body_crc32``."""
        head = HEADER.pack(self.magic, self.version[0], self.version[1], 0, metadata_offset, metadata_length,
                           metadata_offset + metadata_length, b"\0" * 16, body_crc32, 0)[:CRC_SPAN]
        return head + struct.pack("<I", zlib.crc32(head))

    def parse_header(self, raw: bytes, size: int, path: Optional[str]) -> Tuple[int, int, int]:
        """``(metadata_offset, metadata_length, body_crc32)`` of a file of ``size`` bytes opening with
        ``raw``, once magic, major version, header CRC-32 and sizes check.

        Raises:
            HeaderError, VersionError: naming the field.
        """
        if len(raw) < HEADER_SIZE:
            raise HeaderError(f"file is shorter than {self.a_name} header", path=path, field="header")
        magic, major, minor, _, meta_off, meta_len, file_size, _, body_crc, header_crc = HEADER.unpack(
            raw[:HEADER_SIZE])
        if magic != self.magic:
            raise HeaderError(f"not {self.title}: bad magic", path=path, field="magic", expected=self.magic,
                              actual=magic)
        if major != self.version[0]:
            raise VersionError(f"unsupported {self.name} major version {major}.{minor}; supported: {self.version[0]}",
                               path=path, field="version_major", hint=self.redo)
        if zlib.crc32(raw[:CRC_SPAN]) != header_crc:
            raise HeaderError(f"{self.name} header CRC-32 mismatch", path=path, field="header_crc32")
        if file_size != size or meta_len > MAX_METADATA or meta_off < HEADER_SIZE or meta_off + meta_len != file_size:
            raise HeaderError(f"{self.name} file size disagrees with its header (truncated or extended)", path=path,
                              field="file_size", expected=file_size, actual=size)
        return meta_off, meta_len, body_crc


__all__ = ["HEADER", "HEADER_SIZE", "CRC_SPAN", "ALIGN", "MAX_METADATA", "Kind"]
