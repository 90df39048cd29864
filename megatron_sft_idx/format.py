"""The byte layout of a shard, stated once.

Every other module (builder, reader, gate, tests, the C++ reader through
``docs/FORMAT.md``) takes its constants and ``struct.Struct``s from here; no
other module spells an offset. All integers are little-endian.

A shard is five files sharing a prefix ``P``:

============  =====================================================================
file          holds
============  =====================================================================
P.bin         every pack's ``input_ids`` concatenated, token dtype (uint16 or int32)
P.idx         upstream Megatron ``MMIDIDX`` index, version 1, one sequence and one
              document per pack (byte-compatible with megatron-core)
P.loss.bin    every pack's loss mask concatenated, uint8 0/1, token-aligned with P.bin
P.seq.idx     this format's own index: header, JSON metadata, CSR offsets into P.seq.bin
P.seq.bin     every pack's ``seq_start_id`` concatenated, int32
============  =====================================================================

``P.idx`` (upstream MMIDIDX v1; N = pack count, D = document count = N + 1)::

    offset        size  type       name               constraint
    0             9     bytes      magic              b"MMIDIDX\\x00\\x00"
    9             8     u64        version            == 1
    17            1     u8         dtype_code         DType code of P.bin (4 or 8 when written)
    18            8     u64        sequence_count     N
    26            8     u64        document_count     D
    34            4N    int32[N]   sequence_lengths   packed_len of each pack, > 0
    34+4N         8N    int64[N]   sequence_pointers  byte offset of pack i in P.bin;
                                                      [0] == 0, [i+1] == [i] + len[i]*itemsize
    34+12N        8D    int64[D]   document_indices   [0, 1, ..., N] (non-decreasing, ends at N)
    file size == 34 + 12N + 8D

``P.seq.idx`` (version 1.2; 1.0 and 1.1 have no ``source_ids`` and no flag)::

    offset  size  type   name              constraint
    0       8     bytes  magic             b"MSFTSEQ\\x00"
    8       2     u16    version_major     == 1 (an unknown major is refused)
    10      2     u16    version_minor     any (a newer minor only adds metadata keys)
    12      1     u8     token_dtype_code  == P.idx dtype_code; 8 (uint16) or 4 (int32)
    13      1     u8     seq_dtype_code    == 4 (int32): dtype of P.seq.bin
    14      1     u8     loss_dtype_code   == 1 (uint8): dtype of P.loss.bin
    15      1     u8     flags             bit 0 FLAG_SOURCES (1.2); the other bits 0 (reserved)
    16      8     u64    pack_count        N == P.idx sequence_count; 1 <= N <= MAX_COUNT
    24      8     u64    sequence_count    S: values in P.seq.bin; N <= S <= MAX_COUNT
    32      8     u64    token_count       T: elements of P.bin == bytes of P.loss.bin; N <= T <= MAX_COUNT
    40      8     u64    metadata_length   L: bytes of UTF-8 JSON starting at offset 64
    48      8     u64    csr_offset        align64(64 + L); bytes in between are zero
    56      4     u32    body_crc32        CRC-32 of bytes [64, end of file)
    60      4     u32    header_crc32      CRC-32 of bytes [0, 60)
    64      L     utf-8  metadata          JSON object (see ``megatron_sft_idx.metadata``)
    csr     8N+8  int64  seq_offsets       [0] == 0, strictly increasing, [N] == S;
                                           pack i's starts are P.seq.bin[seq_offsets[i]:seq_offsets[i+1]]
    src     2S    uint16 source_ids        only with FLAG_SOURCES (1.2): src == align64(csr + 8N + 8), the
                                           bytes between zero; sequence j's source, an index into the
                                           metadata's ``sources`` (fewer than len(sources))
    file size == csr_offset + 8 * (N + 1), or src + 2 * S with FLAG_SOURCES

Pack ``i`` is ``input_ids = P.bin[ptr_i / itemsize : + len_i]`` (``ptr_i`` =
``sequence_pointers[i]``), ``loss_mask = P.loss.bin[ptr_i / itemsize : + len_i]``,
``seq_start_id = P.seq.bin[seq_offsets[i] : seq_offsets[i+1]]``. Its invariants
are the members of :class:`Rule`.

The format's limits (metadata length, nesting depth, integer ranges) are the constants
under "limits" below, stated in docs/FORMAT.md "Limits" and enforced by
``jsondoc.parse_json`` / ``ShardMetadata.from_dict`` and by csrc/ alike.

Checksums are CRC-32 (zlib / IEEE 802.3 polynomial, as ``zlib.crc32``) of whole
files; the metadata records the size and CRC-32 of P.bin, P.idx, P.loss.bin and
P.seq.bin, and P.seq.idx protects itself with the two CRCs in its header.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from .errors import (
    DTypeError,
    HeaderError,
    TruncatedFileError,
    SizeMismatchError,
    VersionError,
)

# --------------------------------------------------------------------------- files

BIN_SUFFIX = ".bin"
IDX_SUFFIX = ".idx"
LOSS_SUFFIX = ".loss.bin"
SEQ_IDX_SUFFIX = ".seq.idx"
SEQ_BIN_SUFFIX = ".seq.bin"
#: The SFT companions: present only in SFT shards, never in upstream pretrain data.
SFT_SUFFIXES = (LOSS_SUFFIX, SEQ_IDX_SUFFIX, SEQ_BIN_SUFFIX)
ALL_SUFFIXES = (BIN_SUFFIX, IDX_SUFFIX) + SFT_SUFFIXES
#: Order in which the builder publishes: .idx last, because every reader needs it.
PUBLISH_ORDER = (BIN_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX, SEQ_IDX_SUFFIX, IDX_SUFFIX)
#: Not a shard file: a balanced pack order beside a shard ``P.order`` or a set's manifest
#: ``B.order`` (``docs/BATCHING.md``; its format in :mod:`megatron_sft_idx.batching.order`).
ORDER_SUFFIX = ".order"
#: Files whose size and CRC-32 the metadata records.
CHECKSUMMED_SUFFIXES = (BIN_SUFFIX, IDX_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX)


class ShardPaths(NamedTuple):
    bin: str
    idx: str
    loss_bin: str
    seq_idx: str
    seq_bin: str

    @classmethod
    def from_prefix(cls, prefix: str) -> "ShardPaths":
        prefix = str(prefix)
        return cls(*(prefix + s for s in (BIN_SUFFIX, IDX_SUFFIX, LOSS_SUFFIX, SEQ_IDX_SUFFIX, SEQ_BIN_SUFFIX)))

    def by_suffix(self) -> dict:
        return dict(zip((BIN_SUFFIX, IDX_SUFFIX, LOSS_SUFFIX, SEQ_IDX_SUFFIX, SEQ_BIN_SUFFIX), self))


# --------------------------------------------------------------------------- dtypes


class DType(enum.IntEnum):
    """Megatron's dtype codes. Append new codes; never renumber."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name)

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise DTypeError(f"{dtype!r} is not a numpy dtype", field="dtype",
                             expected=sorted(cls.__members__), actual=repr(dtype)) from None
        if name not in cls.__members__:
            raise DTypeError(f"numpy dtype {name} has no Megatron dtype code",
                             field="dtype", expected=sorted(cls.__members__), actual=name)
        return cls[name]


