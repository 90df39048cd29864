"""Single objects in storage as read-only files: what an input reader opens for a URL.

:func:`open_object` gives a seekable, buffered, read-only binary file over one object, as
``open(path, "rb")`` gives one over a local file: ``read``, ``readinto``, ``seek``, ``tell``,
usable by ``gzip``, ``zstandard``, and pyarrow (``pyarrow.PythonFile``). Every byte comes
from a ranged GET of this package's stores (deadline, retries, the response checked against
the request) carrying ``If-Match`` with the ETag pinned at open -- the one seen by the HEAD at
open, or the one the caller gives (the version an earlier pass read): an object replaced
while it is read, or since that pass, fails with
:class:`~megatron_sft_idx.errors.ObjectChangedError` instead of mixing two generations.

Memory: one read-ahead buffer (:data:`READ_AHEAD` bytes, the size of most GETs) per open
file (:data:`SEEKING_READ_AHEAD` for a reader that asks for exact ranges), never past the end
of the byte range being read; a read larger than the buffer is fetched straight into the
caller's buffer, in GETs of at most :data:`MAX_GET` bytes. :func:`list_objects` and :func:`stat_object` are the listing
and the HEAD an input expansion needs. Nothing here knows what the bytes hold.

The client under all of it is public here too: :func:`store_for` gives this process's
:class:`ObjectStore` for a URL's scheme and settings (created on first use; list, head, ranged
reads, downloads, uploads, conditional writes, server-side copies, deletes, each one retried,
deadline-bounded operation). The clients themselves live in the private ``storage._stores``,
the one module that imports boto3 and multi-storage-client (contract ``object-store-clients``).
"""

from __future__ import annotations

import io
from typing import List, Optional, Tuple

from ..errors import ObjectChangedError, ShardNotFoundError
from ._stores import ObjectInfo, ObjectStore, store_for
from .config import StorageConfig
from .urls import ObjectURL

__all__ = ["ObjectInfo", "ObjectStore", "store_for", "open_object", "stat_object", "list_objects", "READ_AHEAD",
           "SEEKING_READ_AHEAD", "MAX_GET"]

#: Bytes a buffered object file fetches ahead of its reader (one GET each when read sequentially).
READ_AHEAD = 8 << 20
#: The buffer of a reader that seeks to the exact ranges it needs (Parquet column chunks, Arrow batches).
SEEKING_READ_AHEAD = 256 << 10
#: The most bytes one GET of a large read asks for.
MAX_GET = 64 << 20


def stat_object(url: str, config: Optional[StorageConfig] = None) -> Optional[ObjectInfo]:
    """Size and ETag of the object at ``url`` (one HEAD), or None when there is none."""
    parsed = ObjectURL.parse(url)
    return store_for(parsed, StorageConfig.resolve(config)).head(parsed)


def list_objects(url: str, config: Optional[StorageConfig] = None) -> List[Tuple[str, ObjectInfo]]:
    """``[(object URL, info)]`` of every object whose key starts with ``url``'s key, at any
    depth, sorted by key (one listing, paged)."""
    parsed = ObjectURL.parse(url)
    listed = store_for(parsed, StorageConfig.resolve(config)).list(parsed, recursive=True)
    return sorted(((str(u), info) for u, info in listed), key=lambda item: item[0])


class ObjectFile(io.RawIOBase):
    """The unbuffered file over one object version (use :func:`open_object`): each ``readinto``
    is one ranged GET (``If-Match`` the pinned ETag) of at most :data:`MAX_GET` bytes."""

    def __init__(self, url: str, info: ObjectInfo, config: StorageConfig, stop: Optional[int] = None) -> None:
        super().__init__()
        self.url = ObjectURL.parse(url)
        self.name = str(self.url)
        self.info = info
        self.size = info.size
        self.config = config
        self._pos = 0
        self.stop = stop   # no GET runs on past this offset from before it (reads after it still work)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        if self.closed:
            raise ValueError("I/O operation on a closed object file")
        view = memoryview(buffer).cast("B")
        length = min(len(view), MAX_GET, max(0, self.size - self._pos))
        if self.stop is not None and self._pos < self.stop:
            length = min(length, self.stop - self._pos)   # (a short read: the buffer asks again past it)
        if length <= 0:
            return 0
        store = store_for(self.url, self.config)   # (this process's: a forked worker has its own)
        data = store.read_range(self.url, self._pos, length, self.info.etag)
        view[:length] = data
        self._pos += length
        return length


    def readall(self) -> bytes:
        """The rest of the object, in GETs of at most :data:`MAX_GET` bytes (``read()`` of the
        buffered file lands here: :class:`io.RawIOBase`'s own would GET 8 KiB at a time)."""
        out = bytearray(max(0, self.size - self._pos))
        view, got = memoryview(out), 0
        while got < len(out):
            n = self.readinto(view[got:])
            if not n:
                break
            got += n
        view.release()
        return bytes(out[:got])


def open_object(url: str, etag: str = "", config: Optional[StorageConfig] = None,
                info: Optional[ObjectInfo] = None, read_ahead: int = READ_AHEAD,
                stop: Optional[int] = None) -> io.BufferedReader:
    """A buffered, seekable, read-only binary file over the object at ``url``, pinned to one
    version: ``etag`` when given (the version the caller read before), else the one the HEAD
    at open sees (``info``: what a listing already said, saving that HEAD when no ``etag``
    is asked for). ``read_ahead``: the buffer's size (the usual GET of sequential reads; a
    reader that seeks to exact ranges, as pyarrow does, wants a small one); ``stop``: where
    the caller's reads end (a byte range's end), so reading ahead fetches nothing after it.

    Raises:
        FileNotFoundError: there is no such object (as ``open`` says it of a local file).
        ObjectChangedError: the object is not the version ``etag`` names (replaced since), at
            open or at any read.
        RemoteStorageError, RemoteTimeoutError, ResponseMismatchError: the store failed.
    """
    cfg = StorageConfig.resolve(config)
    if info is None or (etag and info.etag != etag):
        try:
            info = stat_object(url, cfg)
        except ShardNotFoundError:
            info = None
        if info is None:
            raise FileNotFoundError(2, "no such object", url)
    if etag and info.etag and info.etag != etag:
        raise ObjectChangedError("the object was replaced since it was read before (its ETag changed)", path=url,
                                 field="etag", expected=etag, actual=info.etag)
    pinned = ObjectInfo(info.size, etag or info.etag)
    return io.BufferedReader(ObjectFile(url, pinned, cfg, stop), buffer_size=read_ahead)
