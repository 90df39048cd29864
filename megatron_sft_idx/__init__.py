"""megatron_sft_idx: packed SFT data in an extended Megatron ``.bin/.idx`` format.

Public names are imported lazily (PEP 562), so ``from megatron_sft_idx import
MMapIndexedDataset`` does not import numba; the builder and the validators do.
"""

from ._lazy import lazy_getattr

from .version import __version__

_PUBLIC = {
    "IndexedDatasetBuilder": ".builder",
    "MMapIndexedDataset": ".reader",
    "Pack": ".reader",
    "ShardArrays": ".reader",
    "ShardMetadata": ".metadata",
    "PackingStats": ".metadata",
    "DType": ".format",
    "Rule": ".format",
    "ShardPaths": ".format",
    "ShardError": ".errors",
    "ShardNotFoundError": ".errors",
    "ShardExistsError": ".errors",
    "IncompleteShardError": ".errors",
    "ShardChangedError": ".errors",
    "SizeMismatchError": ".errors",
    "TruncatedFileError": ".errors",
    "HeaderError": ".errors",
    "VersionError": ".errors",
    "DTypeError": ".errors",
    "MetadataError": ".errors",
    "MetadataLimitError": ".errors",
    "ChecksumError": ".errors",
    "InvariantError": ".errors",
    "BuilderStateError": ".errors",
    "InputError": ".errors",
    "check": ".gate",
    "open_packed": ".open",
    "VirtualPackedDataset": ".preprocess.virtual",
}

__all__ = ["__version__", *_PUBLIC]


__getattr__ = lazy_getattr(__name__, _PUBLIC, globals())


def __dir__():
    return sorted(__all__)
