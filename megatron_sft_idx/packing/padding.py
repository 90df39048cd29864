"""Per-sequence padding multiples for context/tensor/sequence parallelism.

Context parallelism splits every sequence into ``2*CP`` chunks (two per rank,
for causal load balance), so each sequence length must be a multiple of
``2*CP``; with sequence parallelism each of those chunks is further split over
the TP ranks, so the length must also be a multiple of ``CP*TP``.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ShardError


def pad_multiple_for(cp: int = 1, tp: int = 1, sp: bool = False) -> int:
    """The multiple every sequence length must have: ``lcm(2*CP, CP*TP)`` with SP, ``2*CP`` without.

    With ``CP == 1`` there is no chunking, so the multiple is 1 (or TP with SP).

    Raises:
        ShardError: CP or TP below 1.
    """
    for name, value in (("cp", cp), ("tp", tp)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ShardError(f"--{name} must be an integer >= 1", field=name, actual=value)
    cp_mult = 2 * cp if cp > 1 else 1
    return math.lcm(cp_mult, cp * tp) if sp else cp_mult


def padded_lengths(lengths, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple`` (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // multiple) * multiple


def truncation_length(pack_size: int, multiple: int) -> int:
    """The longest sequence length that fits ``pack_size`` and is a multiple of ``multiple``."""
    return (pack_size // multiple) * multiple
