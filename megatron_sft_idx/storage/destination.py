"""Where outputs go: one location type for a local directory and for object storage.

Every writer of the project -- the builder's publish, ``preprocess-sft`` / ``repack-sft``,
promotion, the shard tools -- holds a :class:`Destination` and never asks which kind it is
(the habit of Energon's ``EPath`` and mosaicml streaming's uploaders: local is one more
destination). :func:`destination_for` is the one place that tells a path from a URL when
writing.

A destination owns (each method's contract is on :class:`Destination`): **names** (``join``,
``name``, ``parent``, ``normal``, ``key``, ``same``); **listing** (``listing``, ``existing``,
``exists``, ``sizes``); **staging** (``work_prefix``, ``staging``: beside the output on its
filesystem, or a local temporary directory for a URL); the **publishing primitives**
(``prepare``, ``turn``, ``remove``, ``sync``, ``put`` / ``put_many``, ``copying``, ``finish``,
``write_bytes``, ``stamp``, ``temporary``, ``make_directory``); **reading back** (``read``,
``read_head``, ``read_back`` against :class:`Expect`); whether a publish **moves** the staged
files (``moves``: local renames) or copies them (uploads: the staged copies stay), and whether
reading a file whole is as cheap as listing it (``cheap_reads``).

The order in which publications use these -- the commit rule of a shard and of a set --
lives in :mod:`megatron_sft_idx.publishing`. Nothing here knows a dataset (contract
``storage-knows-no-dataset``): a shard is a prefix and the file suffixes of ``format``.
"""

from __future__ import annotations

import abc
import concurrent.futures as futures
import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import (Callable, ContextManager, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple)

from .. import _atomic
from .._crc import crc32
from ..errors import ObjectChangedError, ShardError, ShardNotFoundError, SizeMismatchError
from ..format import ALL_SUFFIXES
from .config import StorageConfig
from .urls import ObjectURL, check_url, is_remote, plain_name

__all__ = ["Destination", "LocalDestination", "ObjectDestination", "destination_for", "Expect"]

_STAGING_TAG = "megatron_sft_idx-"


@dataclass(frozen=True)
class Expect:
    """What one file at a destination must be after a publication: its ``size`` (None: it must
    be gone), and where given the CRC-32 of its whole content or its first bytes (``head``)."""

    path: str
    size: Optional[int]
    crc32: Optional[int] = None
    head: bytes = b""


