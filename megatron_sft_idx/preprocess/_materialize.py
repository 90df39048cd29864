"""numba kernel that copies store sequences into a chunk of packs (``cache=True``)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def fill_sequences(out_ids, out_mask, dst, src_ids, src_mask, src_start, copy_len, full_len):
    """Copy sequence k (``copy_len[k]`` tokens from ``src_start[k]``) to ``dst[k]`` in the chunk.

    A truncated sequence (``copy_len < full_len``) gets mask 0 on its new last
    token: under label alignment nothing is predicted after a sequence ends.
    Padding positions are left as the caller filled them (pad id, mask 0).
    """
    for k in range(dst.shape[0]):
        d = dst[k]
        s = src_start[k]
        n = copy_len[k]
        for j in range(n):
            out_ids[d + j] = src_ids[s + j]
            out_mask[d + j] = src_mask[s + j]
        if n < full_len[k]:
            out_mask[d + n - 1] = 0


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out
