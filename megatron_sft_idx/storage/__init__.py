"""Shards in object storage: ``s3://bucket/prefix`` and ``msc://profile/prefix`` wherever a
prefix is accepted.

Reading: ``MMapIndexedDataset("s3://bucket/train_000")`` (and ``open_packed``, manifests,
``data_path`` blends, the Bridge adapter) opens a remote shard. Its small index files are
cached on local disk once per node (:mod:`.index_cache`); ``.bin`` and ``.loss.bin`` are
read by ranged GETs through an in-memory block cache (:mod:`.blocks`). Writing:
:func:`upload_shard` (``.idx`` last, the commit point) and :func:`publish` (local or
remote destination). Settings: :class:`StorageConfig` (environment variables listed there).

This package's ``__init__`` imports nothing heavy: boto3 / multi-storage-client (extra
``[s3]``) are imported the first time a URL is used.
"""

from .._lazy import lazy_getattr

from ._url import ObjectURL, is_remote

_PUBLIC = {
    "StorageConfig": ".config",
    "RemoteIndexedDataset": ".remote",
    "remote_shard_exists": ".remote",
    "upload_shard": ".upload",
    "publish": ".upload",
    "publish_shard": ".upload",
    "request_counts": "._stores",
}

__all__ = ["ObjectURL", "is_remote", *_PUBLIC]


__getattr__ = lazy_getattr(__name__, _PUBLIC, globals())
