"""Bin packing of sequence lengths (numba, O(N log N)), parallelism padding, and filling packs."""

from .algorithms import ALGORITHMS, DEFAULT_ALGORITHM, PackAssignment, pack_lengths, pack_lengths_csr
from .fill import exclusive_cumsum, fill_sequences
from .padding import FP8_BLOCK, is_padded, pad_multiple_for, pad_offset, padded_length, padded_lengths, truncation_length
from .stats import packing_summary

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FP8_BLOCK",
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
    "fill_sequences",
    "exclusive_cumsum",
]
