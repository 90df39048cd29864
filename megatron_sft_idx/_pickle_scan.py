"""A bounds pre-scan of a pickle stream, before any unpickler sees it (numba, one pass).

CPython's unpickler allocates what a length-prefixed opcode *declares* (``BINBYTES8``,
``BYTEARRAY8``, ``BINUNICODE8``, ``BINBYTES``, ``FRAME``...) before reading it, so a few
bytes can make it allocate gigabytes. :func:`first_bad_opcode` walks the opcodes and
refuses any declared length beyond the bytes that remain, any text argument longer than
:data:`MAX_TEXT_ARG`, an unknown opcode, and a stream without STOP. It does not build
objects; the restricted unpickler runs only on streams that pass.
"""

from __future__ import annotations

import numpy as np

from . import _kernels

MAX_TEXT_ARG = 4096

# Argument kinds per opcode byte: 0 unknown, 1 no argument, 2 fixed size (in _SIZE), 3 length
# prefix of _SIZE bytes (unsigned little-endian) then that many bytes, 4 one text line, 5 two
# text lines, 6 FRAME (8-byte size), 7 STOP.
_KIND = np.zeros(256, np.int8)
_SIZE = np.zeros(256, np.int8)


def _table():
    for op in b"(.012abde}l]oRst)uN\x88\x89\x85\x86\x87\x81\x92\x93\x94\x8f\x90\x91\x97\x98":
        _KIND[op] = 1
    for op, size in ((b"K", 1), (b"M", 2), (b"J", 4), (b"h", 1), (b"j", 4), (b"q", 1), (b"r", 4),
                     (b"\x80", 1), (b"\x82", 1), (b"\x83", 2), (b"\x84", 4), (b"G", 8)):
        _KIND[op[0]], _SIZE[op[0]] = 2, size
    for op, size in ((b"U", 1), (b"C", 1), (b"\x8c", 1), (b"\x8a", 1), (b"T", 4), (b"B", 4), (b"X", 4),
                     (b"\x8b", 4), (b"\x8e", 8), (b"\x8d", 8), (b"\x96", 8)):
        _KIND[op[0]], _SIZE[op[0]] = 3, size
    for op in b"ILFSVPgp":
        _KIND[op] = 4
    for op in b"ci":
        _KIND[op] = 5
    _KIND[0x95] = 6
    _KIND[ord(".")] = 7


_table()


@_kernels._jit
def _scan(data, kind, size, max_text):
    """``(position, reason)`` of the first problem, or ``(-1, 0)``. Reasons: 1 unknown opcode,
    2 argument past the end, 3 declared length past the end, 4 text argument too long, 5 no STOP."""
    n = data.shape[0]
    pos = 0
    while pos < n:
        op = data[pos]
        k = kind[op]
        at = pos
        pos += 1
        if k == 0:
            return at, 1
        if k == 7:
            return -1, 0
        if k == 1:
            continue
        if k == 2:
            if pos + size[op] > n:
                return at, 2
            pos += size[op]
            continue
        if k == 3 or k == 6:
            width = size[op] if k == 3 else 8
            if pos + width > n:
                return at, 2
            length = np.uint64(0)
            for b in range(width):
                length |= np.uint64(data[pos + b]) << np.uint64(8 * b)
            pos += width
            if length > np.uint64(n - pos):
                return at, 3
            if k == 3:
                pos += np.int64(length)
            continue
        lines = 1 if k == 4 else 2
        for _ in range(lines):
            start = pos
            while pos < n and data[pos] != 10:
                pos += 1
                if pos - start > max_text:
                    return at, 4
            if pos >= n:
                return at, 2
            pos += 1
    return n, 5


_REASONS = {1: "an unknown opcode", 2: "an opcode argument runs past the end",
            3: "a declared length exceeds the bytes that remain",
            4: f"a text argument longer than {MAX_TEXT_ARG} bytes", 5: "no STOP opcode"}


def first_bad_opcode(payload: bytes):
    """``None`` when every opcode's declared size fits, else ``(offset, reason text)``."""
    data = np.frombuffer(payload, dtype=np.uint8)
    at, reason = _scan(data, _KIND, _SIZE, MAX_TEXT_ARG)
    return None if at < 0 else (int(at), _REASONS[int(reason)])
