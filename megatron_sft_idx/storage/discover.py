"""Finding shards in object storage: what a URL names, by listing (no dataset is opened here).

``s3://b/sft/train_000`` with any file of a shard is a prefix; ``s3://b/sft/`` or
``s3://b/sft`` with no shard of that name is a "directory" whose shards are listed;
``s3://b/sft/train_*`` globs them (``*`` within one path level). :func:`read_object` fetches a
small object whole (a manifest). What a URL then opens as is decided by
:func:`megatron_sft_idx.open.open_packed` (the one dispatcher), with the set checks of
:mod:`megatron_sft_idx.multi`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..errors import ShardNotFoundError
from ..format import ALL_SUFFIXES, IDX_SUFFIX, SEQ_IDX_SUFFIX
from ._stores import ObjectStore, store_for
from .config import StorageConfig
from .urls import ObjectURL

__all__ = ["expand_remote", "select_remote", "read_object"]


def expand_remote(spec: str, config: Optional[StorageConfig] = None) -> List[str]:
    """Shard URLs named by ``spec``: itself when ``spec.idx`` exists, else the shards directly
    under ``spec/`` (a "directory"), or those matching a glob (``*`` within one path level).

    Raises:
        ShardNotFoundError: no shard matches.
    """
    return select_remote(spec, config)[1]


def select_remote(spec: str, config: Optional[StorageConfig] = None) -> Tuple[str, List[str]]:
    """``(kind, shard URLs)`` named by ``spec``: ``("prefix", [spec])``, ``("directory", ...)``
    or ``("glob", ...)`` (see :func:`expand_remote`).

    Raises:
        ShardNotFoundError: no shard matches.
    """
    url = ObjectURL.parse(spec)
    store = store_for(url, StorageConfig.resolve(config))
    if url.has_magic():
        kind, found = "glob", _glob(store, url)
    elif url.key.endswith("/") or not url.key:
        kind, found = "directory", _shards_under(store, url)
    elif store.stat_files(url, ALL_SUFFIXES):  # any file of a shard here: the reader says what is missing
        return "prefix", [str(url)]
    else:
        kind, found = "directory", _shards_under(store, ObjectURL(url.scheme, url.bucket, url.key + "/"))
    if not found:
        raise ShardNotFoundError("no shard at this URL (no .idx object, nor shards under it)", path=spec,
                                 hint="give a shard prefix (without .idx), a manifest .json, a 'directory' "
                                      "prefix or a glob such as s3://bucket/dir/train_*")
    return kind, found


def _shards_under(store: ObjectStore, directory: ObjectURL) -> List[str]:
    listed = store.list(directory)
    keys = sorted(u.key for u, _ in listed)
    return [str(ObjectURL(directory.scheme, directory.bucket, k[: -len(IDX_SUFFIX)])) for k in keys
            if k.endswith(IDX_SUFFIX) and not k.endswith(SEQ_IDX_SUFFIX)]


def _glob(store: ObjectStore, pattern: ObjectURL) -> List[str]:
    """Shards whose prefix (or whose ``.idx``) matches ``pattern``; the listing starts at the
    longest literal part of the key, so only that part of the bucket is listed."""
    literal = pattern.key
    for i, c in enumerate(pattern.key):
        if c in "*?[":
            literal = pattern.key[:i]
            break
    idx_pattern = pattern if pattern.key.endswith(IDX_SUFFIX) else pattern.with_suffix(IDX_SUFFIX)
    listed = store.list(ObjectURL(pattern.scheme, pattern.bucket, literal), recursive=True)
    out = []
    for url, _ in listed:
        if url.key.endswith(IDX_SUFFIX) and not url.key.endswith(SEQ_IDX_SUFFIX) and url.matches(idx_pattern):
            out.append(str(ObjectURL(url.scheme, url.bucket, url.key[: -len(IDX_SUFFIX)])))
    return sorted(out)


def read_object(spec: str, limit: int, config: Optional[StorageConfig] = None) -> Tuple[Optional[int], Optional[bytes]]:
    """``(size, bytes)`` of the object at ``spec``, read whole by ranged GETs within one deadline
    when it holds at most ``limit`` bytes: ``(None, None)`` when there is no such object,
    ``(size, None)`` when it is larger (nothing of it is read)."""
    url = ObjectURL.parse(spec)
    store = store_for(url, StorageConfig.resolve(config))
    info = store.head(url)
    if info is None:
        return None, None
    if info.size > limit:
        return info.size, None
    return info.size, b"".join(store.read_chunks(url, info.size, info.etag))