class Destination(abc.ABC):
    """The interface of a place outputs go (see the module doc): :class:`LocalDestination` and
    :class:`ObjectDestination` implement every abstract method; writers use nothing else.

    Paths are strings: a local path or an ``s3://`` / ``msc://`` URL, as :func:`destination_for`
    was given; a *prefix* is a shard's path without its suffix (``format.ALL_SUFFIXES``).
    """

    @property
    @abc.abstractmethod
    def moves(self) -> bool:
        """A publish renames the staged files into place (they are gone from the staging area
        after); False: it copies them (an upload), and the staged copies stay."""

    @property
    @abc.abstractmethod
    def cheap_reads(self) -> bool:
        """Reading a file back whole costs no more than a local disk read."""

    # ---- names
    @abc.abstractmethod
    def join(self, directory: str, name: str) -> str:
        """``name`` (relative, ``/``-separated) under ``directory``."""

    @abc.abstractmethod
    def name(self, path: str) -> str:
        """The last component of ``path``."""

    @abc.abstractmethod
    def parent(self, path: str) -> str:
        """The directory ``path`` is in."""

    @abc.abstractmethod
    def normal(self, path: str) -> str:
        """The one spelling runs compare two names of ``path`` by (absolute; a URL normalised)."""

    @abc.abstractmethod
    def key(self, path: str) -> str:
        """One spelling per place (local links resolved): two names of one file compare equal."""

    def same(self, path: str, other: str) -> bool:
        """Whether ``other`` (a path or a URL) names the place ``path`` names (links resolved)."""
        return self.key(path) == destination_for(other).key(other)

    @abc.abstractmethod
    def local_copy(self, prefix: str, directory: str) -> ContextManager[str]:
        """A context giving the shard at ``prefix`` as a local prefix: the shard itself, or a copy
        downloaded into ``directory`` (removed when the block exits)."""

    # ---- listing
    @abc.abstractmethod
    def listing(self, prefix: str) -> Dict[str, int]:
        """``{path: size in bytes}`` of every file beside ``prefix`` whose name starts with
        ``prefix``'s last component (not below a further directory; no temporaries)."""

    @abc.abstractmethod
    def existing(self, prefix: str) -> List[str]:
        """The suffixes (``format.ALL_SUFFIXES``) of the shard files at ``prefix`` that exist."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file (or a link, even dangling) is at ``path``."""

    @abc.abstractmethod
    def sizes(self, paths: Sequence[str]) -> Dict[str, int]:
        """``{path: size in bytes}`` of those of ``paths`` that exist."""

    # ---- staging
    @abc.abstractmethod
    def work_prefix(self, prefix: str, staging_dir: Optional[str] = None) -> str:
        """The local prefix a run writing ``prefix`` keeps its work directory at (the same for
        every run of that output, so a resumed run finds it).

        Raises:
            ShardError: ``prefix`` names no output (an object URL ending in ``/``)."""

    @abc.abstractmethod
    def staging(self, output: str, staging_dir: Optional[str] = None) -> ContextManager[str]:
        """A context giving a fresh local path named like ``output``'s last component to write an
        output into before it is published; removed with everything in it when the block exits.

        Raises:
            ShardError: ``output`` names no output (an object URL ending in ``/``)."""

    # ---- publishing primitives
    @abc.abstractmethod
    def prepare(self, sources: Iterable[str]) -> None:
        """Make the local files ``sources`` durable before they are published."""

    @abc.abstractmethod
    def turn(self, prefix: str) -> ContextManager:
        """A context inside which publications into ``prefix``'s directory take turns (a lock
        where the place has one)."""

    @abc.abstractmethod
    def remove(self, paths: Iterable[str]) -> None:
        """Remove the files ``paths`` (one that is not there is no error)."""

    @abc.abstractmethod
    def sync(self, prefix: str) -> None:
        """Make the removals and renames in ``prefix``'s directory durable."""

    @abc.abstractmethod
    def put(self, source: str, final: str) -> None:
        """Publish the staged file ``source`` (local, or an object of this store) at ``final``:
        moved there (:attr:`moves`) or copied."""

    def put_many(self, pairs: Sequence[Tuple[str, str]]) -> None:
        """:meth:`put` each ``(source, final)`` (in parallel where the place allows it)."""
        for source, final in pairs:
            self.put(source, final)

    @abc.abstractmethod
    def copying(self, copies: Callable[[str], Optional[str]]) -> "Destination":
        """This place, publishing a staged local file by a copy made where the data is, never
        through this machine: ``copies(local path)`` is the URL of an object of this store the
        file is a verified copy of (a work directory mirrored from a bucket), or None (the file
        is published as usual)."""

    @abc.abstractmethod
    def finish(self, prefix: str, files: Mapping[str, str]) -> None:
        """After the shard ``files`` (``{suffix: source}``) were put at ``prefix``: make them
        durable, or prove what arrived is as large as what was sent.

        Raises:
            SizeMismatchError: an uploaded object is not the size of its source."""

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """``data`` as the whole file ``path``, in one atomic step (a manifest, an order, a receipt)."""

    @abc.abstractmethod
    def stamp(self, path: str) -> Optional[Hashable]:
        """Which file ``path`` is now (a publish replaces it by another stamp), or None: there is none."""

    @abc.abstractmethod
    def temporary(self, final: str) -> Optional[str]:
        """A fresh temporary name beside ``final`` to stage a copy under before :meth:`put`, or
        None when the place needs none (an upload reads its source as it is)."""

    @abc.abstractmethod
    def make_directory(self, directory: str) -> None:
        """Make ``directory`` (and its parents) where the place has directories."""

    # ---- reading back
    @abc.abstractmethod
    def read(self, path: str, limit: int) -> Optional[bytes]:
        """The file ``path`` whole, or None when there is none.

        Raises:
            ShardError: larger than ``limit`` bytes, or unreadable."""

    @abc.abstractmethod
    def read_head(self, path: str, size: int) -> Optional[bytes]:
        """The first ``size`` bytes of ``path`` (fewer for a shorter local file), or None when
        there is none.

        Raises:
            ShardError: unreadable (RemoteStorageError, ShortReadError for an object)."""

    def listed(self, paths: Sequence[str]) -> Dict[str, Tuple[int, Optional[Hashable]]]:
        """``{path: (size, identity)}`` of those of ``paths`` that exist, the identity in the form
        :meth:`placed` records (None where the place gives none)."""
        return {p: (s, None) for p, s in self.sizes(paths).items()}

    def placed(self, path: str) -> Optional[Hashable]:
        """The identity of the file this destination put at ``path`` in this process (a local
        file's device and inode, an object's ETag as its upload's answer proved it), or None."""
        return self.__dict__.get("_placed", {}).get(self.normal(path))

    def _place(self, path: str, identity: Optional[Hashable]) -> None:
        if identity is not None:
            self.__dict__.setdefault("_placed", {})[self.normal(path)] = identity

    def read_back(self, expected: Sequence["Expect"]) -> List[Tuple[str, str]]:
        """Read the destination back against ``expected``: sizes and identities from one listing
        per directory (a file this destination placed must still be the one it placed: the data
        files' identity, not only their sizes), then the CRC-32s and first bytes asked for.
        Returns ``(path, what is there now)`` for every file missing, left over, or different
        (empty: the destination is whole). A listing or read that fails is itself a problem
        named; nothing is raised for what is found."""
        problems: List[Tuple[str, str]] = []
        try:
            found = self.listed([e.path for e in expected])
        except (ShardError, OSError) as exc:
            return [(expected[0].path, f"cannot list the destination to read it back: {exc}")] if expected else []
        sizes = {p: s for p, (s, _) in found.items()}
        for e in expected:
            size = sizes.get(e.path)
            if e.size is None:
                if size is not None:
                    problems.append((e.path, "an old file the new generation does not bring is still there"))
                continue
            if size is None:
                problems.append((e.path, "missing"))
                continue
            if size != e.size:
                problems.append((e.path, f"{size} bytes, {e.size} were published"))
                continue
            placed = self.placed(e.path)
            if placed is not None and found[e.path][1] != placed:
                problems.append((e.path, f"it is not the file this publication placed there (now {found[e.path][1]}, "
                                         f"placed {placed}): another writer replaced it"))
                continue
            try:
                if e.crc32 is not None:
                    data = self.read(e.path, e.size)
                    if data is None or crc32(data) != e.crc32:
                        problems.append((e.path, "its content differs from what was published (CRC-32)"))
                elif e.head:
                    if self.read_head(e.path, len(e.head)) != e.head:
                        problems.append((e.path, "its header differs from what was published"))
            except (ShardError, OSError) as exc:
                problems.append((e.path, f"cannot read it back: {exc}"))
        return problems


