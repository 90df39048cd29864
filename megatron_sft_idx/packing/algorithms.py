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

import numpy as np

from ..errors import ShardError
from . import _kernels

ALGORITHMS = (
    "first_fit_decreasing",
    "first_fit_shuffle",
    "first_fit",
    "best_fit_decreasing",
    "modified_first_fit_decreasing",
)
DEFAULT_ALGORITHM = "first_fit_decreasing"


@dataclass(frozen=True)
class PackAssignment:
    """Which bin each sequence went to.

    Attributes:
        bin_of: int32[N], bin id of sequence i, in ``[0, n_bins)``.
        offsets: int64[n_bins + 1], CSR pointers into ``items``.
        items: int64[N], sequence indices grouped by bin, ascending inside a bin.
        loads: int64[n_bins], tokens per bin (``<= capacity``).
        capacity: the bin capacity in tokens.
    """

    bin_of: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    loads: np.ndarray
    capacity: int

    @property
    def n_bins(self) -> int:
        return int(self.loads.shape[0])

    def members(self, b: int) -> np.ndarray:
        return self.items[self.offsets[b]:self.offsets[b + 1]]


def _descending(lengths: np.ndarray) -> np.ndarray:
    """Indices by length descending, ties by index ascending (deterministic)."""
    return np.argsort(-lengths, kind="stable")


def pack_lengths(lengths, capacity: int, algorithm: str = DEFAULT_ALGORITHM,
                 seed: int = 0) -> PackAssignment:
    """Pack ``lengths`` (tokens per sequence) into as few bins of ``capacity`` as the algorithm finds.

    Args:
        lengths: 1-D integers, each in ``[1, capacity]`` (handle overlong ones first).
        capacity: tokens per bin (the pack size).
        algorithm: one of :data:`ALGORITHMS`.
        seed: used by ``first_fit_shuffle`` only; same seed, same result.

    Raises:
        ShardError: unknown algorithm, or a length outside ``[1, capacity]``.
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    capacity = int(capacity)
    if algorithm not in ALGORITHMS:
        raise ShardError(f"unknown packing algorithm {algorithm!r}", field="algorithm",
                         expected=list(ALGORITHMS), actual=algorithm)
    if capacity <= 0:
        raise ShardError("pack capacity must be positive", field="pack_size", actual=capacity)
    if lengths.ndim != 1:
        raise ShardError("lengths must be one-dimensional", field="lengths", actual=lengths.shape)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
        raise ShardError(f"sequence {bad} has length {int(lengths[bad])}, outside [1, {capacity}]",
                         field="lengths", hint="drop or truncate overlong sequences before packing")
    empty = np.empty(0, dtype=np.int64)
    if algorithm == "first_fit":
        bin_of, n_bins = _kernels.first_fit_kernel(lengths, np.arange(lengths.size), capacity, empty)
    elif algorithm == "first_fit_shuffle":
        order = np.random.default_rng(seed).permutation(lengths.size)
        bin_of, n_bins = _kernels.first_fit_kernel(lengths, order, capacity, empty)
    elif algorithm == "first_fit_decreasing":
        bin_of, n_bins = _kernels.first_fit_kernel(lengths, _descending(lengths), capacity, empty)
    elif algorithm == "best_fit_decreasing":
        bin_of, n_bins = _kernels.best_fit_kernel(lengths, _descending(lengths), capacity)
    else:
        bin_of, n_bins = _modified_first_fit_decreasing(lengths, capacity)
    offsets, items = _kernels.group_by_bin(bin_of, n_bins)
    loads = _kernels.bin_loads(bin_of, lengths, n_bins)
    return PackAssignment(bin_of=bin_of, offsets=offsets, items=items, loads=loads, capacity=capacity)


def _modified_first_fit_decreasing(lengths: np.ndarray, capacity: int):
    order = _descending(lengths)
    bin_of, remaining = _kernels.mffd_phases(order, lengths, capacity)
    rest = order[bin_of[order] < 0]
    placed, n_bins = _kernels.first_fit_kernel(lengths, rest, capacity, remaining)
    bin_of[rest] = placed[rest]
    return bin_of, n_bins
