"""Checksums of run artifacts, verified before their bytes are used again.

Every byte a run reads back was checksummed when it was written, and the checksum is checked
before the bytes make anything new (``docs/STORE.md``, "What is verified when"):

* a shard (a store partition, a staged or a published output shard) records the size and
  CRC-32 of its ``.bin``, ``.loss.bin``, ``.idx`` and ``.seq.bin`` in its ``.seq.idx``
  metadata, and the ``.seq.idx`` header the CRC-32 of its own body; :func:`verify_shard`
  checks all of them, reading each file once, in blocks (memory: one block);
* the receipt that commits a unit pins the CRC-32 of its small artifacts (a partition's
  ``.seq.idx`` and ``.rows``, the plan file, a staged shard's ``.seq.idx``), so an artifact
  rewritten whole and made self-consistent again is still caught.

CRC-32 is zlib's polynomial, computed by zlib-ng when installed (``megatron_sft_idx._crc``).
"""

from __future__ import annotations

from typing import Optional

from .._crc import crc32
from ..errors import ChecksumError, ShardError
from ..format import CHECKSUMMED_SUFFIXES, SEQ_IDX_HEADER_SIZE, SEQ_IDX_SUFFIX
from ..reader import MMapIndexedDataset

_BLOCK = 8 << 20


def crc32_file(path: str, start: int = 0) -> int:
    """CRC-32 of the bytes of ``path`` from ``start`` to its end, read in blocks.

    Raises:
        OSError: the file cannot be read (callers name it).
    """
    crc = 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while True:
            n = f.readinto(view)
            if not n:
                return crc
            crc = crc32(view[:n], crc)


def check_crc(path: str, expected: int, what: str, hint: str) -> None:
    """Raise unless the CRC-32 of the file ``path`` is ``expected``.

    Raises:
        ChecksumError: it differs; ShardError: the file cannot be read.
    """
    try:
        actual = crc32_file(path)
    except OSError as exc:
        raise ShardError(f"cannot read {what} ({exc.strerror or exc})", path=path, hint=hint) from None
    if actual != expected:
        raise ChecksumError(f"{what} changed since it was written: CRC-32 is {actual:#010x}, "
                            f"{expected:#010x} was recorded", path=path, field="crc32", hint=hint)


def verify_shard(prefix: str, hint: str, seq_idx_crc: Optional[int] = None) -> MMapIndexedDataset:
    """Open the shard ``prefix`` and verify every checksum it carries; returns it opened.

    ``seq_idx_crc``: the CRC-32 of the whole ``.seq.idx`` a receipt pinned, if any.

    Raises:
        ShardError: the shard does not open (the reader's structural checks);
        ChecksumError: a file's bytes differ from its recorded CRC-32 (naming the file).
    """
    ds = MMapIndexedDataset(prefix)
    seq_idx = prefix + SEQ_IDX_SUFFIX
    if seq_idx_crc is not None:
        check_crc(seq_idx, seq_idx_crc, "the .seq.idx", hint)
    try:
        body = crc32_file(seq_idx, SEQ_IDX_HEADER_SIZE)
    except OSError as exc:
        raise ShardError(f"cannot read the .seq.idx ({exc.strerror or exc})", path=seq_idx, hint=hint) from None
    if body != ds.seq_header.body_crc32:
        raise ChecksumError(".seq.idx body CRC-32 differs from its header", path=seq_idx, field="body_crc32",
                            expected=ds.seq_header.body_crc32, actual=body, hint=hint)
    for suffix in CHECKSUMMED_SUFFIXES:
        check_crc(prefix + suffix, ds.metadata.files[suffix].crc32, f"the {suffix} file", hint)
    return ds
