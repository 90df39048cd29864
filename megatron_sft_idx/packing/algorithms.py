"""Global bin packing of sequence lengths into packs of at most ``capacity`` tokens.

Every algorithm returns a :class:`PackAssignment`: one int32 bin id per
sequence (bins numbered in the order they were opened) and the CSR grouping of
sequences per bin (ascending sequence index inside a bin, so the pack contents
do not depend on the algorithm's visiting order). Example::

    a = pack_lengths(lengths, 4096, "first_fit_decreasing", seed=0)
    for b in range(a.n_bins):
        members = a.items[a.offsets[b]:a.offsets[b + 1]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import ShardError
from . import _kernels
from .megatron_lm import megatron_lm_bins

ALGORITHMS = (
    "first_fit_decreasing",
    "first_fit_shuffle",
    "first_fit",
    "best_fit_decreasing",
    "modified_first_fit_decreasing",
    "megatron_lm_mffd",   # Megatron-LM #5017's run-time packs (packing/megatron_lm.py)
)
DEFAULT_ALGORITHM = "first_fit_decreasing"


@dataclass(frozen=True)
class PackAssignment:
    """Which bin each sequence went to.

    Attributes:
        bin_of: int32[N], bin id of sequence i, in ``[0, n_bins)`` (None from
            :func:`pack_lengths_csr`, which frees it to save memory).
        offsets: int64[n_bins + 1], CSR pointers into ``items``.
        items: int32[N] (int64 past 2**31 - 2 sequences), sequence indices grouped by bin,
            ascending inside a bin.
        loads: int64[n_bins], tokens per bin (``<= capacity``).
        capacity: the bin capacity in tokens.
    """

    bin_of: Optional[np.ndarray]
    offsets: np.ndarray
    items: np.ndarray
    loads: np.ndarray
    capacity: int

    @property
    def n_bins(self) -> int:
        return int(self.loads.shape[0])

    def members(self, b: int) -> np.ndarray:
        return self.items[self.offsets[b]:self.offsets[b + 1]]


def index_dtype(n: int):
    """int32 indices up to 2**31 - 2 sequences (half the memory of int64), int64 beyond."""
    return np.int32 if n < 2**31 - 1 else np.int64


def descending_order(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Indices by length descending, ties by index ascending (deterministic): the order of
    ``np.argsort(-lengths, kind="stable")``, by a counting sort in the index dtype."""
    order = np.empty(lengths.size, dtype=index_dtype(lengths.size))
    _kernels.descending_order(lengths, capacity, order)
    return order


def _as_lengths(lengths) -> np.ndarray:
    """int32/int64 lengths are used in place (no copy); anything else becomes int64."""
    arr = np.asarray(lengths)
    if arr.dtype in (np.int32, np.int64) and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=np.int64)


def pack_lengths(lengths, capacity: int, algorithm: str = DEFAULT_ALGORITHM,
                 seed: int = 0) -> PackAssignment:
    """Pack ``lengths`` (tokens per sequence) into as few bins of ``capacity`` as the algorithm finds.

    Memory beyond ``lengths`` (int32 lengths are not copied): ~8 bytes per sequence while
    packing (order, bin id) and 8 after (bin id, ``items``), plus ~40 bytes per bin.

    Args:
        lengths: 1-D integers, each in ``[1, capacity]`` (handle overlong ones first).
        capacity: tokens per bin (the pack size).
        algorithm: one of :data:`ALGORITHMS`.
        seed: used by ``first_fit_shuffle`` only; same seed, same result.

    Raises:
        ShardError: unknown algorithm, or a length outside ``[1, capacity]``.
    """
    return _pack(lengths, capacity, algorithm, seed, keep_bin_of=True)


def pack_lengths_csr(lengths, capacity: int, algorithm: str = DEFAULT_ALGORITHM, seed: int = 0) -> PackAssignment:
    """:func:`pack_lengths` without ``bin_of`` (None), which it frees before returning: the
    CSR grouping is all a planner needs, and the bin ids are 4 bytes per sequence."""
    return _pack(lengths, capacity, algorithm, seed, keep_bin_of=False)


def _pack(lengths, capacity: int, algorithm: str, seed: int, keep_bin_of: bool) -> PackAssignment:
    lengths, capacity = _checked(lengths, capacity, algorithm)
    n = lengths.size
    bin_of = np.full(n, -1, dtype=np.int32)
    n_bins = _place(lengths, capacity, algorithm, seed, bin_of)
    loads = _kernels.bin_loads(bin_of, lengths, n_bins)
    items = np.empty(n, dtype=index_dtype(n))
    offsets = _kernels.group_by_bin(bin_of, n_bins, items)
    return PackAssignment(bin_of=bin_of if keep_bin_of else None, offsets=offsets, items=items, loads=loads,
                          capacity=capacity)


def _checked(lengths, capacity: int, algorithm: str):
    """``(lengths, capacity)`` validated for packing.

    Raises:
        ShardError: unknown algorithm, a bad capacity, or a length outside ``[1, capacity]``.
    """
    lengths = _as_lengths(lengths)
    capacity = int(capacity)
    if algorithm not in ALGORITHMS:
        raise ShardError(f"unknown packing algorithm {algorithm!r}", field="algorithm",
                         expected=list(ALGORITHMS), actual=algorithm)
    if capacity <= 0 or capacity >= 2**31:
        raise ShardError("pack capacity must be in [1, 2**31)", field="pack_size", actual=capacity)
    if lengths.ndim != 1:
        raise ShardError("lengths must be one-dimensional", field="lengths", actual=lengths.shape)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
        raise ShardError(f"sequence {bad} has length {int(lengths[bad])}, outside [1, {capacity}]",
                         field="lengths", hint="drop or truncate overlong sequences before packing")
    return lengths, capacity


def _place(lengths: np.ndarray, capacity: int, algorithm: str, seed: int, bin_of: np.ndarray) -> int:
    """Fill ``bin_of`` by ``algorithm``; returns the number of bins."""
    n = lengths.size
    no_bins = np.empty(0, dtype=np.int64)
    if algorithm == "first_fit":
        return _kernels.first_fit_into(lengths, np.empty(0, dtype=index_dtype(n)), False, capacity, no_bins,
                                       bin_of)
    if algorithm == "first_fit_shuffle":
        # Generator.shuffle of an arange draws exactly what Generator.permutation(n) draws,
        # so this is that permutation, in half the memory.
        order = np.arange(n, dtype=index_dtype(n))
        np.random.default_rng(seed).shuffle(order)
        return _kernels.first_fit_into(lengths, order, True, capacity, no_bins, bin_of)
    if algorithm == "megatron_lm_mffd":
        bins = megatron_lm_bins(lengths, capacity)
        for b, members in enumerate(bins):
            bin_of[members] = b
        return len(bins)
    order = descending_order(lengths, capacity)
    if algorithm == "first_fit_decreasing":
        return _kernels.first_fit_into(lengths, order, True, capacity, no_bins, bin_of)
    if algorithm == "best_fit_decreasing":
        return _kernels.best_fit_into(lengths, order, capacity, bin_of)
    remaining = _kernels.mffd_phases(order, lengths, capacity, bin_of)
    rest = np.empty(n, dtype=order.dtype)
    count = _kernels.unplaced_in_order(order, bin_of, rest)
    del order
    return _kernels.first_fit_into(lengths, rest[:count], True, capacity, remaining, bin_of)
