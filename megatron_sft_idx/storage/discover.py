"""``open_packed`` for URLs: a remote shard, a remote manifest, a "directory" or glob of shards.

``open_packed("s3://b/sft/train_000")`` is a :class:`~.remote.RemoteIndexedDataset`;
``open_packed("s3://b/sft/all.json")`` reads the manifest (relative prefixes resolve
against the manifest's location, as locally); ``s3://b/sft/`` or ``s3://b/sft`` with
no shard of that name lists the shards under it; ``s3://b/sft/train_*`` globs them.
Lists may mix local prefixes and URLs. Sets open as
:class:`~megatron_sft_idx.training.multi.MultiShardDataset`, whose shards open lazily in
the process that reads them.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Union

from ..errors import ShardError, ShardNotFoundError
from ..format import ALL_SUFFIXES, IDX_SUFFIX, SEQ_IDX_SUFFIX
from ._stores import ObjectStore, store_for
from ._url import ObjectURL, is_remote, join_url
from .config import StorageConfig

__all__ = ["open_remote", "expand_remote", "read_remote_manifest"]


def open_remote(spec: Union[str, Sequence[str]], *, check_packs: bool = False,
                config: Optional[StorageConfig] = None):
    """What ``open_packed`` returns for a URL, or a list holding URLs.

    Raises:
        ShardNotFoundError: nothing at the URL; ShardError: a remote file of a kind this
        reader does not stream (``.npy``, Parquet).
    """
    from ..training.multi import MultiShardDataset

    config = StorageConfig.resolve(config)
    if isinstance(spec, (list, tuple)):
        prefixes: List[str] = []
        for part in spec:
            part = os.fspath(part)
            prefixes.extend(expand_remote(part, config) if is_remote(part) else [part])
        return MultiShardDataset.open(prefixes, check_packs=check_packs)
    url = ObjectURL.parse(spec)
    if url.key.endswith(".json"):
        prefixes, counts, summaries = read_remote_manifest(str(url), config)
        return MultiShardDataset(prefixes, counts, summaries, source=str(url), check_packs=check_packs)
    if url.key.endswith((".npy", ".parquet", ".pq")):
        raise ShardError("remote legacy .npy / Parquet files are not streamed", path=str(url), field="format",
                         hint="convert them to shards (they can then be read from the bucket), or copy "
                              "the file to local disk")
    prefixes = expand_remote(str(url), config)
    if prefixes == [str(url)]:
        from .remote import RemoteIndexedDataset

        return RemoteIndexedDataset(str(url), check_packs=check_packs, config=config)
    return MultiShardDataset.open(prefixes, check_packs=check_packs)


def expand_remote(spec: str, config: Optional[StorageConfig] = None) -> List[str]:
    """Shard URLs named by ``spec``: itself when ``spec.idx`` exists, else the shards directly
    under ``spec/`` (a "directory"), or those matching a glob (``*`` within one path level).

    Raises:
        ShardNotFoundError: no shard matches.
    """
    url = ObjectURL.parse(spec)
    store = store_for(url, StorageConfig.resolve(config))
    if url.has_magic():
        found = _glob(store, url)
    elif url.key.endswith("/") or not url.key:
        found = _shards_under(store, url)
    elif store.stat_files(url, ALL_SUFFIXES):  # any file of a shard here: the reader says what is missing
        return [str(url)]
    else:
        found = _shards_under(store, ObjectURL(url.scheme, url.bucket, url.key + "/"))
    if not found:
        raise ShardNotFoundError("no shard at this URL (no .idx object, nor shards under it)", path=spec,
                                 hint="give a shard prefix (without .idx), a manifest .json, a 'directory' "
                                      "prefix or a glob such as s3://bucket/dir/train_*")
    return found


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


def read_remote_manifest(spec: str, config: Optional[StorageConfig] = None) -> tuple:
    """``(prefixes, counts, summaries)`` of a manifest in object storage (one GET).

    Parsed by the local manifest reader, so both accept exactly the same documents;
    relative prefixes resolve against the manifest's URL, absolute paths and URLs are kept.
    """
    import tempfile

    from ..training.multi import read_manifest

    url = ObjectURL.parse(spec)
    store = store_for(url, StorageConfig.resolve(config))
    info = store.head(url)
    if info is None:
        raise ShardNotFoundError("no manifest at this URL", path=spec)
    with tempfile.TemporaryDirectory(prefix="msi-manifest-") as tmp:
        local = os.path.join(tmp, "manifest.json")
        store.download(url, local, info)
        prefixes, counts, summaries = read_manifest(local)
        base = tmp + os.sep
        resolved = []
        for p in prefixes:
            if p.startswith(base):  # it was relative: resolve against the manifest's URL instead
                resolved.append(join_url(spec, p[len(base):]))
            else:
                resolved.append(p)
    return resolved, counts, summaries
