"""A prefix of object storage mirrored on this node's own disk.

A :class:`Mirror` is a URL root (``s3://b/store``) and a node-local root
``<tempfile.gettempdir()>/msi-area-<digest of the URL>/tree``, computed on each node for itself
and named by the digest alone: no part of an object key ever becomes a local name (a key may
hold ``..`` or any character a local path cannot). Code that works on local paths keeps doing
so; the mirror moves bytes between the two roots:

* :meth:`Mirror.pull` makes the local tree equal to the bucket under a prefix (or the objects
  under it a filter keeps): an object whose ETag the local copy was made from (that copy
  unchanged since: size and mtime) is kept, others are downloaded (pinned to their ETag, to a
  temporary name, renamed into place), local files whose object is gone are removed. The sizes
  of what was listed but not downloaded are kept (:meth:`Mirror.size`), so a reader of the
  mirror can tell an object that is there from one that is missing without its bytes. What is
  pulled is verified by its user before use, as a local file is;
* :meth:`Mirror.push` uploads files in the order given (the caller puts commit points last);
* :meth:`Mirror.sync` pushes what changed locally and deletes the objects of files removed
  locally, in the order of the mirror's ``rank`` (commit points last when writing, first when
  deleting); :meth:`Mirror.clear` empties the prefix and the local tree;
* :meth:`Mirror.in_use` holds this node's copy for a run (a shared ``flock`` on
  ``msi-area-<digest>.use``) and :meth:`Mirror.remove_if_unused` removes it (the tree, what is
  known and the lock file) unless a run holds it: a run's copy lasts as long as the run.

What is known of each local file (the ETag it came from, its size and mtime) is kept beside the
tree, under ``msi-area-<digest>/.etags/``, so renaming or deleting the tree is seen by the next
:meth:`~Mirror.sync`. The object ``lock`` under the root is never mirrored: it is an
:class:`~.lease.ObjectLock` of its own (:meth:`Mirror.lock`).

Nothing here knows what the files are: their order is the ``rank`` its owner gives.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import fcntl
import hashlib
import os
import tempfile
import uuid
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .._atomic import remove_tree
from ..errors import ShardError
from .config import StorageConfig
from .lease import PROBE_SUFFIX, ObjectLock
from .urls import ObjectURL, check_url, url_problem

_HOME_TAG = "msi-area-"
#: The lock file beside a home (``msi-area-<digest>.use``): shared by every run using the mirror,
#: taken exclusively (without waiting) to remove it.
_USE = ".use"
_TREE = "tree"
_ETAGS = ".etags"
#: Names under a root that are never mirrored: the lock is an object of its own.
_NOT_MIRRORED = ("lock",)
#: A lock's probe objects (:func:`~.lease.require_conditional_writes`), never mirrored.
_PROBES = "lock" + PROBE_SUFFIX

#: ``rank(rel) -> sortable``: the order files are written in (smallest first); deletions go in
#: the reverse order. The default writes in name order.
Rank = Callable[[str], object]


def _by_name(rel: str) -> object:
    return rel


def local_home(url: str) -> str:
    """The directory on this node that holds the mirror of ``url`` (its tree and what is known)."""
    digest = hashlib.sha256(str(ObjectURL.parse(url)).rstrip("/").encode("utf-8")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), _HOME_TAG + digest)


class Mirror:
    """A URL root and this node's local mirror of it (see the module doc).

    Args:
        url: the root (``s3://bucket/prefix`` or ``msc://profile/path``): no empty, ``.`` or ``..``
            level, not a bucket's root (:func:`~.urls.url_problem`).
        rank: the order files are written in (see :data:`Rank`).
        config: storage settings (retries, concurrency, part size, lease).

    Raises:
        ShardError: ``url`` names no prefix a mirror can be made of (see ``url``); from
            :meth:`listing` (so :meth:`pull`): an object under it whose key has such a level.
    """

    def __init__(self, url: str, rank: Rank = _by_name, config: Optional[StorageConfig] = None) -> None:
        self.url = check_url(str(ObjectURL.parse(url)).rstrip("/"), "the prefix mirrored", root=False)
        self.root = ObjectURL.parse(self.url)
        self.home = local_home(self.url)
        self.local = os.path.join(self.home, _TREE)
        self._etags = os.path.join(self.home, _ETAGS)
        self.rank = rank
        self.config = StorageConfig.resolve(config)
        self._listed: Dict[str, int] = {}   # rel -> size, of what the last pulls listed

    def __reduce__(self):   # (a node rebuilds its own: the local root is computed where it runs)
        return (Mirror, (self.url, self.rank, self.config))

    def __repr__(self) -> str:
        return f"Mirror({self.url!r} -> {self.local!r})"

    @property
    def objects(self):
        """This process's client of the mirror's object store."""
        from ._stores import store_for   # (start-up: a local run imports this module, never the clients')

        return store_for(self.root, self.config)

    # ------------------------------------------------------------------ names

    def child(self, rel: str) -> str:
        """The local path of ``rel`` (``/``-separated, relative to the root)."""
        return os.path.join(self.local, *rel.split("/"))

    def rel(self, path: str) -> Optional[str]:
        """``path`` relative to the local root (``/``-separated), or None when outside it."""
        rel = os.path.relpath(os.path.abspath(path), self.local)
        if rel == "." or rel == ".." or rel.startswith(".." + os.sep):
            return None
        return rel.replace(os.sep, "/")

    def url_of(self, rel: str) -> ObjectURL:
        return self.root.join(rel)

    def url_for(self, path: str) -> Optional[str]:
        """The URL of the object the local path ``path`` stands for, or None outside the mirror."""
        rel = self.rel(path)
        return None if rel is None else str(self.url_of(rel))

    def size(self, path: str) -> Optional[int]:
        """The size of ``path`` as the mirror knows it: the local file's, else (listed by a pull,
        not downloaded) its object's; None when neither is known."""
        try:
            return os.path.getsize(path)
        except OSError:
            pass
        rel = self.rel(path)
        return None if rel is None else self._listed.get(rel)

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
            if rel and rel not in _NOT_MIRRORED and not rel.startswith(_PROBES):
                if url_problem(f"{self.root.scheme}://{self.root.bucket}/{rel}"):
                    raise ShardError("an object under the mirrored prefix has a key that names no local file "
                                     "(an empty, '.' or '..' level): mirroring it would write outside the mirror",
                                     path=str(obj), field="key", expected=f"objects under {self.url}/",
                                     hint="remove or rename that object; nothing of this run wrote it")
                out[rel] = info
        return out

    def pull(self, prefix: str = "", only: Optional[Callable[[str], bool]] = None) -> int:
        """Make the local tree under ``prefix`` what the bucket holds (module doc); with ``only``,
        just the objects whose name (relative, ``/``-separated) it keeps: the sizes of the others
        are known (:meth:`size`), their bytes stay in the bucket. Returns the number of objects
        downloaded."""
        listed = self.listing(prefix)
        for rel in [r for r in self._listed if r.startswith(prefix)]:
            del self._listed[rel]
        self._listed.update((rel, info.size) for rel, info in listed.items())
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
        by_directory: Dict[str, set] = {}
        for rel in set(rels):
            by_directory.setdefault(rel.rsplit("/", 1)[0] + "/" if "/" in rel else "", set()).add(rel)
        return sum(self.pull(prefix, only=names.__contains__) for prefix, names in sorted(by_directory.items()))

    def fetch_paths(self, paths: Iterable[str]) -> int:
        """:meth:`fetch` of the local ``paths`` under this mirror (others are ignored)."""
        return self.fetch(rel for rel in (self.rel(p) for p in paths) if rel is not None)

    def push(self, paths: Sequence[str]) -> None:
        """Upload the local files ``paths`` (under the local root), one after another in this
        order (the caller puts the commit points last)."""
        store = self.objects
        for path in paths:
            rel = self.rel(path)
            if rel is None:
                raise ShardError("a file to push is outside its mirror", path=path, expected=self.local)
            url = self.url_of(rel)
            if os.path.getsize(path) <= self.config.part_size:
                with open(path, "rb") as f:
                    etag = store.put_bytes(url, f.read())
            else:
                etag = store.upload(path, url)
            self._remember(rel, etag)

    def in_order(self, paths: Iterable[str]) -> List[str]:
        """Local ``paths`` (under the root) in the order they are written: by :attr:`rank`."""
        return sorted(paths, key=lambda p: (self.rank(self.rel(p) or p), p))

    def sync(self) -> None:
        """Push every local file changed since it was pulled or pushed (in :attr:`rank` order),
        delete the objects of local files removed (in the reverse order)."""
        changed = []
        for directory, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(directory, name)
                rel = self.rel(path)
                if rel is None or rel in _NOT_MIRRORED or ".pull-" in name or ".tmp" in name:
                    continue
                if self._unchanged(rel) is None:
                    changed.append(path)
        removed = [rel for rel in self._known_files() if not os.path.exists(self.child(rel))]
        for rel in sorted(removed, key=lambda r: (self.rank(r), r), reverse=True):
            self.objects.delete(self.url_of(rel))
            self._forget(rel)
        self.push(self.in_order(changed))

    def delete_all_but(self, kept: Iterable[str] = ()) -> None:
        """Delete every object under the root but the ``kept`` names (relative), in the reverse
        of :attr:`rank` order; forget them here."""
        kept = set(kept)
        doomed = [rel for rel in self.listing() if rel not in kept]
        for rel in sorted(doomed, key=lambda r: (self.rank(r), r), reverse=True):
            self.objects.delete(self.url_of(rel))
            self._forget(rel)
            self._listed.pop(rel, None)

    def clear(self) -> None:
        """Delete every object under the root and the local mirror."""
        self.delete_all_but()
        self._listed.clear()
        self.remove_local()

    def remove_local(self) -> None:
        """Remove this node's copy (the tree and what is known of it); the bucket is untouched."""
        remove_tree(self.home, os.path.dirname(self.home))

    @contextlib.contextmanager
    def in_use(self):
        """This node's copy held for a run (a shared ``flock`` on ``<home>.use``): while held, no
        :meth:`remove_if_unused` of another run (another process) removes it."""
        fd = _locked(self.home + _USE, fcntl.LOCK_SH)
        try:
            yield self
        finally:
            os.close(fd)

    def remove_if_unused(self) -> bool:
        """Remove this node's copy (as :meth:`remove_local`) and its lock file unless a run holds it
        (:meth:`in_use`, including one of this process); returns whether it was removed. The
        bucket is untouched: a later run pulls what it needs again."""
        path = self.home + _USE
        try:
            fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            self.remove_local()
            os.unlink(path)   # (under the lock: a run that opened it before re-opens it, see _locked)
        finally:
            os.close(fd)
        return True

    def object_of(self, path: str) -> Optional[str]:
        """The URL of the object the local file ``path`` is an unchanged copy of (pulled or
        pushed as that ETag, and the object still that ETag), else None."""
        rel = self.rel(path)
        etag = None if rel is None else self._unchanged(rel)
        if not etag:
            return None
        info = self.objects.head(self.url_of(rel))
        return str(self.url_of(rel)) if info is not None and info.etag == etag else None

    def lock(self, what: str) -> ObjectLock:
        """The lock object of this root (never mirrored)."""
        return ObjectLock(str(self.url_of("lock")), what, self.config)


def _locked(path: str, operation: int) -> int:
    """A descriptor of the file ``path`` (created if missing) locked by ``operation``; a file
    unlinked by a remover while this waited for it is opened again (so a lock is only ever held
    on the file the path names).

    Raises:
        BlockingIOError: ``LOCK_NB`` and another holder; OSError: the file cannot be made."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, operation)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


__all__ = ["Mirror", "Rank", "local_home"]
