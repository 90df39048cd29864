"""The optional zlib-ng CRC backend must give zlib's values; the env switch must force zlib."""

import os
import subprocess
import sys
import zlib

import numpy as np

from megatron_sft_idx import _crc


def test_backend_values_equal_zlib(rng):
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    crc_a = crc_b = 0
    for start in range(0, len(data), 77777):  # streamed, odd chunk sizes
        crc_a = _crc.crc32(data[start:start + 77777], crc_a)
        crc_b = zlib.crc32(data[start:start + 77777], crc_b)
    assert crc_a == crc_b == zlib.crc32(data)


def test_zlib_ng_is_used_when_installed_and_env_forces_stdlib():
    try:
        import zlib_ng  # noqa: F401  (only whether it imports)
        expected = "zlib-ng"
    except ImportError:
        expected = "zlib"
    assert _crc.CRC_BACKEND == expected
    code = "from megatron_sft_idx import _crc; print(_crc.CRC_BACKEND)"
    env = dict(os.environ, MEGATRON_SFT_IDX_CRC="zlib")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "zlib"
