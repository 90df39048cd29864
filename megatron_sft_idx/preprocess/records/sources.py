"""One input file, local or an object in storage, behind one interface.

:func:`input_source` decides once what an input path or URL names -- a :class:`LocalInput` or an
:class:`ObjectInput` (``s3://``, ``msc://``) -- and the rest of :mod:`..records` reads through
the source it returns, never asking again. What differs between the two:

==============  =====================================  ===========================================
                local file                             object (docs/INPUTS.md, "Inputs in
                                                       object storage")
==============  =====================================  ===========================================
``path``        its absolute path                      its URL
``stat()``      ``(size, "")``                         ``(size, ETag)``: one HEAD
``stamp(v)``    ``{"mtime_ns": ...}``                  ``{"etag": v}``
``open(v)``     ``open(name, "rb")``                   ranged GETs through a read-ahead buffer,
                                                       ``If-Match`` version ``v`` (the ETag an
                                                       earlier pass read; ``""``: the one seen at
                                                       open)
``ranged``      False: a mapped read costs nothing     True: every byte read is a request, so a
                                                       reader skips what it does not need
==============  =====================================  ===========================================

The stamp is what the index records beside the sha256 of the bytes; what proves an input
unchanged is that sha256, of the content, for either kind (``--resume``). A version pins every
read of an object to the bytes the index read: an object replaced since fails
(ObjectChangedError) instead of mixing two generations.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from ..._extras import require_extra
from ...storage import is_remote


class InputSource(ABC):
    """One input file: ``name`` as given (what metadata and messages say, and what is opened),
    ``path`` what another process opens (an absolute path, fixed when the source is made, or the
    URL)."""

    name: str
    path: str
    #: whether each byte read is a request (ranged GETs): a reader skips what it does not need
    #: instead of reading past it
    ranged: bool = False

    @abstractmethod
    def stat(self) -> Tuple[int, str]:
        """``(size in bytes, version)``: an object's version is its ETag, a local file's ``""`` (its
        bytes are proven by their sha256 alone).

        Raises:
            OSError (FileNotFoundError: no such file or object); RemoteStorageError: the store failed.
        """

    @abstractmethod
    def stamp(self, version: str) -> dict:
        """What the index records of this input beside its sha256: ``{"mtime_ns": ...}`` for a local
        file, ``{"etag": version}`` for an object (``version``: what :meth:`stat` gave).

        Raises:
            OSError: a local file cannot be stat'ed.
        """

    @abstractmethod
    def open(self, version: str = "", seeking: bool = False, stop: Optional[int] = None):
        """A binary, seekable file object over the input. For an object: pinned to ``version`` (the
        ETag an earlier pass read; ``""``: the one seen at open); ``seeking`` for a reader that seeks
        to the exact ranges it needs (a small read-ahead); ``stop`` where the byte range being read
        ends (nothing after it is fetched ahead).

        Raises:
            OSError (FileNotFoundError: no such file or object); ObjectChangedError: the object
            is not ``version``; RemoteStorageError, RemoteTimeoutError: the store failed.
        """

    @abstractmethod
    def arrow_file(self, version: str = ""):
        """The input as pyarrow's IPC readers read it (a local file mapped; an object as a Python
        file: ranged GETs through the read-ahead buffer).

        Raises:
            MissingExtraError: pyarrow is not installed; what :meth:`open` raises.
        """

    @abstractmethod
    def parquet_file(self, version: str = ""):
        """A context manager giving what ``pyarrow.parquet.ParquetFile`` opens: a local path
        (pyarrow's own file reader), an object as a Python file (ranged GETs)."""


@dataclass(frozen=True)
class LocalInput(InputSource):
    """An input file on this machine's disk."""

    name: str
    path: str

    def stat(self) -> Tuple[int, str]:
        return os.path.getsize(self.name), ""

    def stamp(self, version: str) -> dict:
        return {"mtime_ns": os.stat(self.name).st_mtime_ns}

    def open(self, version: str = "", seeking: bool = False, stop: Optional[int] = None):
        return open(self.name, "rb")

    def arrow_file(self, version: str = ""):
        require_extra("preprocess", "pyarrow")
        import pyarrow as pa   # (an optional, heavy dependency: Arrow inputs only)

        return pa.memory_map(self.name)

    def parquet_file(self, version: str = ""):
        return contextlib.nullcontext(self.name)


@dataclass(frozen=True)
class ObjectInput(InputSource):
    """An input object in storage (``s3://``, ``msc://``), read by ranged GETs pinned to one version."""

    name: str
    ranged = True

    @property
    def path(self) -> str:
        return self.name

    def stat(self) -> Tuple[int, str]:
        from ...storage.objects import stat_object   # (start-up: the object-store layer loads for a URL only)

        info = stat_object(self.name)
        if info is None:
            raise FileNotFoundError(2, "no such object", self.name)
        return info.size, info.etag

    def stamp(self, version: str) -> dict:
        return {"etag": version}

    def open(self, version: str = "", seeking: bool = False, stop: Optional[int] = None):
        # (start-up: the object-store layer loads for a URL only)
        from ...storage.objects import READ_AHEAD, SEEKING_READ_AHEAD, open_object

        return open_object(self.name, version, read_ahead=SEEKING_READ_AHEAD if seeking else READ_AHEAD, stop=stop)

    def arrow_file(self, version: str = ""):
        require_extra("preprocess", "pyarrow")
        import pyarrow as pa   # (an optional, heavy dependency: Arrow inputs only)

        return pa.PythonFile(self.open(version, seeking=True), mode="r")

    def parquet_file(self, version: str = ""):
        return self.open(version, seeking=True)


def input_source(path: Union[str, InputSource]) -> InputSource:
    """The source input ``path`` names: an object for an ``s3://`` / ``msc://`` URL, else a local
    file (a source is returned as it is). The one place an input is told local or remote."""
    if isinstance(path, InputSource):
        return path
    return ObjectInput(path) if is_remote(path) else LocalInput(path, os.path.abspath(path))
