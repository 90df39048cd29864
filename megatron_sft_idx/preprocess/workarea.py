"""A store or a work directory in object storage, mirrored on each node's own disk.

An :class:`Area` is a URL root (``s3://b/store``, ``s3://b/out/.NAME.preprocess``) and a
node-local root: ``<tempfile.gettempdir()>/msi-area-<digest of the URL>/<its last name>``,
computed on each node for itself (never a path the driver chose). The steps keep working on
local paths; the area moves bytes between the two roots:

* :meth:`Area.pull` makes the local tree equal to the bucket under a prefix (or the objects
  under it a filter keeps: the driver pulls :func:`is_metadata` alone): an object whose
  ETag the local copy was made from (and that copy unchanged since: size and mtime) is kept,
  others are downloaded (pinned to their ETag, to a temporary name, renamed into place), and
  local files whose object is gone are removed. What is pulled is verified by its user before
  use, as a local file is: receipts parse strictly and pin sizes and CRC-32s
  (:mod:`.receipts`), a store partition's every checksum (``SequenceStore.verify``), the plan's
  (``resumed_plan``), a staged shard's (``resumed_shards``);
* :meth:`Area.push` uploads files in the order given (a unit's data, ``.idx`` last, its
  receipt after: the receipt is the commit point in the bucket too);
* :meth:`Area.sync` pushes what the driver changed locally (receipts last) and deletes the
  objects of files it removed (receipts first); :meth:`Area.clear` empties the area.

What is known of each local file (the ETag it came from, its size and mtime) is kept beside the
tree, under ``msi-area-<digest>/.etags/``, so renaming or deleting the tree (a finished run
reduced to its record) is seen by the next :meth:`~Area.sync`.

:class:`Mirrored` runs a step's unit on any node: it *rebases* the step's paths from the
driver's local root to the node's (:func:`rebase`, over the step's dataclass fields and its
:class:`~.receipts.ReceiptBook`), pulls what the unit reads, runs it, and pushes the unit's
artifacts (its receipt lists them) and then its receipt -- only while the run that started it
still holds its locks (checked before the artifacts and again before the receipt), so a task
a killed driver left running never commits into the run that took over. A step that names what
a unit reads (``reads(unit)``: local paths) gets the areas' metadata and those files alone; a
step without a ``book`` is a check whose unit returns a verdict and pushes nothing.
:class:`AreaEngine` wraps an engine so that every step it maps runs :class:`Mirrored` (the local
engine and the Ray engine alike), with the driver's own changes synced before and the tasks'
receipts pulled after: the driver holds receipts and ``store.json`` only (:func:`is_metadata`).

Locks are objects created by a conditional write (:class:`~..storage.lease.ObjectLock`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextvars
import copy
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import ShardError, ShardExistsError
from ..format import IDX_SUFFIX
from ..storage.urls import ObjectURL, is_remote
from ..storage.config import StorageConfig
from ..storage.lease import ObjectLock
from .receipts import ReceiptBook, mirror_sizes

log = logging.getLogger("megatron_sft_idx.preprocess")

_AREA_TAG = "msi-area-"
_ETAGS = ".etags"
#: Names of an area that are never mirrored: the lock is an object of its own (ObjectLock).
_NOT_MIRRORED = ("lock",)


def _stores():
    from ..storage.objects import store_for

    return store_for


class Area:
    """A URL root and this node's local mirror of it (see the module doc)."""

    def __init__(self, url: str, local: Optional[str] = None, config: Optional[StorageConfig] = None) -> None:
        parsed = ObjectURL.parse(url)
        self.url = str(parsed).rstrip("/")
        self.root = ObjectURL.parse(self.url)
        digest = hashlib.sha256(self.url.encode("utf-8")).hexdigest()[:16]
        home = os.path.join(tempfile.gettempdir(), _AREA_TAG + digest)
        self.local = local or os.path.join(home, self.root.name or "root")
        self._etags = os.path.join(os.path.dirname(self.local), _ETAGS)
        self.config = StorageConfig.resolve(config)

    def __reduce__(self):   # (the driver's root travels: a task rebases the step's paths from it to its own)
        return (Area, (self.url, self.local, self.config))

    def __repr__(self) -> str:
        return f"Area({self.url!r} -> {self.local!r})"

    @property
    def objects(self):
        """This process's client of the area's object store (``storage._stores``)."""
        return _stores()(self.root, self.config)

    def child(self, rel: str) -> str:
        return os.path.join(self.local, *rel.split("/"))

    def rel(self, path: str) -> Optional[str]:
        """``path`` relative to the local root (``/``-separated), or None when outside it."""
        rel = os.path.relpath(os.path.abspath(path), self.local)
        if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
            return None
        return rel.replace(os.sep, "/")

    def url_of(self, rel: str) -> ObjectURL:
        return self.root.join(rel)

    # ------------------------------------------------------------------ what is known locally

    def _known_path(self, rel: str) -> str:
        return os.path.join(self._etags, *rel.split("/"))

    def _known(self, rel: str) -> Optional[Tuple[str, int, int]]:
        try:
            with open(self._known_path(rel)) as f:
                etag, size, mtime = f.read().rsplit(" ", 2)
            return etag, int(size), int(mtime)
        except (OSError, ValueError):
            return None

    def _remember(self, rel: str, etag: str) -> None:
        st = os.stat(self.child(rel))
        path = self._known_path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(f"{etag} {st.st_size} {st.st_mtime_ns}")
        os.replace(tmp, path)

    def _forget(self, rel: str) -> None:
        try:
            os.unlink(self._known_path(rel))
        except FileNotFoundError:
            pass

    def _unchanged(self, rel: str) -> Optional[str]:
        """The ETag the local file was pulled from or pushed as, if it is unchanged since."""
        known = self._known(rel)
        if known is None:
            return None
        try:
            st = os.stat(self.child(rel))
        except OSError:
            return None
        return known[0] if (st.st_size, st.st_mtime_ns) == known[1:] else None

    def _known_files(self, prefix: str = "") -> List[str]:
        out = []
        base = os.path.join(self._etags, *prefix.split("/")) if prefix else self._etags
        if not os.path.isdir(base):
            base = os.path.dirname(base)
        for directory, _, names in os.walk(base):
            for name in names:
                if ".tmp-" in name:
                    continue
                rel = os.path.relpath(os.path.join(directory, name), self._etags).replace(os.sep, "/")
                if rel.startswith(prefix):
                    out.append(rel)
        return out

    # ------------------------------------------------------------------ pull, push, sync

    def listing(self, prefix: str = ""):
        """``{rel: ObjectInfo}`` of the objects under ``prefix`` (one recursive LIST)."""
        base = self.root.key.rstrip("/") + "/"
        url = ObjectURL(self.root.scheme, self.root.bucket, base + prefix)
        out = {}
        for obj, info in self.objects.list(url, recursive=True):
            rel = obj.key[len(base):]
            if rel and rel not in _NOT_MIRRORED:
                out[rel] = info
        return out

    def pull(self, prefix: str = "", only: Optional[Callable[[str], bool]] = None) -> int:
        """Make the local tree under ``prefix`` what the bucket holds (module doc); with ``only``,
        just the objects whose name (relative, ``/``-separated) it keeps: the sizes of the others
        are recorded for their receipts (:func:`~.receipts.mirror_sizes`), their bytes stay in the
        bucket. Returns the number of objects downloaded."""
        listed = self.listing(prefix)
        mirror_sizes(self.local, {rel: info.size for rel, info in listed.items()}, prefix)
        todo = [(rel, info) for rel, info in sorted(listed.items())
                if (only is None or only(rel)) and self._unchanged(rel) != info.etag]
        store = self.objects

        def fetch(item) -> None:
            rel, info = item
            path = self.child(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.pull-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                store.download(self.url_of(rel), tmp, info)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._remember(rel, info.etag)

        if todo:
            with futures.ThreadPoolExecutor(max_workers=min(len(todo), self.config.concurrency)) as pool:
                list(pool.map(fetch, todo))
        for rel in self._known_files(prefix):
            if rel not in listed:   # gone from the bucket: gone here too
                try:
                    os.unlink(self.child(rel))
                except FileNotFoundError:
                    pass
                self._forget(rel)
        return len(todo)

    def fetch(self, rels: Iterable[str]) -> int:
        """Pull exactly the objects named ``rels`` that exist (one listing per directory)."""
        wanted = set(rels)
        by_directory: Dict[str, set] = {}
        for rel in wanted:
            by_directory.setdefault(rel.rsplit("/", 1)[0] + "/" if "/" in rel else "", set()).add(rel)
        return sum(self.pull(prefix, only=names.__contains__) for prefix, names in sorted(by_directory.items()))

    def push(self, paths: Sequence[str]) -> None:
        """Upload the local files ``paths`` (under the local root), one after another in this
        order (the caller puts the commit points last)."""
        store = self.objects
        for path in paths:
            rel = self.rel(path)
            if rel is None:
                raise ShardError("a file to push is outside its area", path=path, expected=self.local)
            url = self.url_of(rel)
            size = os.path.getsize(path)
            if size <= self.config.part_size:
                with open(path, "rb") as f:
                    etag = store.put_bytes(url, f.read())
            else:
                store.upload(path, url)
                info = store.head(url)
                etag = info.etag if info is not None else ""
            self._remember(rel, etag)

    def sync(self) -> None:
        """Push every local file changed since it was pulled or pushed (data first with ``.idx``
        last, receipts after), delete the objects of local files removed (receipts first)."""
        changed, removed = [], []
        for directory, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(directory, name)
                rel = self.rel(path)
                if rel is None or rel in _NOT_MIRRORED or ".pull-" in name or ".tmp" in name:
                    continue
                if self._unchanged(rel) is None:
                    changed.append(path)
        for rel in self._known_files():
            if not os.path.exists(self.child(rel)):
                removed.append(rel)
        for rel in commit_points_first(removed):
            self.objects.delete(self.url_of(rel))
            self._forget(rel)
        self.push(commit_points_last(changed, self.local))

    def clear(self) -> None:
        """Delete every object of the area (receipts first) and the local mirror."""
        for rel in commit_points_first(list(self.listing())):
            self.objects.delete(self.url_of(rel))
        mirror_sizes(self.local, {})
        shutil.rmtree(self.local, ignore_errors=True)
        shutil.rmtree(self._etags, ignore_errors=True)

    def object_of(self, path: str) -> Optional[str]:
        """The URL of the object the local file ``path`` is an unchanged copy of (pulled or
        pushed as that ETag, and the object still that ETag), else None: a publish copies it
        server-side (``ObjectDestination(copies=...)``) instead of uploading it from here."""
        rel = self.rel(path)
        etag = None if rel is None else self._unchanged(rel)
        if not etag:
            return None
        info = self.objects.head(self.url_of(rel))
        return str(self.url_of(rel)) if info is not None and info.etag == etag else None

    def lock(self, what: str) -> ObjectLock:
        return ObjectLock(str(self.url_of("lock")), what, self.config)


def _is_receipt(rel: str) -> bool:
    return rel.startswith("receipts/") or "/receipts/" in rel


#: The small JSON of an area the driver reads besides receipts (a store's description).
_METADATA_NAMES = ("store.json",)


def is_metadata(rel: str) -> bool:
    """What the driver pulls of an area: receipts and ``store.json`` -- never a partition, its
    ``.rows``, the plan body or a staged shard (the tasks read those where they run)."""
    return (_is_receipt(rel) and rel.endswith(".json")) or rel.rsplit("/", 1)[-1] in _METADATA_NAMES


def commit_points_last(paths: Iterable[str], root: str = "") -> List[str]:
    """Data files, then ``.idx`` files (a shard's commit point), then receipts (a unit's)."""
    def rank(path: str) -> tuple:
        rel = os.path.relpath(path, root).replace(os.sep, "/") if root else path
        return (_is_receipt(rel), path.endswith(IDX_SUFFIX) and not path.endswith(".seq" + IDX_SUFFIX), path)

    return sorted(paths, key=rank)


def commit_points_first(rels: Iterable[str]) -> List[str]:
    return list(reversed(commit_points_last(rels)))


# --------------------------------------------------------------------------- a step on any node

#: Inside a mirrored unit: pulls local paths from the areas it runs on (:func:`pull_here`).
_PULL_HERE: contextvars.ContextVar = contextvars.ContextVar("msi_pull_here", default=None)


def pull_here(paths: Iterable[str]) -> None:
    """Pull the local ``paths`` from the areas the current mirrored unit runs on: for a unit that
    learns what it reads as it goes (``--verify-masks``: the partitions and shards its sample
    lands in). Nothing to do outside a mirrored unit (the files are local)."""
    pull = _PULL_HERE.get()
    if pull is not None:
        pull(list(paths))


def rebase(obj, roots: Dict[str, str]):
    """``obj`` with every path under a key of ``roots`` moved under its value: strings, tuples,
    lists, dicts, dataclass fields and :class:`ReceiptBook` attributes, recursively."""
    if isinstance(obj, str):
        for old, new in roots.items():
            if obj == old or obj.startswith(old + os.sep):
                return new + obj[len(old):]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(rebase(x, roots) for x in obj)
    if isinstance(obj, list):
        return [rebase(x, roots) for x in obj]
    if isinstance(obj, dict):
        return {k: rebase(v, roots) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: rebase(getattr(obj, f.name), roots) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, ReceiptBook):
        out = copy.copy(obj)
        out.directory, out.base = rebase(obj.directory, roots), rebase(obj.base, roots)
        out.rejected = {}
        return out
    return obj


@dataclasses.dataclass(frozen=True)
class Mirrored:
    """``step`` with its unit's inputs pulled from, and its outputs pushed to, ``areas`` (module
    doc). ``pulls``: the URLs (an area's root or a prefix under it) the units read."""

    step: object
    areas: Tuple[Area, ...]
    pulls: Tuple[str, ...] = ()
    skeleton: Tuple[Tuple[str, ...], ...] = ()   # per area: its directories on the driver (made on every node)
    held: Tuple[Tuple[str, str], ...] = ()        # (lock URL, nonce) of the locks the run holds

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def writes_to(self) -> str:
        return getattr(self.step, "writes_to", "")

    def prepare(self) -> None:
        prepare = getattr(self.step, "prepare", None)
        if prepare is not None:
            prepare()

    def run(self, unit: int) -> dict:
        areas = self.areas
        here = tuple(Area(a.url, config=a.config) for a in areas)   # this node's own roots
        roots = {a.local: h.local for a, h in zip(areas, here) if a.local != h.local}
        step = rebase(self.step, roots) if roots else self.step
        for url in self.pulls:
            for area in here:
                if url == area.url or url.startswith(area.url + "/"):
                    area.pull(url[len(area.url) + 1:])
        if hasattr(step, "reads"):   # a unit that names what it reads: the areas' metadata, then those files
            for area in here:
                area.pull(only=is_metadata)
            paths = list(step.reads(unit))
            for area in here:
                area.fetch(rel for rel in (area.rel(p) for p in paths) if rel is not None)
        for k, area in enumerate(here):
            os.makedirs(area.local, exist_ok=True)
            for rel in (self.skeleton[k] if k < len(self.skeleton) else ()):
                os.makedirs(area.child(rel), exist_ok=True)
        token = _PULL_HERE.set(lambda paths: [area.fetch(r for r in (area.rel(p) for p in paths) if r is not None)
                                              for area in here])
        try:
            receipt = step.run(unit)
        finally:
            _PULL_HERE.reset(token)
        book = getattr(step, "book", None)
        if book is None:   # a unit that checks (a verdict) and writes nothing
            return receipt
        files = [os.path.join(book.base, *rel.split("/")) for rel in receipt["artifacts"]]
        self._still_held(unit)
        for area in here:
            area.push([p for p in commit_points_last(files) if area.rel(p) is not None])
        self._still_held(unit)   # (again, just before the commit point)
        for area in here:
            if area.rel(book.path(unit)) is not None:
                area.push([book.path(unit)])
        return receipt

    def _still_held(self, unit: int) -> None:
        """Refuse to push for a run that no longer holds its locks: a task left running by a
        killed driver must not commit into the area of the run that took the lock over.

        Raises:
            ShardError: a lock is gone or another run's, naming it."""
        for url, nonce in self.held:
            holder = ObjectLock(url, "").owner()
            if holder is None or holder["nonce"] != nonce:
                raise ShardError(f"{self.name} unit {unit}: the run that started it no longer holds its lock; "
                                 "nothing of the unit was committed", path=url, field="lock",
                                 expected=nonce, actual=None if holder is None else holder["nonce"],
                                 hint="another run took the work over (its driver was killed); nothing to do")


class AreaEngine:
    """An engine whose steps run :class:`Mirrored` on ``areas``: before a step, the driver's own
    changes are synced to the bucket; after it, the receipts the units pushed are pulled (and
    the sizes of their artifacts listed): the driver reads receipts, never the units' data.
    ``pulls``: step name -> the URLs its units read."""

    def __init__(self, engine, areas: Sequence[Area], pulls: Dict[str, Tuple[str, ...]],
                 locks: Callable[[], Sequence[ObjectLock]] = tuple) -> None:
        self.engine, self.areas, self.pulls, self.locks = engine, tuple(areas), dict(pulls), locks
        self.name = engine.name

    def map(self, step, units, on_done, on_progress=None) -> None:
        self.sync()
        skeleton = tuple(tuple(_directories(a.local)) for a in self.areas)
        held = tuple((str(lock.url), lock.nonce) for lock in self.locks() if lock.held)
        self.engine.map(Mirrored(step, self.areas, self.pulls.get(step.name, ()), skeleton, held), units, on_done,
                        on_progress)
        self.pull()

    def sync(self) -> None:
        for area in self.areas:
            area.sync()

    def pull(self) -> None:
        for area in self.areas:
            area.pull(only=is_metadata)

    def describe(self) -> dict:
        return dict(self.engine.describe(), bucket_areas=[a.url for a in self.areas])

    def close(self) -> None:
        self.engine.close()


def _directories(root: str) -> List[str]:
    """The directories under ``root`` (``/``-separated, relative), parents first."""
    out = []
    for directory, names, _ in os.walk(root):
        out.extend(os.path.relpath(os.path.join(directory, n), root).replace(os.sep, "/") for n in sorted(names))
    return out


def lock_store_area(area: Area, resume: bool, overwrite: bool = False) -> ObjectLock:
    """Take the lock of a ``--store`` in object storage (the local rules: a non-empty store is
    continued under ``--resume``, emptied under ``--overwrite`` alone, refused without either),
    then mirror its metadata here (:func:`is_metadata`).

    Raises:
        ShardExistsError: the store holds something, without ``resume`` or ``overwrite``.
        ShardError: another live run holds its lock (naming it).
    """
    if area.listing() and not (resume or overwrite):
        raise ShardExistsError("the --store in object storage is not empty", path=area.url,
                               hint="pass --resume to continue it, --overwrite to replace it, repack-sft to pack "
                                    "it again, or choose an empty prefix")
    lock = area.lock(f"sequence store {area.url}")
    lock.acquire()
    try:
        if overwrite and not resume:
            area.clear()
        area.pull(only=is_metadata)
    except BaseException:
        lock.release()
        raise
    return lock


def mirrored_store(url: str, only: Optional[Callable[[str], bool]] = None) -> str:
    """The local mirror of the store at ``url``, pulled now (readers: plan-batches, virtual
    packs; ``repack-sft``'s driver pulls its metadata alone, ``only=is_metadata``); every
    partition is verified by its reader before use."""
    area = Area(url)
    if not area.listing("store.json"):
        raise ShardError("no sequence store here (store.json is missing)", path=area.url + "/store.json",
                         hint="give the --store URL of a preprocess-sft run")
    area.pull(only=only)
    return area.local



# --------------------------------------------------------------------------- one run's areas


def work_area_for(output_prefix: str, engine: str, staging_dir: Optional[str]) -> Optional[Area]:
    """The run's work directory in object storage, beside an ``s3://`` / ``msc://`` output
    (``.NAME.preprocess/``, as beside a local one), when the Ray engine runs the stages and no
    ``--staging-dir`` (a shared filesystem) is given; None: a local work directory (a local
    output's, or the local engine's staging of a URL's)."""
    if not is_remote(output_prefix) or engine != "ray" or staging_dir:
        return None
    url = ObjectURL.parse(output_prefix)
    return Area(str(url.parent.join(f".{url.name}.preprocess")))


class RunAreas:
    """The areas of one run -- a ``--store`` in object storage, a work directory in the bucket --
    with their locks, as the driver uses them (see the module doc).

    Args:
        output_prefix, engine, staging_dir: the run's (they decide :func:`work_area_for`).
        store: the ``--store`` URL's area, or None.
    """

    def __init__(self, output_prefix: str, engine: str, staging_dir: Optional[str], store: Optional[Area]) -> None:
        self.output_prefix = output_prefix
        self.store, self.work = store, work_area_for(output_prefix, engine, staging_dir)
        self.all = tuple(a for a in (self.store, self.work) if a is not None)
        self.work_lock: Optional[ObjectLock] = None
        self.store_lock: Optional[ObjectLock] = None

    def work_prefix(self, fallback: str) -> str:
        """The prefix the run's local ``WorkDir`` is made from: the mirror of the work area, or ``fallback``."""
        if self.work is None:
            return fallback
        return os.path.join(os.path.dirname(self.work.local), ObjectURL.parse(self.output_prefix).name)

    def _work_lock(self) -> ObjectLock:
        return self.work.lock(f"output {self.output_prefix}")

    def busy(self) -> bool:
        """Whether a run holds the work area now (its lease running); else the area is pulled here."""
        if self.work is None:
            return False
        lock = self._work_lock()
        holder = lock.owner()
        if holder is not None and lock.live(holder):
            return True
        self.work.pull(only=is_metadata)
        return False

    def open(self, resume: bool) -> None:
        """Take the work area's lock (raises, naming its holder), then pull it (``resume``) or clear it."""
        if self.work is None:
            return
        self.work_lock = self._work_lock()
        self.work_lock.acquire()
        try:
            self.work.pull(only=is_metadata) if resume else self.work.clear()
        except BaseException:
            self.release()
            raise

    def lock_store(self, resume: bool, overwrite: bool) -> ObjectLock:
        """:func:`lock_store_area` of the store area; the lock is also held by every unit run meanwhile."""
        self.store_lock = lock_store_area(self.store, resume, overwrite)
        return self.store_lock

    def engine(self, engine, own_store: bool):
        """``engine`` wrapped to run every step's units mirrored (:class:`AreaEngine`), or as it is
        when there is no area. ``own_store``: the store is the work directory's ``store/``."""
        if not self.all:
            return engine
        store = self.store.url if self.store else (self.work.url + "/store" if own_store else None)
        plan = self.work.url + "/plan" if self.work else None
        pulls = {"materialize": tuple(u for u in (store, plan) if u)}   # (the other steps name what they read)
        return AreaEngine(engine, self.all, pulls,
                          lambda: [k for k in (self.work_lock, self.store_lock) if k is not None])

    def keep_only_record(self, record: str) -> None:
        """Delete every object of the work area but ``record`` (relative), receipts first: the
        finished run's work directory reduced to its record in the bucket too (the driver's
        mirror never held the units' data, so no local removal says they are gone)."""
        if self.work is None:
            return
        for rel in commit_points_first([r for r in self.work.listing() if r != record]):
            self.work.objects.delete(self.work.url_of(rel))
            self.work._forget(rel)

    def pull(self, paths: Iterable[str]) -> None:
        """Pull the local ``paths`` (files under an area's mirror) from the bucket: what the
        driver itself reads beyond receipts (e.g. the staged shards it publishes)."""
        paths = list(paths)
        for area in self.all:
            area.fetch(rel for rel in (area.rel(p) for p in paths) if rel is not None)

    def sync(self) -> None:
        """The driver's own writes (receipts, removals) to the bucket's work directory.

        Raises:
            ShardError: the run lost the work directory's lock."""
        if self.work is not None:
            if self.work_lock is not None:
                self.work_lock.check()
            self.work.sync()

    def release(self) -> None:
        """Bring the bucket's work directory up to the local one and release its lock."""
        if self.work is None or self.work_lock is None:
            return
        try:
            self.work.sync()
        except ShardError as exc:
            log.warning("could not bring the work directory in object storage up to date: %s", exc)
        finally:
            self.work_lock.release()
            self.work_lock = None


__all__ = ["Area", "Mirrored", "AreaEngine", "RunAreas", "rebase", "lock_store_area", "mirrored_store", "is_metadata",
           "work_area_for", "commit_points_last", "commit_points_first", "pull_here"]
