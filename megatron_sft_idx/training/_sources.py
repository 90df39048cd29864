"""Deprecated: the old name of :mod:`megatron_sft_idx.packed` (``PackSummary``, ``summarize``,
``FlatPackedSource``). Importing this module warns once (``FutureWarning``,
:mod:`megatron_sft_idx._moved`); the names below keep working until the version that table names."""

from .._moved import warn_moved

warn_moved(__name__)

from ..packed import MIXED_LAYOUT, FlatPackedSource, PackSummary, runtime_min_packed, summarize  # noqa: E402

__all__ = ["PackSummary", "summarize", "runtime_min_packed", "FlatPackedSource", "MIXED_LAYOUT"]