#: Token dtypes a shard may be written with.
TOKEN_DTYPES = (DType.uint16, DType.int32)
#: Token dtypes the reader accepts in an upstream pretrain ``.idx`` (integers only).
READABLE_TOKEN_DTYPES = (DType.uint8, DType.int8, DType.int16, DType.int32, DType.int64, DType.uint16)
LOSS_DTYPE = DType.uint8
SEQ_DTYPE = DType.int32
POINTER_DTYPE = np.dtype("<i8")
LENGTH_DTYPE = np.dtype("<i4")
UINT16_MAX = int(np.iinfo(np.uint16).max)
INT32_MAX = int(np.iinfo(np.int32).max)

# --------------------------------------------------------------------------- limits
# The format's limits, stated in docs/FORMAT.md ("Limits") and enforced identically by
# this package (here and in ``metadata.py``) and by the native implementation (``csrc/``).
# Anything beyond them is refused with a named error before it reaches numba or C++.

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
UINT32_MAX = (1 << 32) - 1
#: Refuse absurd metadata before reading it (a corrupt length must not allocate GBs).
MAX_METADATA_LENGTH = 16 << 20
#: Containers (objects and arrays) nested in the metadata JSON, the top-level object being 1.
MAX_METADATA_DEPTH = 64
#: Upper bound of pack_count, sequence_count and token_count in a .seq.idx header, so that
#: every byte size derived from a count (8 bytes per element at most) fits int64 with room.
MAX_COUNT = 1 << 56
#: Inclusive range of every JSON integer anywhere in the metadata (known key or not).
METADATA_INT_RANGE = (INT64_MIN, INT64_MAX)
#: Inclusive ranges of the metadata's integer fields (``stats.*`` is every statistic that is an int).
METADATA_FIELD_RANGES = {
    "pack_size": (1, INT32_MAX),
    "vocab_size": (1, INT32_MAX),
    "pad_seq_to_mult": (1, INT32_MAX),
    "stats.*": (0, INT64_MAX),
    "files.*.size": (0, INT64_MAX),
    "files.*.crc32": (0, UINT32_MAX),
    "set.count": (1, INT32_MAX),
    "set.index": (0, INT32_MAX - 1),
    "sources[].sequences": (0, INT64_MAX),
}
#: Longest ``set.id`` / ``set.name`` string (characters) a shard may record.
MAX_SET_TEXT = 256


