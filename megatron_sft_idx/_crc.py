"""CRC-32 (zlib's polynomial) with the fastest backend available.

zlib-ng computes the same values as ``zlib.crc32`` several times faster (SIMD);
it is optional (extra ``[gate]``), and ``MEGATRON_SFT_IDX_CRC=zlib`` forces the
stdlib so both paths are testable.
"""

import os
import zlib

crc32 = zlib.crc32
CRC_BACKEND = "zlib"
if os.environ.get("MEGATRON_SFT_IDX_CRC", "") != "zlib":
    try:
        from zlib_ng.zlib_ng import crc32  # noqa: F811  (same signature and values)
        CRC_BACKEND = "zlib-ng"
    except ImportError:
        pass

__all__ = ["crc32", "CRC_BACKEND"]
