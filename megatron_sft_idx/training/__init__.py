"""Training integration: Megatron-LM ``data_path`` datasets, Megatron-Bridge packed datasets.

Modules (imported on first use, so importing this package costs nothing):

* :mod:`.megatron` — ``SFTIndexedDataset`` for megatron-core's blended builder,
  ``parse_data_path``, the Megatron-LM dataset provider (imports megatron-core);
* :mod:`.bridge` — ``PackedSFTDataset`` with Bridge's packed interface;
* :mod:`.collate` — ``PackedCollator``: Bridge's packed batch, vectorised;
* :mod:`.multi` — ``MultiShardDataset`` and manifests;
* :mod:`.factory` — ``open_packed`` for shards, manifests, legacy ``.npy`` and Parquet.
"""

from .._lazy import lazy_getattr

_PUBLIC = {
    "open_packed": ".factory",
    "load_legacy_npy": ".factory",
    "load_parquet": ".factory",
    "RestrictedUnpickler": ".factory",
    "MultiShardDataset": ".multi",
    "write_manifest": ".multi",
    "read_manifest": ".multi",
    "PackedSFTDataset": ".bridge",
    "build_samples_mapping": ".bridge",
    "bridge_datasets": ".bridge",
    "PackedCollator": ".collate",
    "collate_fn": ".collate",
    "PackSummary": "._sources",
    "summarize": "._sources",
    "FlatPackedSource": "._sources",
    "SFTIndexedDataset": ".megatron",
    "SFTIndexedDatasetConfig": ".megatron",
    "parse_data_path": ".megatron",
    "parse_per_split_data_path": ".megatron",
    "train_valid_test_datasets_provider": ".megatron",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_getattr(__name__, _PUBLIC, globals())


def __dir__():
    return sorted(__all__)
