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

A mixture (``--mix``) reads several kept stores, each a directory or a URL: the workspace holds
them all (``store_dirs``, ``kept_stores``, one mirror each where it is a URL), and every method
about a store takes its ``index`` (0 by default: the run's one store).

Both offer one interface -- the store and work locations, the destination, the ``files`` view,
taking and releasing the locks with ``--resume`` / ``--overwrite`` (one rule for a store
wherever it is: :func:`take_store`), "is a run holding this", the engine wrapper, syncing the
driver's own writes, the source a staged shard is published from, and retiring the work
directory after the commit, and what the run keeps on this node (:meth:`Workspace.in_use`: a
bucket workspace's mirrors, removed after success, kept after a failure for ``--resume``) -- so the
driver (:mod:`.driver`) never asks which kind it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Tuple

from ..errors import ShardError, ShardExistsError
from ..storage.urls import ObjectURL, check_url, is_remote
from ..storage.destination import Destination, destination_for
from ..storage.lease import ObjectLock
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
    * ``store_dirs``: the local path every step reads each store at (the run's own: under ``work``);
    * ``kept_stores``: the ``--store`` (or a mixture's stores) as the user named them (absolute
      paths or URLs), empty for the run's own store;
    * ``files``: how the driver sees the run's files (:mod:`.files`).
    """

    work: WorkDir
    destination: Destination
    store_dirs: Tuple[str, ...]
    kept_stores: Tuple[str, ...]
    files: Files

    @property
    def store_dir(self) -> str:
        """The store's local path (a mixture's: its first store's)."""
        return self.store_dirs[0]

    @property
    def kept_store(self) -> Optional[str]:
        """The ``--store`` as the user named it, None for the run's own (a mixture's: its first)."""
        return self.kept_stores[0] if self.kept_stores else None

    @property
    def own_store(self) -> bool:
        return not self.kept_stores

    @contextlib.contextmanager
    def in_use(self):
        """The whole run, from its first read of the store or work directory to its end: what it
        keeps on this node for them stays while the block runs, and is removed when the block ends
        without an exception (kept after a failure or an interruption, for ``--resume``)."""
        yield self

    @abstractmethod
    def peek_store(self, index: int = 0) -> None:
        """Make the store's description (``store.json``) readable at ``store_dirs[index]`` as it is
        now, without taking any lock (a resumed run reads the template date it records)."""

    @abstractmethod
    def open_kept_store(self, index: int = 0) -> str:
        """``store_dirs[index]`` of a kept store a run packs again (``repack-sft``), what the
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
    def take_store(self, resume: bool, overwrite: bool, index: int = 0) -> Optional[RunLock]:
        """The lock of a kept store (:func:`take_store`), None for the run's own store."""

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

    def __init__(self, work: WorkDir, destination: Destination, stores: Sequence[str] = ()) -> None:
        self.work, self.destination = work, destination
        self.kept_stores = tuple(os.path.abspath(s) for s in stores)
        self.store_dirs = self.kept_stores or (work.store,)

    def peek_store(self, index: int = 0) -> None:
        pass

    def open_kept_store(self, index: int = 0) -> str:
        return self.store_dirs[index]

    def busy(self) -> Optional[str]:
        return self.work.lock.holder()

    def claim(self, resume: bool) -> None:
        pass   # (the work directory's own lock is all: WorkDir.open)

    def take_store(self, resume: bool, overwrite: bool, index: int = 0) -> Optional[RunLock]:
        return None if self.own_store else take_store(_LocalStore(self.kept_stores[index]), resume, overwrite)

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
        stores: the kept stores (local directories or URLs; none: the run's own), and
            ``store_mirrors`` the mirror of each one that is a URL (None for a directory).
    """

    def __init__(self, destination: Destination, work: Optional[WorkDir], work_mirror: Optional[Mirror],
                 what: str, stores: Sequence[str] = (), store_mirrors: Sequence[Optional[Mirror]] = ()) -> None:
        self.destination = destination
        self.work_mirror = work_mirror
        self.store_mirrors: Tuple[Optional[Mirror], ...] = tuple(store_mirrors) or (None,) * len(stores)
        self.work = work if work_mirror is None else WorkDir(work_mirror.local, what)
        self.what = what
        self.mirrors: Tuple[Mirror, ...] = tuple(m for m in self.store_mirrors + (work_mirror,) if m is not None)
        self.files = MirroredFiles(self.mirrors)
        self.kept_stores = tuple(m.url if m is not None else os.path.abspath(s)
                                 for s, m in zip(stores, self.store_mirrors))
        self.store_dirs = tuple(m.local if m is not None else os.path.abspath(s)
                                for s, m in zip(stores, self.store_mirrors)) or (self.work.store,)
        self._work_lock = None
        self._store_locks: List[RunLock] = []
        self._engine: Optional[MirroredEngine] = None

    @contextlib.contextmanager
    def in_use(self):
        """(Workspace.in_use) This node's mirrors are held (:meth:`~..storage.mirror.Mirror.in_use`)
        and removed after success unless another run on this node holds one of them."""
        with contextlib.ExitStack() as held:
            for mirror in self.mirrors:
                held.enter_context(mirror.in_use())
            yield self
        for mirror in self.mirrors:   # (success alone: an exception skipped this)
            if not mirror.remove_if_unused():
                log.info("this node's copy of %s is kept: another run here uses it", mirror.url)

    def _store_mirror(self, index: int) -> Optional[Mirror]:
        return self.store_mirrors[index] if self.store_mirrors else None

    def peek_store(self, index: int = 0) -> None:
        mirror = self._store_mirror(index)
        if mirror is not None:
            mirror.pull(STORE_FILE, only=STORE_FILE.__eq__)
        elif self.own_store and self.work_mirror is not None:
            self.work_mirror.pull("store/" + STORE_FILE, only=("store/" + STORE_FILE).__eq__)

    def open_kept_store(self, index: int = 0) -> str:
        mirror = self._store_mirror(index)
        if mirror is not None:
            mirrored_store(mirror, is_metadata)
        return self.store_dirs[index]

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

    def take_store(self, resume: bool, overwrite: bool, index: int = 0) -> Optional[RunLock]:
        if self.own_store:
            return None
        mirror = self._store_mirror(index)
        store = _LocalStore(self.kept_stores[index]) if mirror is None else _BucketStore(mirror)
        lock = take_store(store, resume, overwrite)
        self._store_locks.append(lock)
        return lock

    def engine(self, engine: Engine) -> Engine:
        stores = [m.url for m in self.store_mirrors if m is not None]
        if self.own_store and self.work_mirror:
            stores.append(self.work_mirror.url + "/store")
        plan = [self.work_mirror.url + "/plan"] if self.work_mirror else []
        pulls = {"materialize": tuple(stores + plan)}   # (the other steps name what they read)
        self._engine = MirroredEngine(engine, self.mirrors, pulls,   # (a local store's pid lock: not pushed to)
                                      lambda: [k for k in [self._work_lock] + self._store_locks
                                               if isinstance(k, ObjectLock)])
        return self._engine

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
        if self._engine is not None:   # (the other nodes' copies; this one's: in_use)
            self._engine.remove_copies()
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


def workspace_for(output_prefix: str, engine: str, staging_dir: Optional[str], store: Optional[str] = None,
                  stores: Sequence[str] = ()) -> Workspace:
    """The run's workspace (module doc): the one place that tells where its data lives.

    Args:
        output_prefix: the output (a path or a URL).
        engine: ``local`` or ``ray``; with ``ray``, an output URL and no ``staging_dir`` the work
            directory is in the bucket beside the output.
        staging_dir: where a URL output is built (a filesystem every worker sees), if given.
        store: ``--store`` (a directory or a URL), or None for the run's own.
        stores: a mixture's stores (each a directory or a URL), instead of ``store``.

    Raises:
        ShardError: a URL with an empty, ``.`` or ``..`` level, or a store at a bucket's root
            (:func:`~..storage.urls.url_problem`).
    """
    stores = tuple(stores) or ((store,) if store else ())
    destination = destination_for(output_prefix)
    what = f"output {output_prefix}"
    work_mirror = None
    if is_remote(output_prefix) and engine == "ray" and not staging_dir:
        url = ObjectURL.parse(check_url(output_prefix, "--output-prefix", root=False))
        work_mirror = Mirror(str(url.parent.join(f".{url.name}.preprocess")), commit_rank)
    store_mirrors = tuple(Mirror(check_url(s, "--store", root=False), commit_rank) if is_remote(s) else None
                          for s in stores)
    work = None if work_mirror else WorkDir.beside(destination.work_prefix(output_prefix, staging_dir))
    if work_mirror is None and not any(store_mirrors):
        return LocalWorkspace(work, destination, stores)
    return BucketWorkspace(destination, work, work_mirror, what, stores, store_mirrors)


__all__ = ["Workspace", "LocalWorkspace", "BucketWorkspace", "workspace_for", "take_store"]
