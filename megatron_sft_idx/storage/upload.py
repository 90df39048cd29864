"""The object-store destination of a publication: the primitives :mod:`megatron_sft_idx.publishing`
orders when a shard or a set goes to ``s3://`` / ``msc://``.

Publishing owns the commit rule (data first, ``.idx`` last; the old ``.idx`` removed first;
manifests around a set) for local and object-store destinations alike; this module supplies
the object-store half, with the deadlines and checks of :mod:`._stores`: one listing of a
shard's objects, deletes, uploads (multipart above ``part_size``, parts in parallel; a
shard's data objects in parallel with each other), a small object put from bytes, and the
sizes of the uploaded objects checked against the local files. It never opens a dataset.

``upload_shard``, ``publish``, ``publish_shard`` and ``local_files`` live in
:mod:`megatron_sft_idx.publishing`; their old names here warn and fail (:mod:`megatron_sft_idx._moved`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import os
import tempfile
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from .._moved import moved_getattr
from ..errors import SizeMismatchError
from ..format import ALL_SUFFIXES
from ._stores import ObjectStore, store_for
from ._url import ObjectURL
from .config import StorageConfig

__all__ = ["ObjectDestination"]


class ObjectDestination:
    """Where :mod:`megatron_sft_idx.publishing` puts files in object storage (see its ``LocalDestination``
    for the interface). Every call is one retried, deadline-bounded operation per object."""

    remote = True

    def __init__(self, config: Optional[StorageConfig] = None) -> None:
        self.config = StorageConfig.resolve(config)

    def _store(self, url: ObjectURL) -> ObjectStore:
        return store_for(url, self.config)

    def existing(self, prefix: str) -> List[str]:
        """Suffixes of the shard objects at ``prefix`` (one LIST, or a HEAD per suffix)."""
        url = ObjectURL.parse(prefix)
        return list(self._store(url).stat_files(url, ALL_SUFFIXES))

    def exists(self, path: str) -> bool:
        url = ObjectURL.parse(path)
        return self._store(url).head(url) is not None

    def prepare(self, sources: Iterable[str]) -> None:
        """Nothing to do: the local files are complete (the publisher opened the shard)."""

    def turn(self, prefix: str):
        """Object stores offer no lock: publications of one prefix must not run at once."""
        return contextlib.nullcontext()

    def remove(self, paths: Iterable[str]) -> None:
        for path in paths:
            url = ObjectURL.parse(path)
            self._store(url).delete(url)

    def sync(self, prefix: str) -> None:
        """Nothing to do: a completed request is durable."""

    def put(self, source: str, final: str) -> None:
        url = ObjectURL.parse(final)
        self._store(url).upload(source, url)

    def put_many(self, pairs: Sequence[tuple]) -> None:
        """Upload each ``(local file, URL)``, in parallel (``config.concurrency`` at most)."""
        if not pairs:
            return
        with futures.ThreadPoolExecutor(max_workers=min(len(pairs), self.config.concurrency) or 1) as pool:
            list(pool.map(lambda pair: self.put(*pair), pairs))

    def finish(self, prefix: str, files: Mapping[str, str]) -> None:
        """The uploaded objects' listed sizes equal the local files'.

        Raises:
            SizeMismatchError: naming the object.
        """
        url = ObjectURL.parse(prefix)
        listed = self._store(url).stat_files(url, ALL_SUFFIXES)
        for suffix, path in files.items():
            want = os.path.getsize(path)
            got = listed.get(suffix)
            if got is None or got.size != want:
                raise SizeMismatchError("uploaded object differs in size from the local file",
                                        path=str(url.with_suffix(suffix)), field="size", expected=want,
                                        actual=None if got is None else got.size,
                                        hint="upload the shard again (replace=True)")

    def write_bytes(self, path: str, data: bytes) -> None:
        """One PUT of ``data`` (a manifest: its set's commit point)."""
        with tempfile.TemporaryDirectory(prefix="msi-put-") as tmp:
            local = os.path.join(tmp, "object")
            with open(local, "wb") as f:
                f.write(data)
            self.put(local, path)

    def sizes(self, urls: Sequence[str]) -> Dict[str, int]:
        """``{url: size}`` of those of ``urls`` that exist: one LIST per directory they are in."""
        out: Dict[str, int] = {}
        for parent in sorted({u.rsplit("/", 1)[0] + "/" for u in urls}):
            url = ObjectURL.parse(parent)
            out.update((str(obj), info.size) for obj, info in self._store(url).list(url))
        normal = {u: str(ObjectURL.parse(u)) for u in urls}
        return {u: out[normal[u]] for u in urls if normal[u] in out}


# The shard and set publishers live in megatron_sft_idx.publishing (the one commit rule): their
# old names here name that home and fail; storage never imports the publisher.
__getattr__ = moved_getattr(__name__)
