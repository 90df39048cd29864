"""Another name of :mod:`megatron_sft_idx.multi` (``MultiShardDataset``, what a spec of shards
names) and of ``write_manifest`` (:mod:`megatron_sft_idx.publishing`), kept so that code importing them from here keeps working."""

from ..manifest import Manifest, load_manifest
from ..multi import (MANIFEST_FORMAT, MultiShardDataset, Selection, check_selections, expand_shards, identities_of,
                     is_manifest, read_manifest, select_shards, selection_identities)
from ..publishing import write_manifest

__all__ = ["MultiShardDataset", "write_manifest", "read_manifest", "is_manifest", "expand_shards",
           "select_shards", "check_selections", "selection_identities", "identities_of", "Selection",
           "MANIFEST_FORMAT", "Manifest", "load_manifest"]
