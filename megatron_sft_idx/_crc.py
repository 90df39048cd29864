"""CRC-32 (zlib's polynomial) with the fastest backend available.

zlib-ng computes the same values as ``zlib.crc32`` several times faster (SIMD);
it is optional (extra ``[gate]``), and ``MEGATRON_SFT_IDX_CRC=zlib`` forces the
stdlib so both paths are testable.

``crc32_combine(crc_a, crc_b, len_b)`` is the CRC-32 of ``a + b`` from the CRCs of
the parts, without reading them: the merge tool concatenates files with
``copy_file_range`` and gets the output's CRC from the inputs' recorded ones. The
stdlib does not expose zlib's ``crc32_combine``; the pure-Python fallback is
zlib's own method (multiply by x^(8·len_b) modulo the polynomial, a few hundred
operations).
"""

import os
import zlib

crc32 = zlib.crc32
crc32_combine = None
CRC_BACKEND = "zlib"
if os.environ.get("MEGATRON_SFT_IDX_CRC", "") != "zlib":
    try:
        from zlib_ng.zlib_ng import crc32  # noqa: F811  (same signature and values)
        from zlib_ng.zlib_ng import crc32_combine  # noqa: F811
        CRC_BACKEND = "zlib-ng"
    except ImportError:
        pass

_POLY = 0xEDB88320  # reflected IEEE 802.3 polynomial


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial, in zlib's reflected bit order."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


#: x^(2^k) modulo the polynomial, k = 0..31 (zlib's x2n_table).
_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def _crc32_combine_py(crc_a: int, crc_b: int, len_b: int) -> int:
    return _multmodp(_x8nmodp(len_b), crc_a) ^ crc_b


if crc32_combine is None:
    crc32_combine = _crc32_combine_py

__all__ = ["crc32", "crc32_combine", "CRC_BACKEND"]
