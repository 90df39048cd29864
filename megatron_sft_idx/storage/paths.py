"""A local path or an ``s3://`` / ``msc://`` URL, read alike: the decisions every reader of a
manifest, an order file or a shard spec would otherwise make for itself, made here once.

* names: :func:`beside` (a name resolved against the directory of a file, as a manifest's
  entries and an order's file are), :func:`comparable` (the spelling two names of one place
  compare by), :func:`relative_name` (how a file names another: relative where both are in
  one place);
* small files read whole: :func:`names_file`, :func:`read_whole` (a manifest, an order file);
* shard specs: :func:`select` (a prefix, a "directory" or a glob: a URL by listing its
  store, a local path by the caller's rule), :func:`idx_missing` (a listed shard's ``.idx``).

Reading a local path never loads the object-store clients: the URL branches import the
store's modules when they are taken. Nothing here knows a dataset or a manifest's format.
"""

from __future__ import annotations

import os
import posixpath
from typing import Callable, List, Optional, Tuple

from ..format import ALL_SUFFIXES, IDX_SUFFIX
from .config import StorageConfig
from .urls import ObjectURL, is_remote, join_url

__all__ = ["beside", "comparable", "relative_name", "normal", "names_file", "read_whole", "select", "idx_missing"]

#: What a shard spec selects: ``(kind, prefixes)``, ``kind`` one of ``"prefix"``, ``"directory"``, ``"glob"``.
Selected = Tuple[str, List[str]]


def beside(anchor: str, name: str) -> str:
    """``name`` resolved against the directory of the file ``anchor`` (a path or a URL); an
    absolute path or a URL is kept as it is."""
    if os.path.isabs(name) or is_remote(name):
        return name
    if is_remote(anchor):
        return join_url(anchor, name)
    return os.path.join(os.path.dirname(anchor), name)


def comparable(path: str) -> str:
    """The spelling two names of one place compare by: a local path normalised
    (``a/./b`` is ``a/b``), a URL as it is."""
    return path if is_remote(path) else os.path.normpath(path)


def relative_name(path: str, anchor: str, relative: bool = True) -> str:
    """How the file ``anchor`` names ``path``: relative to ``anchor``'s directory when
    ``relative`` and both are local (or both URLs of one bucket, ``path`` below that
    directory), else absolute (a local path made absolute, a URL as it is)."""
    if is_remote(path) or is_remote(anchor):
        if relative and is_remote(path) and is_remote(anchor):
            a, m = ObjectURL.parse(path), ObjectURL.parse(anchor)
            rel = posixpath.relpath("/" + a.key, posixpath.dirname("/" + m.key))
            if (a.scheme, a.bucket) == (m.scheme, m.bucket) and not rel.startswith(".."):
                return rel
        return path
    stored = os.path.abspath(path)
    return os.path.relpath(stored, os.path.dirname(os.path.abspath(anchor))) if relative else stored


def names_file(path: str) -> bool:
    """Whether ``path`` may name a file to read whole: an existing local file, or any URL
    (whether its object is there is for :func:`read_whole` to say: no request is made here)."""
    return is_remote(path) or os.path.isfile(path)


def normal(path: str) -> str:
    """The absolute spelling of ``path``: a local path made absolute, a URL normalised."""
    return str(ObjectURL.parse(path)) if is_remote(path) else os.path.abspath(path)


def read_whole(path: str, limit: int,
               config: Optional[StorageConfig] = None) -> Tuple[Optional[int], Optional[bytes]]:
    """``(size, bytes)`` of the local file or the object at ``path``, read whole when it holds
    at most ``limit`` bytes: ``(None, None)`` when there is none, ``(size, None)`` when it is
    larger (then nothing past ``limit`` is read). An object is read by ranged GETs within one
    deadline (:func:`.discover.read_object`).

    Raises:
        OSError (not a ShardError): a local file that is there cannot be read (the caller
            names it); ShardError (RemoteStorageError, RemoteTimeoutError, ...): the store failed.
    """
    if is_remote(path):
        from .discover import read_object   # (start-up: the object-store clients load only for a URL)

        return read_object(path, limit, config)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return None, None
    if size > limit:
        return size, None
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None, None
    return (len(data), data) if len(data) <= limit else (len(data), None)


def select(spec: str, local: Callable[[str], Selected]) -> Selected:
    """``(kind, shard prefixes)`` named by ``spec``: for a URL by listing its store
    (:func:`.discover.select_remote`: a prefix, a "directory" or a glob), for a local path by
    ``local(spec)``, the caller's rule for its disk.

    Raises:
        ShardNotFoundError: a URL that names no shard; whatever ``local`` raises.
    """
    if is_remote(spec):
        from .discover import select_remote   # (start-up: the object-store clients load only for a URL)

        return select_remote(spec)
    return local(spec)


def idx_missing(prefix: str, *, urls: bool = True) -> str:
    """``''`` when the shard at ``prefix`` has its ``.idx`` (a local ``stat``; a URL: one
    listing, or not looked at unless ``urls``); else what is there: ``".idx missing"`` or
    ``".idx missing, other files of the shard present"``.

    Raises:
        RemoteStorageError, RemoteTimeoutError: listing the store failed.
    """
    if is_remote(prefix):
        if not urls:
            return ""
        from .objects import store_for   # (start-up: the object-store clients load
        from .remote import stat_shard   # only for a URL)

        url = ObjectURL.parse(prefix)
        found = stat_shard(store_for(url, StorageConfig.resolve(None)), url)
        if IDX_SUFFIX in found:
            return ""
        return ".idx missing, other files of the shard present" if found else ".idx missing"
    if os.path.exists(prefix + IDX_SUFFIX):
        return ""
    others = any(os.path.exists(prefix + s) for s in ALL_SUFFIXES)
    return ".idx missing, other files of the shard present" if others else ".idx missing"
