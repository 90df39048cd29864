"""Another name of :mod:`megatron_sft_idx.packed` (``PackSummary``, ``summarize``,
``FlatPackedSource``), kept so that code importing them from here keeps working."""

from ..packed import MIXED_LAYOUT, FlatPackedSource, PackSummary, runtime_min_packed, summarize

__all__ = ["PackSummary", "summarize", "runtime_min_packed", "FlatPackedSource", "MIXED_LAYOUT"]