def choose_token_dtype(max_token_id: Optional[int]) -> DType:
    """uint16 when every id fits, else int32 (the reader trusts only the code)."""
    if max_token_id is not None and max_token_id <= UINT16_MAX:
        return DType.uint16
    return DType.int32


# --------------------------------------------------------------------------- .idx

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
#: magic, version, dtype_code, sequence_count, document_count
IDX_HEADER = struct.Struct("<9sQBQQ")
IDX_HEADER_SIZE = IDX_HEADER.size  # 34: upstream's layout, so arrays are not aligned


@dataclass(frozen=True)
class IdxHeader:
    dtype_code: int
    sequence_count: int
    document_count: int

    @property
    def lengths_offset(self) -> int:
        return IDX_HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return IDX_HEADER_SIZE + LENGTH_DTYPE.itemsize * self.sequence_count

    @property
    def document_indices_offset(self) -> int:
        return self.pointers_offset + POINTER_DTYPE.itemsize * self.sequence_count

    @property
    def file_size(self) -> int:
        return self.document_indices_offset + POINTER_DTYPE.itemsize * self.document_count

    @property
    def dtype(self) -> DType:
        return DType(self.dtype_code)

    def pack(self) -> bytes:
        return IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, self.dtype_code, self.sequence_count, self.document_count)

    @classmethod
    def parse(cls, raw: bytes, path: str, file_size: int,
              allowed_dtypes=READABLE_TOKEN_DTYPES) -> "IdxHeader":
        """Parse and check the 34-byte header against the file's real size.

        Raises:
            TruncatedFileError, HeaderError, VersionError, DTypeError, SizeMismatchError.
        """
        if len(raw) < IDX_HEADER_SIZE:
            raise TruncatedFileError("file is shorter than the MMIDIDX header", path=path,
                                     field="header", expected=IDX_HEADER_SIZE, actual=len(raw))
        magic, version, code, nseq, ndoc = IDX_HEADER.unpack_from(raw)
        if magic != IDX_MAGIC:
            raise HeaderError("not a Megatron index: bad magic", path=path, field="magic",
                              expected=IDX_MAGIC, actual=magic)
        if version != IDX_VERSION:
            raise VersionError(f"unsupported MMIDIDX version {version}; supported: ({IDX_VERSION},)",
                               path=path, field="version", expected=IDX_VERSION, actual=version)
        if code not in {int(d) for d in allowed_dtypes}:
            raise DTypeError(f"token dtype code {code} is not allowed here", path=path,
                             field="dtype_code", expected=sorted(int(d) for d in allowed_dtypes),
                             actual=code, hint="tokens must be an integer Megatron dtype")
        header = cls(code, nseq, ndoc)
        # Counts come from untrusted bytes: bound them by the file size before any arithmetic
        # that would allocate or map from them.
        if nseq > file_size or ndoc > file_size or header.file_size != file_size:
            err = TruncatedFileError if header.file_size > file_size else SizeMismatchError
            raise err("index size disagrees with its header counts", path=path,
                      field="sequence_count/document_count",
                      expected=header.file_size if nseq <= file_size and ndoc <= file_size else "<= file size",
                      actual=file_size)
        return header


