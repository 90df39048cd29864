"""Deprecated: the old name of :mod:`megatron_sft_idx.multi` (``MultiShardDataset``, what a spec
of shards names), with :mod:`megatron_sft_idx.manifest` and ``write_manifest``
(:mod:`megatron_sft_idx.publishing`). Importing this module warns once (``FutureWarning``,
:mod:`megatron_sft_idx._moved`); the names below keep working until the version that table names."""

from .._moved import warn_moved

warn_moved(__name__)

from ..manifest import Manifest, load_manifest  # noqa: E402
from ..multi import (  # noqa: E402
    MANIFEST_FORMAT, MultiShardDataset, Selection, check_selections, expand_shards, identities_of,
    is_manifest, read_manifest, select_shards, selection_identities)
from ..publishing import write_manifest  # noqa: E402

__all__ = ["MultiShardDataset", "write_manifest", "read_manifest", "is_manifest", "expand_shards",
           "select_shards", "check_selections", "selection_identities", "identities_of", "Selection",
           "MANIFEST_FORMAT", "Manifest", "load_manifest"]