class LocalDestination(Destination):
    """A local directory: files are renamed into place (same filesystem), under a lock per
    directory, fsynced."""

    moves = True
    cheap_reads = True

    def copying(self, copies: Callable[[str], Optional[str]]) -> "LocalDestination":
        """This destination itself: a local publish renames the staged file, nothing is copied."""
        return self

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def name(self, path: str) -> str:
        return os.path.basename(path)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.abspath(path))

    def normal(self, path: str) -> str:
        return os.path.abspath(path)

    def key(self, path: str) -> str:
        """One spelling per place (symbolic links resolved): two names of one file compare equal."""
        return os.path.realpath(path)

    @contextlib.contextmanager
    def local_copy(self, prefix: str, directory: str) -> Iterator[str]:
        """The local shard ``prefix`` itself (nothing is copied)."""
        yield prefix

    def listing(self, prefix: str) -> Dict[str, int]:
        directory, start = os.path.dirname(os.path.abspath(prefix)), os.path.basename(prefix)
        out: Dict[str, int] = {}
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return out   # nothing there (a file in the way of the directory is for the writer to name)
        base = os.path.dirname(prefix)
        for entry in entries:
            if entry.name.startswith(start) and _atomic._TMP_TAG not in entry.name:
                try:
                    out[os.path.join(base, entry.name)] = entry.stat().st_size
                except OSError:
                    continue   # (removed meanwhile)
        return out

    def existing(self, prefix: str) -> List[str]:
        return [s for s in ALL_SUFFIXES if os.path.lexists(prefix + s)]

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def sizes(self, paths: Sequence[str]) -> Dict[str, int]:
        out = {}
        for path in paths:
            try:
                out[path] = os.path.getsize(path)
            except OSError:
                continue
        return out

    def work_prefix(self, prefix: str, staging_dir: Optional[str] = None) -> str:
        return prefix

    @contextlib.contextmanager
    def staging(self, output: str, staging_dir: Optional[str] = None) -> Iterator[str]:
        """A hidden temporary directory beside ``output`` (same filesystem: the publish renames),
        removed with everything in it when the block exits; a killed run's is cleared first."""
        directory = os.path.dirname(os.path.abspath(output))
        os.makedirs(directory, exist_ok=True)
        hidden = os.path.join(directory, "." + os.path.basename(output))
        _atomic.clear_stale_temporaries([hidden])
        staging = _atomic.temporary_path(hidden)
        os.mkdir(staging)
        try:
            yield os.path.join(staging, os.path.basename(output))
        finally:
            _atomic.remove_tree(staging, directory)

    def prepare(self, sources) -> None:
        _atomic.fsync_files(sources)   # concurrently: one sync's wait, not one per file

    def turn(self, prefix: str):
        return _atomic.directory_lock(prefix)

    def remove(self, paths) -> None:
        _atomic.remove_quietly(paths)

    def sync(self, prefix: str) -> None:
        _atomic.fsync_dir(prefix)

    def put(self, source: str, final: str) -> None:
        os.replace(source, final)
        if os.path.lexists(source):
            # rename() of two links to one inode succeeds and does nothing (POSIX): the final
            # name already holds this content (a rerun of a killed promotion).
            os.unlink(source)
        self._place(final, self.stamp(final))

    def listed(self, paths: Sequence[str]) -> Dict[str, Tuple[int, Optional[Hashable]]]:
        """``{path: (size, (device, inode))}`` of those of ``paths`` that exist."""
        out = {}
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_size, (st.st_dev, st.st_ino))
        return out

    def finish(self, prefix: str, files: Mapping[str, str]) -> None:
        _atomic.fsync_dir(prefix)

    def temporary(self, final: str) -> Optional[str]:
        """A fresh temporary name beside ``final`` to stage a copy under (a rename puts it in
        place); a killed publication's temporaries of ``final`` are cleared first."""
        _atomic.clear_stale_temporaries([final])
        return _atomic.temporary_path(final)

    def make_directory(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)

    def write_bytes(self, path: str, data: bytes) -> None:
        """``data`` at ``path``, atomically; a killed earlier write's temporaries of ``path``
        (an order or manifest of a publish that was interrupted) are cleared first."""
        _atomic.clear_stale_temporaries([path])
        _atomic.write_file_atomically(path, lambda f: f.write(data))

    def stamp(self, path: str):
        """Which file ``path`` is now (its inode), or None: a publish replaces it by another."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def read(self, path: str, limit: int) -> Optional[bytes]:
        """``path`` whole, or None when it does not exist.

        Raises:
            ShardError: larger than ``limit`` or unreadable."""
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ShardError(f"cannot read the file back ({exc.strerror or exc})", path=path) from None
        if len(data) > limit:
            raise ShardError("the file is larger than expected", path=path, expected=f"<= {limit} bytes")
        return data

    def read_head(self, path: str, size: int) -> Optional[bytes]:
        try:
            with open(path, "rb") as f:
                return f.read(size)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ShardError(f"cannot read the file back ({exc.strerror or exc})", path=path) from None


class ObjectDestination(Destination):
    """``s3://`` / ``msc://``: files are uploaded (the staged copies stay), every call one
    retried, deadline-bounded operation per object (:mod:`._stores`)."""

    moves = False
    cheap_reads = False

    def __init__(self, config: Optional[StorageConfig] = None,
                 copies: Optional[Callable[[str], Optional[str]]] = None) -> None:
        self.config = StorageConfig.resolve(config)
        #: ``copies(local path)``: the URL of an object in this store the local file is a
        #: verified copy of (a work directory mirrored from a bucket), or None. :meth:`put` then
        #: copies that object server-side instead of uploading the file.
        self.copies = copies

    def _store(self, url: ObjectURL):
        from ._stores import store_for   # (start-up: the local write path never loads the clients' module)

        return store_for(url, self.config)

    def copying(self, copies: Callable[[str], Optional[str]]) -> "ObjectDestination":
        """An object destination of the same settings whose :meth:`put` copies the object
        ``copies(local path)`` names server-side instead of uploading the local file (what either
        places is :meth:`placed` by both)."""
        out = ObjectDestination(self.config, copies)
        out._placed = self.__dict__.setdefault("_placed", {})
        return out

    # ---- names
    def join(self, directory: str, name: str) -> str:
        return str(ObjectURL.parse(directory).join(name))

    def name(self, path: str) -> str:
        return ObjectURL.parse(path).name

    def parent(self, path: str) -> str:
        return str(ObjectURL.parse(path).parent)

    def normal(self, path: str) -> str:
        return str(ObjectURL.parse(path))

    def key(self, path: str) -> str:
        return self.normal(path)

    @contextlib.contextmanager
    def local_copy(self, prefix: str, directory: str) -> Iterator[str]:
        """The shard's objects at ``prefix`` downloaded into ``directory`` (removed after the block)."""
        url = ObjectURL.parse(prefix)
        store = self._store(url)
        os.makedirs(directory, exist_ok=True)
        local = os.path.join(directory, plain_name(url.name, "the shard's name"))
        try:
            for suffix, info in store.stat_files(url, ALL_SUFFIXES).items():
                store.download(url.with_suffix(suffix), local + suffix, info)
            yield local
        finally:
            _atomic.remove_tree(directory, os.path.dirname(os.path.abspath(directory)))

    # ---- listing
    def listing(self, prefix: str) -> Dict[str, int]:
        """Every object whose key starts with ``prefix``'s (not below a further ``/``): one LIST."""
        url = ObjectURL.parse(prefix)
        return {str(obj): info.size for obj, info in self._store(url).list(url)}

    def existing(self, prefix: str) -> List[str]:
        """Suffixes of the shard objects at ``prefix`` (one LIST, or a HEAD per suffix)."""
        url = ObjectURL.parse(prefix)
        return list(self._store(url).stat_files(url, ALL_SUFFIXES))

    def exists(self, path: str) -> bool:
        url = ObjectURL.parse(path)
        return self._store(url).head(url) is not None

    def sizes(self, paths: Sequence[str]) -> Dict[str, int]:
        """``{url: size}`` of those of ``paths`` that exist: one LIST per directory they are in."""
        return {u: size for u, (size, _) in self.listed(paths).items()}

    def listed(self, paths: Sequence[str]) -> Dict[str, Tuple[int, Optional[Hashable]]]:
        """``{url: (size, ETag)}`` of those of ``paths`` that exist: one LIST per directory."""
        out: Dict[str, Tuple[int, str]] = {}
        for parent in sorted({u.rsplit("/", 1)[0] + "/" for u in paths}):
            url = ObjectURL.parse(parent)
            out.update((str(obj), (info.size, _etag(info.etag))) for obj, info in self._store(url).list(url))
        normal = {u: str(ObjectURL.parse(u)) for u in paths}
        return {u: out[normal[u]] for u in paths if normal[u] in out}

    # ---- staging
    def _named(self, prefix: str) -> ObjectURL:
        url = ObjectURL.parse(prefix)
        if not url.key or url.key.endswith("/"):
            raise ShardError("an output prefix in object storage must end in the shards' name", path=prefix,
                             field="output", hint="e.g. s3://bucket/sft/ds writes s3://bucket/sft/ds_train_000000...")
        check_url(prefix, "the output prefix", root=False)
        plain_name(url.name, "the output's name")
        return url

    def work_prefix(self, prefix: str, staging_dir: Optional[str] = None) -> str:
        """``NAME`` in a directory of ``staging_dir`` (default: the system's temporary directory)
        named by a digest of the URL: every run writing that URL (and only those) finds it again."""
        url = self._named(prefix)
        digest = hashlib.sha256(str(url).encode("utf-8")).hexdigest()[:16]
        root = os.path.abspath(staging_dir or tempfile.gettempdir())
        return os.path.join(root, _STAGING_TAG + digest, url.name)

    @contextlib.contextmanager
    def staging(self, output: str, staging_dir: Optional[str] = None) -> Iterator[str]:
        """A local path named like ``output``'s last component, in a fresh temporary directory
        (in ``staging_dir``) removed with everything in it when the block exits."""
        name = self._named(output).name
        if staging_dir:
            os.makedirs(staging_dir, exist_ok=True)
        directory = tempfile.mkdtemp(prefix="msi-out-", dir=staging_dir)
        try:
            yield os.path.join(directory, name)
        finally:
            _atomic.remove_tree(directory, os.path.dirname(os.path.abspath(directory)))

    # ---- publishing primitives
    def prepare(self, sources) -> None:
        """Nothing to do: the local files are complete (the publisher opened the shard)."""

    def turn(self, prefix: str):
        """Object stores offer no lock: publications of one prefix must not run at once."""
        return contextlib.nullcontext()

    def remove(self, paths) -> None:
        for path in paths:
            url = ObjectURL.parse(path)
            self._store(url).delete(url)

    def sync(self, prefix: str) -> None:
        """Nothing to do: a completed request is durable."""

    def temporary(self, final: str) -> Optional[str]:
        """None: an upload reads the local source as it is (no copy is staged)."""
        return None

    def make_directory(self, directory: str) -> None:
        """Nothing to do: keys need no directories."""

    def put(self, source: str, final: str) -> None:
        """Upload the local file ``source`` to ``final``; a ``source`` in the same store (an
        ``s3://`` / ``msc://`` URL: a shard staged in a bucket) is copied server-side, never
        through this machine's disk."""
        url = ObjectURL.parse(final)
        if not is_remote(source) and self.copies is not None:
            source = self.copies(source) or source
        if is_remote(source):
            etag = self._store(url).copy(ObjectURL.parse(source), url).etag
        else:
            etag = self._store(url).upload(source, url)
        self._place(final, _etag(etag) or None)

    def put_many(self, pairs: Sequence[Tuple[str, str]]) -> None:
        """Upload each ``(local file, URL)``, in parallel (``config.concurrency`` at most)."""
        if not pairs:
            return
        with futures.ThreadPoolExecutor(max_workers=min(len(pairs), self.config.concurrency) or 1) as pool:
            list(pool.map(lambda pair: self.put(*pair), pairs))

    def finish(self, prefix: str, files: Mapping[str, str]) -> None:
        """The uploaded objects' listed sizes equal the local files', and each is the object its
        upload's answer proved (its ETag).

        Raises:
            SizeMismatchError: naming the object; ObjectChangedError: another object is there.
        """
        url = ObjectURL.parse(prefix)
        listed = self._store(url).stat_files(url, ALL_SUFFIXES)
        for suffix, path in files.items():
            want = self._size(path)
            got = listed.get(suffix)
            if got is None or got.size != want:
                raise SizeMismatchError("uploaded object differs in size from the local file",
                                        path=str(url.with_suffix(suffix)), field="size", expected=want,
                                        actual=None if got is None else got.size,
                                        hint="upload the shard again (replace=True)")
            placed = self.placed(str(url.with_suffix(suffix)))
            if placed is not None and _etag(got.etag) != placed:
                raise ObjectChangedError("the object listed after the upload is not the one uploaded (another "
                                         "writer replaced it)", path=str(url.with_suffix(suffix)), field="ETag",
                                         expected=placed, actual=got.etag, hint="upload the shard again")

    def _size(self, source: str) -> int:
        """The size of a source: a local file's, or (a URL) the object's."""
        if not is_remote(source):
            return os.path.getsize(source)
        url = ObjectURL.parse(source)
        info = self._store(url).head(url)
        if info is None:
            raise SizeMismatchError("the source object is gone", path=source, field="size")
        return info.size

    def write_bytes(self, path: str, data: bytes, create_only: bool = False, if_match: str = "") -> str:
        """One PUT of ``data`` (a manifest: its set's commit point; a receipt, a lock); returns
        its ETag. ``create_only`` / ``if_match``: a conditional write (:meth:`.ObjectStore.put_bytes`).

        Raises:
            PreconditionError: the condition does not hold."""
        if create_only or if_match:
            url = ObjectURL.parse(path)
            etag = self._store(url).put_bytes(url, data, create_only=create_only, if_match=if_match)
            self._place(path, _etag(etag) or None)
            return etag
        with tempfile.TemporaryDirectory(prefix="msi-put-") as tmp:
            local = os.path.join(tmp, "object")
            with open(local, "wb") as f:
                f.write(data)
            self.put(local, path)
        return ""

    def stamp(self, path: str):
        """Which object ``path`` is now (its ETag and size), or None."""
        url = ObjectURL.parse(path)
        info = self._store(url).head(url)
        return None if info is None else (info.etag, info.size)

    # ---- reading back
    def read(self, path: str, limit: int) -> Optional[bytes]:
        """The object whole (ranged GETs within one deadline), or None when there is none.

        Raises:
            ShardError: larger than ``limit``; RemoteStorageError: a request failed for good."""
        url = ObjectURL.parse(path)
        store = self._store(url)
        info = store.head(url)
        if info is None:
            return None
        if info.size > limit:
            raise ShardError("the object is larger than expected", path=path, expected=f"<= {limit} bytes",
                             actual=info.size)
        return b"".join(store.read_chunks(url, info.size, info.etag))

    def read_head(self, path: str, size: int) -> Optional[bytes]:
        """The first ``size`` bytes (one ranged GET: the caller knows the object is at least that
        long, from a listing), or None when there is no such object.

        Raises:
            RemoteStorageError: a request failed for good (a shorter object: ShortReadError)."""
        url = ObjectURL.parse(path)
        try:
            return bytes(self._store(url).read_range(url, 0, size))
        except ShardNotFoundError:
            return None


def _etag(tag: str) -> str:
    """An ETag as compared: without quotes and a weak marker."""
    text = (tag or "").strip()
    return (text[2:] if text.startswith("W/") else text).strip('"')


def destination_for(path: str, config: Optional[StorageConfig] = None) -> Destination:
    """The destination of ``path``: local, or object storage for an ``s3://`` / ``msc://`` URL
    (the one place a writer's path is told from a URL)."""
    if is_remote(path):
        return ObjectDestination(config)
    return LocalDestination()