# --------------------------------------------------------------------------- .seq.idx

SEQ_IDX_MAGIC = b"MSFTSEQ\x00"
SEQ_IDX_VERSION = (1, 1)  # 1.1 added metadata pad_layout and stats.min_packed_runtime_len
#: The version of a shard that records each sequence's source (flag :data:`FLAG_SOURCES`, metadata
#: ``sources``); a shard without sources is still written as :data:`SEQ_IDX_VERSION`, byte for byte.
SEQ_IDX_SOURCES_VERSION = (1, 2)
#: ``flags`` bit 0 (1.2): a source id per sequence follows the CSR offsets (:attr:`SeqIdxHeader.sources_offset`).
FLAG_SOURCES = 0x01
#: Every flag bit this version knows; any other bit set is refused.
KNOWN_FLAGS = FLAG_SOURCES
#: The dtype of a sequence's source id (an index into the metadata's ``sources``).
SOURCE_DTYPE = np.dtype("<u2")
#: The most sources a shard records (a source id is a uint16).
MAX_SOURCES = 65535
SUPPORTED_SEQ_IDX_MAJORS = (1,)
ALIGNMENT = 64
#: magic, major, minor, token_dtype_code, seq_dtype_code, loss_dtype_code, flags,
#: pack_count, sequence_count, token_count, metadata_length, csr_offset, body_crc32, header_crc32
SEQ_IDX_HEADER = struct.Struct("<8sHHBBBBQQQQQII")
SEQ_IDX_HEADER_SIZE = SEQ_IDX_HEADER.size  # 64
#: The header CRC covers everything before itself.
SEQ_IDX_HEADER_CRC_SPAN = SEQ_IDX_HEADER_SIZE - 4
METADATA_OFFSET = SEQ_IDX_HEADER_SIZE


