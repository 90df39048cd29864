"""Bin packing of sequence lengths (numba, O(N log N)) and parallelism padding helpers."""

from .algorithms import ALGORITHMS, DEFAULT_ALGORITHM, PackAssignment, pack_lengths, pack_lengths_csr
from .padding import is_padded, pad_multiple_for, pad_offset, padded_length, padded_lengths, truncation_length
from .stats import packing_summary

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PackAssignment",
    "pack_lengths",
    "pack_lengths_csr",
    "pad_multiple_for",
    "pad_offset",
    "padded_length",
    "padded_lengths",
    "is_padded",
    "truncation_length",
    "packing_summary",
]
