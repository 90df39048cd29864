"""Training integration: Megatron-LM ``data_path`` datasets, Megatron-Bridge packed datasets.

Modules (imported on first use, so importing this package costs nothing):

* :mod:`.megatron` — ``SFTIndexedDataset`` for megatron-core's blended builder,
  ``parse_data_path``, the Megatron-LM dataset provider (imports megatron-core);
* :mod:`.bridge` — ``PackedSFTDataset`` with Bridge's packed interface;
* :mod:`.collate` — ``PackedCollator``: Bridge's packed batch, vectorised;
* :mod:`.hf` — ``PaddingFreeDataset``, ``PaddingFreeCollator``: TRL / transformers padding-free batches;
* :mod:`.nemo_rl` — ``NemoRLPackedDataset``: NeMo-RL's pre-packed SFT datum (PR #3380) with our masks;
* :mod:`.global_batch` — ``GlobalBatchSequences``: Bridge 0.7's global-batch packing samples, one a sequence.

The data sources they read are named here too, from the modules below training that own them:
``open_packed`` (:mod:`megatron_sft_idx.open`, the one dispatcher), ``MultiShardDataset``
(:mod:`megatron_sft_idx.multi`), ``write_manifest`` (:mod:`megatron_sft_idx.publishing`), ``PackSummary`` (:mod:`megatron_sft_idx.packed`),
the legacy ``.npy`` / Parquet readers (:mod:`megatron_sft_idx.legacy`). The old modules
``.factory``, ``.multi``, ``.manifest`` and ``._sources`` warn once on import and go in 0.2.0
(:mod:`megatron_sft_idx._moved`).
"""

from .._lazy import lazy_getattr

_PUBLIC = {
    "open_packed": "..open",
    "load_legacy_npy": "..legacy",
    "load_parquet": "..legacy",
    "RestrictedUnpickler": "..legacy",
    "MultiShardDataset": "..multi",
    "write_manifest": "..publishing",
    "read_manifest": "..multi",
    "PackedSFTDataset": ".bridge",
    "build_samples_mapping": ".bridge",
    "bridge_datasets": ".bridge",
    "PackedCollator": ".collate",
    "collate_fn": ".collate",
    "PaddingFreeDataset": ".hf",
    "PaddingFreeCollator": ".hf",
    "NemoRLPackedDataset": ".nemo_rl",
    "GlobalBatchSequences": ".global_batch",
    "PackSummary": "..packed",
    "summarize": "..packed",
    "FlatPackedSource": "..packed",
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