def align(n: int, to: int = ALIGNMENT) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class SeqIdxHeader:
    token_dtype_code: int
    pack_count: int
    sequence_count: int
    token_count: int
    metadata_length: int
    body_crc32: int = 0
    version_major: int = SEQ_IDX_VERSION[0]
    version_minor: int = SEQ_IDX_VERSION[1]
    seq_dtype_code: int = int(SEQ_DTYPE)
    loss_dtype_code: int = int(LOSS_DTYPE)
    flags: int = 0
    csr_offset: Optional[int] = None  # derived when None

    def __post_init__(self):
        if self.csr_offset is None:
            object.__setattr__(self, "csr_offset", align(METADATA_OFFSET + self.metadata_length))

    @property
    def csr_nbytes(self) -> int:
        return POINTER_DTYPE.itemsize * (self.pack_count + 1)

    @property
    def has_sources(self) -> bool:
        return bool(self.flags & FLAG_SOURCES)

    @property
    def sources_offset(self) -> Optional[int]:
        """Where the source ids start (``align64`` of the CSR offsets' end; the bytes between are
        zero), None without :data:`FLAG_SOURCES`."""
        return align(self.csr_offset + self.csr_nbytes) if self.has_sources else None

    @property
    def file_size(self) -> int:
        if self.has_sources:
            return self.sources_offset + SOURCE_DTYPE.itemsize * self.sequence_count
        return self.csr_offset + self.csr_nbytes

    @property
    def token_dtype(self) -> DType:
        return DType(self.token_dtype_code)

    def pack(self) -> bytes:
        """The 64 header bytes, with the header CRC computed over the first 60."""
        fields = (SEQ_IDX_MAGIC, self.version_major, self.version_minor, self.token_dtype_code,
                  self.seq_dtype_code, self.loss_dtype_code, self.flags, self.pack_count,
                  self.sequence_count, self.token_count, self.metadata_length, self.csr_offset,
                  self.body_crc32, 0)
        raw = SEQ_IDX_HEADER.pack(*fields)
        crc = zlib.crc32(raw[:SEQ_IDX_HEADER_CRC_SPAN])
        return raw[:SEQ_IDX_HEADER_CRC_SPAN] + struct.pack("<I", crc)

    @classmethod
    def parse(cls, raw: bytes, path: str, file_size: int) -> "SeqIdxHeader":
        """Parse the 64-byte header strictly: every field is checked, nothing is guessed.

        Raises:
            TruncatedFileError, HeaderError, VersionError, DTypeError, SizeMismatchError.
        """
        if len(raw) < SEQ_IDX_HEADER_SIZE:
            raise TruncatedFileError("file is shorter than the .seq.idx header", path=path,
                                     field="header", expected=SEQ_IDX_HEADER_SIZE, actual=len(raw))
        (magic, major, minor, tcode, scode, lcode, flags, npacks, nseq, ntok, mlen, csr,
         body_crc, header_crc) = SEQ_IDX_HEADER.unpack_from(raw)
        if magic != SEQ_IDX_MAGIC:
            raise HeaderError("not a megatron_sft_idx sequence index: bad magic", path=path,
                              field="magic", expected=SEQ_IDX_MAGIC, actual=magic)
        if major not in SUPPORTED_SEQ_IDX_MAJORS:
            raise VersionError(
                f"unsupported .seq.idx major version {major}.{minor}; supported majors: "
                f"{SUPPORTED_SEQ_IDX_MAJORS}", path=path, field="version_major",
                expected=SUPPORTED_SEQ_IDX_MAJORS, actual=major)
        actual_crc = zlib.crc32(raw[:SEQ_IDX_HEADER_CRC_SPAN])
        if actual_crc != header_crc:
            raise HeaderError("header CRC-32 mismatch: the header bytes were modified",
                              path=path, field="header_crc32", expected=header_crc, actual=actual_crc)
        if tcode not in {int(d) for d in TOKEN_DTYPES}:
            raise DTypeError(f"token dtype code {tcode} is not a shard token dtype", path=path,
                             field="token_dtype_code", expected=sorted(int(d) for d in TOKEN_DTYPES),
                             actual=tcode)
        if scode != int(SEQ_DTYPE):
            raise DTypeError("seq_start_id dtype code must be int32", path=path,
                             field="seq_dtype_code", expected=int(SEQ_DTYPE), actual=scode)
        if lcode != int(LOSS_DTYPE):
            raise DTypeError("loss mask dtype code must be uint8", path=path,
                             field="loss_dtype_code", expected=int(LOSS_DTYPE), actual=lcode)
        if flags & ~KNOWN_FLAGS:
            raise HeaderError("reserved flags are set", path=path, field="flags", expected=f"bits of {KNOWN_FLAGS}",
                              actual=flags)
        if flags & FLAG_SOURCES and (major, minor) < SEQ_IDX_SOURCES_VERSION:
            raise HeaderError(f"the sources flag needs version {SEQ_IDX_SOURCES_VERSION[0]}."
                              f"{SEQ_IDX_SOURCES_VERSION[1]}", path=path, field="flags",
                              expected=f"version >= {SEQ_IDX_SOURCES_VERSION}", actual=(major, minor))
        if mlen > MAX_METADATA_LENGTH:
            raise HeaderError("metadata length is implausible", path=path, field="metadata_length",
                              expected=f"<= {MAX_METADATA_LENGTH}", actual=mlen)
        if csr != align(METADATA_OFFSET + mlen):
            raise HeaderError("CSR offset is not the 64-byte aligned end of the metadata", path=path,
                              field="csr_offset", expected=align(METADATA_OFFSET + mlen), actual=csr)
        if npacks == 0:
            raise HeaderError("a shard holds at least one pack", path=path, field="pack_count",
                              expected=">= 1", actual=npacks)
        for name, count in (("pack_count", npacks), ("sequence_count", nseq), ("token_count", ntok)):
            if count > MAX_COUNT:
                raise HeaderError(f"{name} exceeds the format's limit", path=path, field=name,
                                  expected=f"<= {MAX_COUNT}", actual=count)
        if nseq < npacks:
            raise HeaderError("fewer sequences than packs (every pack holds at least one)",
                              path=path, field="sequence_count", expected=f">= {npacks}", actual=nseq)
        if ntok < npacks:
            raise HeaderError("fewer tokens than packs (every pack holds at least one)",
                              path=path, field="token_count", expected=f">= {npacks}", actual=ntok)
        # Every field is valid on its own: only now compare with the file (as csrc/ does).
        if npacks > file_size:
            raise TruncatedFileError("pack count cannot fit in the file", path=path,
                                     field="pack_count", expected=f"<= {file_size}", actual=npacks)
        header = cls(token_dtype_code=tcode, pack_count=npacks, sequence_count=nseq,
                     token_count=ntok, metadata_length=mlen, body_crc32=body_crc,
                     version_major=major, version_minor=minor, seq_dtype_code=scode,
                     loss_dtype_code=lcode, flags=flags, csr_offset=csr)
        if header.file_size != file_size:
            err = TruncatedFileError if header.file_size > file_size else SizeMismatchError
            raise err(".seq.idx size disagrees with its header", path=path,
                      field="pack_count/sequence_count/csr_offset" if header.has_sources else "pack_count/csr_offset",
                      expected=header.file_size, actual=file_size)
        return header


