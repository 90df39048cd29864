"""Deprecated: the old name of :mod:`megatron_sft_idx.open` (``open_packed``, the one dispatcher
from a path or URL to a dataset) and of :mod:`megatron_sft_idx.legacy` (the legacy ``.npy`` and
Parquet readers). Importing this module warns once (``FutureWarning``,
:mod:`megatron_sft_idx._moved`); the names below keep working until the version that table names."""

from .._moved import warn_moved

warn_moved(__name__)

from ..legacy import RestrictedUnpickler, load_legacy_npy, load_parquet, normalise_bridge_loss  # noqa: E402
from ..open import open_packed, records_no_identity  # noqa: E402

__all__ = ["open_packed", "load_legacy_npy", "load_parquet", "RestrictedUnpickler", "records_no_identity",
           "normalise_bridge_loss"]
