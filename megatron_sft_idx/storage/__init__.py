"""Shards in object storage: ``s3://bucket/prefix`` and ``msc://profile/prefix`` wherever a
prefix is accepted.

Reading: ``MMapIndexedDataset("s3://bucket/train_000")`` (and ``open_packed``, manifests,
``data_path`` blends, the Bridge adapter) opens a remote shard: the reader composes this
package's source (:mod:`.remote`). Its small index files are cached on local disk once per
node (:mod:`.index_cache`); ``.bin`` and ``.loss.bin`` are read by ranged GETs through an
in-memory block cache (:mod:`.blocks`). Writing: every writer holds a destination
(:mod:`.destination`: a local directory or object storage, one interface: listing, sizes,
names, staging, the publishing primitives, reading back), and :mod:`megatron_sft_idx.publishing`
orders every publication through it (``.idx`` last, the commit point). (``upload_shard``,
``publish``, ``publish_shard`` and ``RemoteIndexedDataset``, once named here, live in
:mod:`megatron_sft_idx.publishing` and :mod:`megatron_sft_idx.reader`; the old names warn and
fail.) Single objects as read-only, seekable files (``open_object``: what ``preprocess-sft
--input s3://...`` reads through), with the listing and HEAD an input expansion needs:
:mod:`.objects`. Settings: :class:`StorageConfig` (environment variables listed there).

This package's ``__init__`` imports nothing heavy: boto3 / multi-storage-client (extra
``[s3]``) are imported the first time a URL is used. Nothing in it imports the reader.
"""

from .._lazy import lazy_getattr
from .._moved import moved_getattr

from .urls import ObjectURL, is_remote

_PUBLIC = {
    "StorageConfig": ".config",
    "Destination": ".destination",
    "LocalDestination": ".destination",
    "ObjectDestination": ".destination",
    "destination_for": ".destination",
    "remote_shard_exists": ".remote",
    "request_counts": "._stores",
    "open_object": ".objects",
    "stat_object": ".objects",
    "list_objects": ".objects",
}

__all__ = ["ObjectURL", "is_remote", *_PUBLIC]


__getattr__ = moved_getattr(__name__, lazy_getattr(__name__, _PUBLIC, globals()))