# --------------------------------------------------------------------------- invariants


class Rule(enum.IntEnum):
    """The invariants of every pack. Codes are stable: append, never renumber.

    The numba kernels report violations by these numbers; the builder, reader
    and gate turn them into :class:`~megatron_sft_idx.errors.InvariantError`s.
    """

    OK = 0
    PACK_EMPTY = 1            # 0 < packed_len
    PACK_TOO_LONG = 2         # packed_len <= pack_size
    LENGTH_MISMATCH = 3       # len(loss_mask) == len(input_ids)
    LOSS_VALUE = 4            # loss_mask values in {0, 1}
    LOSS_ON_LAST = 5          # label-aligned: the last position of every sequence is 0
    SEQ_NONE = 6              # at least one sequence per pack
    SEQ_FIRST_NOT_ZERO = 7    # seq_start_id[0] == 0
    SEQ_NOT_INCREASING = 8    # seq_start_id strictly increasing
    SEQ_START_OUT_OF_RANGE = 9  # seq_start_id[-1] < packed_len
    SEQ_NOT_PAD_MULTIPLE = 10   # every sequence length is a multiple of pad_seq_to_mult
    TOKEN_NEGATIVE = 11       # token ids >= 0
    TOKEN_TOO_LARGE = 12      # token id fits the token dtype
    TOKEN_OUT_OF_VOCAB = 13   # token id < vocab_size

    @property
    def describe(self) -> str:
        return _RULE_TEXT[self]


_RULE_TEXT = {
    Rule.OK: "ok",
    Rule.PACK_EMPTY: "a pack must hold at least one token (0 < packed_len)",
    Rule.PACK_TOO_LONG: "packed_len must not exceed pack_size",
    Rule.LENGTH_MISMATCH: "loss_mask must have exactly one value per token of input_ids",
    Rule.LOSS_VALUE: "loss_mask values must be 0 or 1",
    Rule.LOSS_ON_LAST: "label-aligned loss mask: the last position of every sequence must be 0 "
                       "(there is no next token to predict)",
    Rule.SEQ_NONE: "seq_start_id must hold at least one start",
    Rule.SEQ_FIRST_NOT_ZERO: "seq_start_id[0] must be 0",
    Rule.SEQ_NOT_INCREASING: "seq_start_id must be strictly increasing",
    Rule.SEQ_START_OUT_OF_RANGE: "every seq_start_id must be < packed_len",
    Rule.SEQ_NOT_PAD_MULTIPLE: "every sequence length (pad_layout 'stored'), or length minus one "
                               "(pad_layout 'runtime'), must be a multiple of pad_seq_to_mult",
    Rule.TOKEN_NEGATIVE: "token ids must be >= 0",
    Rule.TOKEN_TOO_LARGE: "token id does not fit the shard's token dtype",
    Rule.TOKEN_OUT_OF_VOCAB: "token id must be < vocab_size",
}

#: The loss-mask convention every shard of this version uses (recorded in the metadata).
LOSS_MASK_CONVENTION = "label_aligned"

#: Context-parallel padding layouts (metadata ``pad_layout``, format 1.1; absent means "stored").
#: "stored": every stored sequence length is a multiple of ``pad_seq_to_mult`` (Megatron-LM's
#: SFT padding). "runtime": every stored length minus one is (Megatron-Bridge's: its runtime
#: segment drops each sequence's last token for the label shift).
PAD_LAYOUT_STORED = "stored"
PAD_LAYOUT_RUNTIME = "runtime"
PAD_LAYOUTS = (PAD_LAYOUT_STORED, PAD_LAYOUT_RUNTIME)
