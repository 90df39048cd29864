"""Another name of :mod:`megatron_sft_idx.open` (``open_packed``, the one dispatcher from a path
or URL to a dataset) and of :mod:`megatron_sft_idx.legacy` (the legacy ``.npy`` and Parquet
readers), kept so that code importing them from here keeps working."""

from ..legacy import RestrictedUnpickler, load_legacy_npy, load_parquet, normalise_bridge_loss
from ..open import open_packed, records_no_identity

__all__ = ["open_packed", "load_legacy_npy", "load_parquet", "RestrictedUnpickler", "records_no_identity",
           "normalise_bridge_loss"]
