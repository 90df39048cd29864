"""Bin packing of sequence lengths (numba, O(N log N)) and parallelism padding helpers."""

from .algorithms import ALGORITHMS, DEFAULT_ALGORITHM, PackAssignment, pack_lengths, pack_lengths_csr
from .padding import pad_multiple_for, padded_lengths, truncation_length
from .stats import packing_summary

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PackAssignment",
    "pack_lengths",
    "pack_lengths_csr",
    "pad_multiple_for",
    "padded_lengths",
    "truncation_length",
    "packing_summary",
]
