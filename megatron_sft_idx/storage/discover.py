"""``open_packed`` for URLs: a remote shard, a remote manifest, a "directory" or glob of shards.

``open_packed("s3://b/sft/train_000")`` is a :class:`~.remote.RemoteIndexedDataset`;
``open_packed("s3://b/sft/all.json")`` reads the manifest (relative prefixes resolve
against the manifest's location, as locally); ``s3://b/sft/`` or ``s3://b/sft`` with
no shard of that name lists the shards under it; ``s3://b/sft/train_*`` globs them.
Lists may mix local prefixes and URLs. Sets open as
:class:`~megatron_sft_idx.training.multi.MultiShardDataset`, whose shards open lazily in
the process that reads them, after the same checks as local sets: the shards agree, and a
"directory", glob or manifest holds whole sets (:mod:`megatron_sft_idx.sets`).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

from ..errors import ShardError, ShardNotFoundError
from ..format import ALL_SUFFIXES, IDX_SUFFIX, SEQ_IDX_SUFFIX
from ._stores import ObjectStore, store_for
from ._url import ObjectURL
from .config import StorageConfig

__all__ = ["open_remote", "expand_remote", "select_remote", "read_remote_manifest", "load_remote_manifest"]


def open_remote(spec: Union[str, Sequence[str]], *, check_packs: bool = False,
                config: Optional[StorageConfig] = None):
    """What ``open_packed`` returns for a URL, or a list holding URLs.

    Raises:
        ShardNotFoundError: nothing at the URL; ShardError: a remote file of a kind this
        reader does not stream (``.npy``, Parquet).
    """
    from ..training.multi import MultiShardDataset, Selection

    if isinstance(spec, (list, tuple)):
        return MultiShardDataset.open(list(spec), check_packs=check_packs)
    url = ObjectURL.parse(spec)
    if url.key.endswith((".npy", ".parquet", ".pq")):
        raise ShardError("remote legacy .npy / Parquet files are not streamed", path=str(url), field="format",
                         hint="convert them to shards (they can then be read from the bucket), or copy "
                              "the file to local disk")
    if not url.key.endswith(".json"):
        kind, prefixes = select_remote(str(url), config)
        if kind == "prefix":
            from .remote import RemoteIndexedDataset

            return RemoteIndexedDataset(str(url), check_packs=check_packs, config=StorageConfig.resolve(config))
        return MultiShardDataset.open(Selection(kind, str(url), tuple(prefixes)), check_packs=check_packs)
    return MultiShardDataset.open(str(url), check_packs=check_packs)


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


def read_remote_manifest(spec: str, config: Optional[StorageConfig] = None) -> tuple:
    """``(prefixes, counts, summaries)`` of a manifest in object storage (one GET); see
    :func:`load_remote_manifest`."""
    m = load_remote_manifest(spec, config)
    return m.prefixes, m.counts, m.summaries


def load_remote_manifest(spec: str, config: Optional[StorageConfig] = None):
    """The :class:`~megatron_sft_idx.training.manifest.Manifest` at a URL (one GET).

    Parsed by the local manifest parser, so both accept exactly the same documents;
    relative prefixes resolve against the manifest's URL, absolute paths and URLs are kept.

    Raises:
        ShardNotFoundError: no object at the URL; ShardError: a malformed manifest (naming the URL).
    """
    import tempfile

    from ..training.manifest import MAX_MANIFEST_BYTES, load_manifest

    url = ObjectURL.parse(spec)
    store = store_for(url, StorageConfig.resolve(config))
    info = store.head(url)
    if info is None:
        raise ShardNotFoundError("no manifest at this URL", path=spec)
    if info.size > MAX_MANIFEST_BYTES:
        raise ShardError(f"manifest is larger than {MAX_MANIFEST_BYTES >> 20} MiB", path=spec, field="manifest",
                         actual=info.size, hint="rewrite it with write-sft-manifest")
    with tempfile.TemporaryDirectory(prefix="msi-manifest-") as tmp:
        local = os.path.join(tmp, "manifest.json")
        store.download(url, local, info)
        return load_manifest(local, url=str(url))
