"""One workspace per run: where its sequence store and work directory live, decided once.

A run's data lives in two places: the *store* (the run's own, under its work directory; or
``--store``, a local directory or an ``s3://`` / ``msc://`` prefix) and the *work directory*
(receipts, the plan, the staged shards: beside a local output; for an ``s3://`` output, on the
node's disk, or -- with the Ray engine and no ``--staging-dir`` -- in the bucket beside the
output, ``.NAME.preprocess/``). :func:`workspace_for` decides once, from the output prefix, the
store, the engine and the staging directory, which of two kinds the run holds:

============  ==============================================================================
kind          what it does
============  ==============================================================================
local         everything on a filesystem every worker sees: the engine runs as it is, every
              file is where its path says (:data:`~.files.LOCAL`), the locks are pid files
bucket        the store or the work directory (or both) in object storage, each mirrored on
              every node (:class:`~..storage.mirror.Mirror`): the engine runs every step
              mirrored (:class:`~.engines.mirrored.MirroredEngine`), the driver holds receipts
              and ``store.json`` only (:class:`~.files.MirroredFiles`), the locks are objects
              written conditionally (:class:`~..storage.lease.ObjectLock`)
============  ==============================================================================

Both offer one interface -- the store and work locations, the destination, the ``files`` view,
taking and releasing the locks with ``--resume`` / ``--overwrite`` (one rule for a store
wherever it is: :func:`take_store`), "is a run holding this", the engine wrapper, syncing the
driver's own writes, the source a staged shard is published from, and retiring the work
directory after the commit -- so the driver (:mod:`.driver`) never asks which kind it holds.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from typing import Optional, Tuple

from ..errors import ShardError, ShardExistsError
from ..storage.urls import ObjectURL, check_url, is_remote
from ..storage.destination import Destination, destination_for
from ..storage.mirror import Mirror
from .engines.base import Engine
from .engines.mirrored import MirroredEngine
from .files import LOCAL, Files, MirroredFiles, commit_rank, is_metadata
from .store import STORE_FILE, empty_store, mirrored_store
from .workdir import RECORD, Lock, RunLock, WorkDir

log = logging.getLogger("megatron_sft_idx.preprocess")

_NOT_EMPTY_HINT = ("pass --resume to continue it (partitions made with the same inputs and settings are kept; a store "
                   "a failed run left unfinished is started again), --overwrite to replace it, repack-sft to pack it "
                   "again, or choose an empty {place}")


# --------------------------------------------------------------------------- a --store, wherever it is


class _LocalStore:
    """A ``--store`` directory on a filesystem."""

    kind, place = "directory", "directory"

    def __init__(self, directory: str) -> None:
        self.name = self.directory = directory

    def empty(self) -> bool:
        return not (os.path.isdir(self.directory) and [n for n in os.listdir(self.directory) if n != "lock"])

    def lock(self) -> RunLock:
        os.makedirs(self.directory, exist_ok=True)
        return Lock(os.path.join(self.directory, "lock"), f"sequence store {self.directory}")

    def clear(self) -> None:
        empty_store(self.directory)

    def refresh(self) -> None:
        """Nothing to do: the files are where they are read."""


class _BucketStore:
    """A ``--store`` prefix in object storage, mirrored here."""

    kind, place = "in object storage", "prefix"

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.name = mirror.url

    def empty(self) -> bool:
        return not self.mirror.listing()

    def lock(self) -> RunLock:
        return self.mirror.lock(f"sequence store {self.mirror.url}")

    def clear(self) -> None:
        self.mirror.clear()

    def refresh(self) -> None:
        self.mirror.pull(only=is_metadata)


def take_store(store, resume: bool, overwrite: bool) -> RunLock:
    """Take the lock of a ``--store`` (the one rule, wherever it is): a store holding anything
    is continued under ``resume``, emptied under ``overwrite`` alone, and refused without
    either; then what the driver reads of it is made readable here.

    Raises:
        ShardExistsError: the store holds something, without ``resume`` or ``overwrite``.
        ShardError: another live run holds its lock (naming it).
    """
    if not store.empty() and not (resume or overwrite):
        raise ShardExistsError(f"the --store {store.kind} is not empty", path=store.name,
                               hint=_NOT_EMPTY_HINT.format(place=store.place))
    lock = store.lock()
    lock.acquire()
    try:
        if overwrite and not resume:
            store.clear()
        store.refresh()
    except BaseException:
        lock.release()
        raise
    return lock


# --------------------------------------------------------------------------- the workspace


class Workspace(ABC):
    """Where one run's data lives (module doc). Attributes every kind has:

    * ``work``: the :class:`~.workdir.WorkDir` (local, or a mirror's local tree);
    * ``destination``: the output's :class:`~..storage.destination.Destination`;
    * ``store_dir``: the local path every step reads the store at (the run's own: under ``work``);
    * ``kept_store``: the ``--store`` as the user named it (absolute path or URL), None for the run's own;
    * ``files``: how the driver sees the run's files (:mod:`.files`).
    """

    work: WorkDir
    destination: Destination
    store_dir: str
    kept_store: Optional[str]
    files: Files

    @property
    def own_store(self) -> bool:
        return self.kept_store is None

    @abstractmethod
    def peek_store(self) -> None:
        """Make the store's description (``store.json``) readable at :attr:`store_dir` as it is
        now, without taking any lock (a resumed run reads the template date it records)."""

    @abstractmethod
    def open_kept_store(self) -> str:
        """:attr:`store_dir` of a kept ``--store`` a run packs again (``repack-sft``), what the
        driver reads of it made readable here.

        Raises:
            ShardError: no store there (a missing ``store.json`` is named by its reader)."""

    @abstractmethod
    def busy(self) -> Optional[str]:
        """A live run holding the work directory (described), else None."""

    @abstractmethod
    def claim(self, resume: bool) -> None:
        """Take what a run of the work directory holds beyond the local work directory's own lock,
        and make it readable here (``resume``) or empty it.

        Raises:
            ShardError: another live run holds it (naming it)."""

    @abstractmethod
    def take_store(self, resume: bool, overwrite: bool) -> Optional[RunLock]:
        """The lock of a ``--store`` (:func:`take_store`), None for the run's own store."""

    @abstractmethod
    def engine(self, engine: Engine) -> Engine:
        """``engine`` as the run's steps must run on it."""

    @abstractmethod
    def sync(self) -> None:
        """Make the driver's own writes (receipts, removals) durable where the work lives.

        Raises:
            ShardError: the run lost the work directory's lock."""

    @abstractmethod
    def source_of(self, staged: str) -> str:
        """Where the staged shard prefix ``staged`` is published from (a path or a URL)."""

    @abstractmethod
    def retire(self) -> None:
        """After the commit: the work directory reduced to the run's record, wherever it is."""

    @abstractmethod
    def release(self) -> None:
        """Give up what :meth:`claim` took (the work brought up to date first)."""


class LocalWorkspace(Workspace):
    """Store and work directory on a filesystem every worker sees (module doc)."""

    files = LOCAL

    def __init__(self, work: WorkDir, destination: Destination, store: Optional[str]) -> None:
        self.work, self.destination = work, destination
        self.kept_store = os.path.abspath(store) if store else None
        self.store_dir = self.kept_store or work.store

    def peek_store(self) -> None:
        pass

    def open_kept_store(self) -> str:
        return self.store_dir

    def busy(self) -> Optional[str]:
        return self.work.lock.holder()

    def claim(self, resume: bool) -> None:
        pass   # (the work directory's own lock is all: WorkDir.open)

    def take_store(self, resume: bool, overwrite: bool) -> Optional[RunLock]:
        return None if self.own_store else take_store(_LocalStore(self.kept_store), resume, overwrite)

    def engine(self, engine: Engine) -> Engine:
        return engine

    def sync(self) -> None:
        pass

    def source_of(self, staged: str) -> str:
        return staged

    def retire(self) -> None:
        self.work.retire()

    def release(self) -> None:
        pass


class BucketWorkspace(Workspace):
    """The store, the work directory or both in object storage, mirrored here (module doc).

    Args:
        work: the local work directory, or None when it is the mirror of ``work_mirror``.
        work_mirror: the work directory in the bucket (or None), ``what`` naming its output.
        store: a local ``--store`` directory, or None; ``store_mirror``: a ``--store`` URL's mirror.
    """

    def __init__(self, destination: Destination, work: Optional[WorkDir], work_mirror: Optional[Mirror],
                 what: str, store: Optional[str], store_mirror: Optional[Mirror]) -> None:
        self.destination = destination
        self.work_mirror, self.store_mirror = work_mirror, store_mirror
        self.work = work if work_mirror is None else WorkDir(work_mirror.local, what)
        self.what = what
        self.mirrors: Tuple[Mirror, ...] = tuple(m for m in (store_mirror, work_mirror) if m is not None)
        self.files = MirroredFiles(self.mirrors)
        if store_mirror is not None:
            self.kept_store, self.store_dir = store_mirror.url, store_mirror.local
        else:
            self.kept_store = os.path.abspath(store) if store else None
            self.store_dir = self.kept_store or self.work.store
        self._work_lock = None
        self._store_lock = None

    def peek_store(self) -> None:
        if self.store_mirror is not None:
            self.store_mirror.pull(STORE_FILE, only=STORE_FILE.__eq__)
        elif self.own_store and self.work_mirror is not None:
            self.work_mirror.pull("store/" + STORE_FILE, only=("store/" + STORE_FILE).__eq__)

    def open_kept_store(self) -> str:
        if self.store_mirror is not None:
            mirrored_store(self.store_mirror, is_metadata)
        return self.store_dir

    def _lock(self):
        return self.work_mirror.lock(self.what)

    def busy(self) -> Optional[str]:
        holder = self.work.lock.holder()
        if holder is None and self.work_mirror is not None:
            holder = self._lock().holder()
            if holder is None:
                self.work_mirror.pull(only=is_metadata)
        return holder

    def claim(self, resume: bool) -> None:
        if self.work_mirror is None:
            return
        self._work_lock = self._lock()
        self._work_lock.acquire()
        try:
            self.work_mirror.pull(only=is_metadata) if resume else self.work_mirror.clear()
        except BaseException:
            self.release()
            raise

    def take_store(self, resume: bool, overwrite: bool) -> Optional[RunLock]:
        if self.own_store:
            return None
        store = _LocalStore(self.kept_store) if self.store_mirror is None else _BucketStore(self.store_mirror)
        self._store_lock = take_store(store, resume, overwrite)
        return self._store_lock

    def engine(self, engine: Engine) -> Engine:
        store = self.store_mirror.url if self.store_mirror else (
            self.work_mirror.url + "/store" if self.own_store and self.work_mirror else None)
        plan = self.work_mirror.url + "/plan" if self.work_mirror else None
        pulls = {"materialize": tuple(u for u in (store, plan) if u)}   # (the other steps name what they read)
        return MirroredEngine(engine, self.mirrors, pulls,
                              lambda: [k for k in (self._work_lock, self._store_lock) if k is not None])

    def sync(self) -> None:
        if self.work_mirror is not None:
            if self._work_lock is not None:
                self._work_lock.check()
            self.work_mirror.sync()

    def source_of(self, staged: str) -> str:
        """The staged object, copied server-side by the publish: never through this machine."""
        url = None if self.work_mirror is None else self.work_mirror.url_for(staged)
        return staged if url is None else url

    def retire(self) -> None:
        self.work.retire()
        if self.work_mirror is not None:   # (the driver's mirror never held the units' data)
            self.work_mirror.delete_all_but([RECORD.replace(os.sep, "/")])

    def release(self) -> None:
        if self.work_mirror is None or self._work_lock is None:
            return
        try:
            self.work_mirror.sync()
        except ShardError as exc:
            log.warning("could not bring the work directory in object storage up to date: %s", exc)
        finally:
            self._work_lock.release()
            self._work_lock = None


def workspace_for(output_prefix: str, engine: str, staging_dir: Optional[str], store: Optional[str]) -> Workspace:
    """The run's workspace (module doc): the one place that tells where its data lives.

    Args:
        output_prefix: the output (a path or a URL).
        engine: ``local`` or ``ray``; with ``ray``, an output URL and no ``staging_dir`` the work
            directory is in the bucket beside the output.
        staging_dir: where a URL output is built (a filesystem every worker sees), if given.
        store: ``--store`` (a directory or a URL), or None for the run's own.

    Raises:
        ShardError: a URL with an empty, ``.`` or ``..`` level, or a store at a bucket's root
            (:func:`~..storage.urls.url_problem`).
    """
    destination = destination_for(output_prefix)
    what = f"output {output_prefix}"
    work_mirror = None
    if is_remote(output_prefix) and engine == "ray" and not staging_dir:
        url = ObjectURL.parse(check_url(output_prefix, "--output-prefix", root=False))
        work_mirror = Mirror(str(url.parent.join(f".{url.name}.preprocess")), commit_rank)
    store_mirror = Mirror(check_url(store, "--store", root=False), commit_rank) if store and is_remote(store) else None
    work = None if work_mirror else WorkDir.beside(destination.work_prefix(output_prefix, staging_dir))
    if work_mirror is None and store_mirror is None:
        return LocalWorkspace(work, destination, store)
    return BucketWorkspace(destination, work, work_mirror, what, store, store_mirror)


__all__ = ["Workspace", "LocalWorkspace", "BucketWorkspace", "workspace_for", "take_store"]
