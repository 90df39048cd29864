"""Putting finished shards where training reads them: a bucket or a local directory.

:func:`upload_shard` sends one local shard to ``s3://`` / ``msc://``: the data files
first (multipart above ``part_size``, parts in parallel), ``.idx`` last. Every reader
needs ``.idx``, so it is the commit point, as in local publishing: a reader that looks
before it lands finds an incomplete shard and says so; it never opens a half-uploaded
one. Replacing a shard deletes the old ``.idx`` first, so the old index can never pair
with new data (and readers that opened the old shard are refused by ETag, see
:mod:`._stores`). Sizes are checked against the local files after the upload.

:func:`publish_shard` puts one finished local (staged) shard under an exact prefix,
local or remote; :func:`publish` takes a set — one prefix, a list, or a directory —
and a destination directory, local or remote. Locally, files are copied
(or hard-linked) under temporary names and renamed ``.idx`` last
(``megatron_sft_idx._atomic.publish``); remotely, each shard is uploaded as above.
With ``manifest=NAME`` a manifest of the set is written last, the set's commit point:
a reader of the manifest sees every shard or none.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Sequence, Union

from .. import _atomic
from ..errors import ShardError, ShardExistsError, SizeMismatchError
from ..format import ALL_SUFFIXES, IDX_SUFFIX, PUBLISH_ORDER, ShardPaths
from ._stores import store_for
from ._url import ObjectURL, is_remote
from .config import StorageConfig

__all__ = ["upload_shard", "publish", "publish_shard", "local_files"]


def local_files(prefix: str) -> Dict[str, str]:
    """``{suffix: path}`` of a local shard's files, in publish order (``.idx`` last).

    Raises:
        ShardError: the shard does not open (so nothing broken is ever published).
    """
    from ..reader import MMapIndexedDataset

    shard = MMapIndexedDataset(prefix)  # the reader's open-time checks: complete, consistent sizes
    suffixes = [IDX_SUFFIX, ".bin"] if shard.is_pretrain else list(ALL_SUFFIXES)
    return {s: prefix + s for s in PUBLISH_ORDER if s in suffixes}


def upload_shard(prefix, dest, *, replace: bool = False, config: Optional[StorageConfig] = None) -> Dict[str, str]:
    """Upload the local shard ``prefix`` to the shard URL ``dest`` (``s3://b/dir/name``), ``.idx`` last.

    Returns:
        ``{suffix: object URL}`` of every uploaded file.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false.
        ShardError: the local shard does not open; RemoteStorageError: an upload failed
            (nothing that opens is left at ``dest``: ``.idx`` was not sent).
        SizeMismatchError: an object's listed size differs from its local file after upload.
    """
    from .remote import stat_shard

    prefix = os.fspath(prefix)
    url = ObjectURL.parse(dest)
    config = StorageConfig.resolve(config)
    files = local_files(prefix)
    store = store_for(url, config)
    existing = stat_shard(store, url)
    if existing and not replace:
        raise ShardExistsError("a shard already exists at the destination", path=str(url),
                               actual=sorted(existing), hint="pass replace=True (--replace) to replace it")
    if IDX_SUFFIX in existing:
        store.delete(url.with_suffix(IDX_SUFFIX))  # unpublish first: the old index never meets new data
    for suffix in existing:
        if suffix not in files:  # e.g. SFT companions of an old shard replaced by pretrain data
            store.delete(url.with_suffix(suffix))
    data = [s for s in files if s != IDX_SUFFIX]
    with futures.ThreadPoolExecutor(max_workers=min(len(data), config.concurrency) or 1) as pool:
        list(pool.map(lambda s: store.upload(files[s], url.with_suffix(s)), data))
    store.upload(files[IDX_SUFFIX], url.with_suffix(IDX_SUFFIX))
    _verify_sizes(stat_shard(store, url), files, url)
    return {s: str(url.with_suffix(s)) for s in files}


def _verify_sizes(listed, files: Dict[str, str], url: ObjectURL) -> None:
    for suffix, path in files.items():
        want = os.path.getsize(path)
        got = listed.get(suffix)
        if got is None or got.size != want:
            raise SizeMismatchError("uploaded object differs in size from the local file",
                                    path=str(url.with_suffix(suffix)), field="size", expected=want,
                                    actual=None if got is None else got.size,
                                    hint="upload the shard again (replace=True)")


# --------------------------------------------------------------------------- publish


def publish_shard(prefix, dest, *, replace: bool = False, link: bool = False,
                  config: Optional[StorageConfig] = None) -> str:
    """Publish one finished local shard under the exact prefix ``dest`` (a path or a URL),
    ``.idx`` last. Returns ``dest``.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false (nothing written);
        ShardError: the local shard does not open; RemoteStorageError / OSError while writing.
    """
    prefix, dest = os.fspath(prefix), os.fspath(dest)
    files = local_files(prefix)
    if not replace:
        _refuse_existing(dest, config)
    if is_remote(dest):
        upload_shard(prefix, dest, replace=replace, config=config)
    else:
        if os.path.abspath(dest) == os.path.abspath(prefix):
            raise ShardError("the shard is already at the destination", path=prefix)
        _publish_local(files, dest, link)
    return dest


def publish(source: Union[str, Sequence[str]], dest, *, replace: bool = False, link: bool = False,
            manifest: Optional[str] = None, config: Optional[StorageConfig] = None) -> List[str]:
    """Publish finished local shards into directory ``dest`` (a local path or a URL).

    Args:
        source: a local shard prefix, a list of them, or a directory of shards.
        dest: destination directory; shard ``.../name`` goes to ``dest/name``.
        replace: replace shards of the same name at ``dest``.
        link: local destinations only: hard-link instead of copying.
        manifest: also write a manifest of the published set with this file name into
            ``dest``, last (the set's commit point).

    Returns:
        the published prefixes (paths or URLs), in source order.

    Raises:
        ShardError (ShardExistsError, ...) before anything is written when a shard does not
        open or exists without ``replace``; RemoteStorageError / OSError while writing.
    """
    from ..multi import expand_shards

    prefixes = expand_shards(source)
    names = [os.path.basename(p) for p in prefixes]
    if len(set(names)) != len(names):
        raise ShardError("two shards of the set share a name", field="source", actual=names)
    dest = os.fspath(dest)
    remote = is_remote(dest)
    targets = [str(ObjectURL.parse(dest).join(n)) if remote else os.path.join(dest, n) for n in names]
    for prefix in prefixes:  # every shard opens, before anything is written
        local_files(prefix)
    if not replace:
        for target in targets:
            _refuse_existing(target, config)
    for prefix, target in zip(prefixes, targets):
        publish_shard(prefix, target, replace=True, link=link, config=config)  # existence checked above
    if manifest:
        _publish_manifest(prefixes, dest, manifest, config)
    return targets


def _refuse_existing(target: str, config) -> None:
    if is_remote(target):
        from .remote import stat_shard

        url = ObjectURL.parse(target)
        exists = bool(stat_shard(store_for(url, StorageConfig.resolve(config)), url))
    else:
        exists = any(os.path.lexists(p) for p in ShardPaths.from_prefix(target))
    if exists:
        raise ShardExistsError("a shard already exists at the destination", path=target)


def _publish_local(files: Dict[str, str], target: str, link: bool) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    finals = {s: target + s for s in files}
    _atomic.clear_stale_temporaries(finals.values())
    tmp: Dict[str, str] = {}
    try:
        for suffix, src in files.items():
            tmp[suffix] = _atomic.temporary_path(finals[suffix])
            if link:
                os.link(src, tmp[suffix])
            else:
                shutil.copyfile(src, tmp[suffix])
        _atomic.remove_quietly(p for p in ShardPaths.from_prefix(target) if p not in finals.values())
        _atomic.publish([(tmp[s], finals[s]) for s in files], unpublish_first=target + IDX_SUFFIX)
    except BaseException:
        _atomic.remove_quietly(tmp.values())
        raise


def _publish_manifest(prefixes: List[str], dest: str, name: str, config) -> None:
    """A manifest of the set with prefixes relative to ``dest`` (the shards' names)."""
    from ..multi import write_manifest

    with tempfile.TemporaryDirectory(prefix="msi-manifest-") as tmp:
        # Stage links named like the published shards, so the relative prefixes are bare names.
        staged = []
        for prefix in prefixes:
            for suffix, path in local_files(prefix).items():
                os.symlink(os.path.abspath(path), os.path.join(tmp, os.path.basename(prefix) + suffix))
            staged.append(os.path.join(tmp, os.path.basename(prefix)))
        local = os.path.join(tmp, name)
        write_manifest(local, staged, relative=True)
        if is_remote(dest):
            url = ObjectURL.parse(dest).join(name)
            store_for(url, StorageConfig.resolve(config)).upload(local, url)
        else:
            final = os.path.join(dest, name)
            with open(local, "rb") as f:
                data = f.read()
            _atomic.write_file_atomically(final, lambda out: out.write(data))
