"""Filling packs: sequences copied into a chunk of packs with the truncated-end mask rule.

Shared by the materialize step and virtual packs (``preprocess/materialize.py``) and by
``convert-packed`` from pretrain data (``tools/convert_to_shard.py``): the one place the rule
"a truncated sequence trains nothing after its new last token" is written. numba, ``cache=True``.
"""

from __future__ import annotations

import numpy as np

from .._numba import numba


@numba.njit(cache=True)
def fill_sequences(out_ids, out_mask, dst, src_ids, src_mask, src_start, copy_len, full_len, drop_cut_turn=False):
    """Copy sequence k (``copy_len[k]`` tokens from ``src_start[k]``) to ``dst[k]`` in the chunk.

    A truncated sequence (``copy_len < full_len``) gets mask 0 on its new last
    token: under label alignment nothing is predicted after a sequence ends.
    With ``drop_cut_turn`` (``--truncated-turn-loss drop``) the whole trained run the cut
    falls in (the assistant turn cut short) gets mask 0 too.
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
            if drop_cut_turn and src_mask[s + n - 1] != 0:
                j = n - 1
                while j >= 0 and out_mask[d + j] != 0:
                    out_mask[d + j] = 0
                    j -= 1
            out_mask[d + n - 1] = 0


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """``[0, v0, v0+v1, ...]`` (int64, one longer than ``values``): where each item starts, and the end."""
    out = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out
