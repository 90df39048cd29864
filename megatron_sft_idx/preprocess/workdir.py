"""The run's work directory and the lock that keeps two processes of one machine from writing it.

``<parent>/.<name>.preprocess/`` beside the output prefix ``<parent>/<name>`` holds::

    lock                    pid of the running process
    store/                  the sequence store, unless --store DIR
    receipts/{plan,materialize,publish}/NNNNNN.json
    plan/out.plan           the pack plan
    staged/<shard files>    output shards before publishing

Its name does not depend on the pid, so ``--resume`` finds it again; a run without
``--resume`` removes the leftovers of a previous run (never of a live one).

Locks: every lock a run takes (this pid file, and :class:`~..storage.lease.ObjectLock` for a
place in object storage) meets one small protocol, :class:`RunLock`.
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Protocol

from .._atomic import _alive, remove_tree
from ..errors import ShardError

_LEGACY_TAG = ".work-"  # work directories of the pre-staged pipeline: .<name>.work-<pid>
_DONE_TAG = ".done-"    # a finished run's work directory being removed: .<name>.preprocess.done-<pid>
_SUFFIX = ".preprocess"


class RunLock(Protocol):
    """What a run does with a lock, wherever it lives (a pid file, an object in a bucket)."""

    held: bool

    def acquire(self) -> None:
        """Take it (or take over a holder that is gone); raises ShardError naming a live holder."""

    def holder(self) -> Optional[str]:
        """The live holder other than this process, described (``pid 42 on node-3``), or None."""

    def check(self) -> None:
        """Raises ShardError when this holder lost the lock meanwhile."""

    def release(self) -> None:
        """Give it up (never another holder's)."""


class Lock:
    """``path`` holding the owner's pid, created exclusively; a dead owner's lock is taken over.
    A :class:`RunLock`.

    Raises:
        ShardError: a live process holds it.
    """

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.what = what
        self.held = False

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = self.owner()
                if pid is not None and pid != os.getpid() and _alive(pid):
                    raise ShardError(f"another process (pid {pid}) is writing {self.what}", path=self.path,
                                     hint="wait for it to finish, or stop it; a lock of a dead process is "
                                          "taken over automatically") from None
                os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.held = True
            return

    def owner(self):
        try:
            with open(self.path) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return None

    def holder(self) -> Optional[str]:
        pid = self.owner()
        return f"pid {pid}" if pid is not None and pid != os.getpid() and _alive(pid) else None

    def check(self) -> None:
        """A pid file is never taken over from a live holder: nothing to lose."""

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class WorkDir:
    """The work directory ``path`` of a run writing ``what`` (:meth:`beside` an output prefix,
    or a mirror's local tree)."""

    def __init__(self, path: str, what: str) -> None:
        self.path = os.path.abspath(path)
        self.parent = os.path.dirname(self.path)
        base = os.path.basename(self.path)
        self.name = base[1:-len(_SUFFIX)] if base.startswith(".") and base.endswith(_SUFFIX) else base
        self.lock = Lock(os.path.join(self.path, "lock"), what)
        self.resumed = False
        self.publishing = False  # set once files may appear under final names
        self.closed = False

    @classmethod
    def beside(cls, output_prefix: str) -> "WorkDir":
        """``<parent>/.<name>.preprocess`` beside the output prefix ``<parent>/<name>``."""
        parent, name = os.path.split(os.path.abspath(output_prefix))
        return cls(os.path.join(parent, f".{name}{_SUFFIX}"), f"output {output_prefix}")

    @property
    def receipts(self) -> str:
        return os.path.join(self.path, "receipts")

    @property
    def store(self) -> str:
        return os.path.join(self.path, "store")

    @property
    def plan(self) -> str:
        return os.path.join(self.path, "plan", "out.plan")

    @property
    def staged(self) -> str:
        return os.path.join(self.path, "staged")

    def open(self, resume: bool) -> None:
        """Create (or, with ``resume``, reuse) the work directory and take its lock.

        Raises:
            OSError: the output's directory cannot be created (the caller names it).
            ShardError: another live run holds the lock.
        """
        os.makedirs(self.parent, exist_ok=True)
        self._clear_stale()
        existed = os.path.isdir(self.path)
        if existed:
            owner = self.lock.owner()
            if owner is not None and owner != os.getpid() and _alive(owner):
                self.lock.acquire()  # raises, naming the owner
            if not resume:
                remove_tree(self.path, self.parent, ignore_errors=False)
        for sub in ("plan", "staged", "receipts"):
            os.makedirs(os.path.join(self.path, sub), exist_ok=True)
        self.lock.acquire()
        self.resumed = existed and resume

    def finished(self) -> list:
        """Directories of this output's runs that finished and were being removed (dead owners)."""
        return [d for d in glob.glob(glob.escape(self.path + _DONE_TAG) + "*")
                if d.rsplit(_DONE_TAG, 1)[-1].isdigit() and not _alive(int(d.rsplit(_DONE_TAG, 1)[-1]))]

    def _clear_stale(self) -> None:
        for stale in glob.glob(os.path.join(self.parent, glob.escape(f".{self.name}{_LEGACY_TAG}") + "*")):
            pid = stale.rsplit(_LEGACY_TAG, 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                remove_tree(stale, self.parent)
        for stale in self.finished():
            remove_receipts_last(stale)

    def retire(self) -> None:
        """After success: release the lock and remove everything but the run's record (the
        ``done`` receipt), which lets ``--resume`` of a finished run be a no-op. The record is
        removed last of all, by the next run that does not resume this one."""
        self.lock.release()
        keep_only_record(self.path)
        self.closed = True

    def close(self, remove: bool) -> None:
        """Release the lock; ``remove`` deletes the directory (after a failure no resume can
        fix): renamed out of the way first, in one step, then deleted receipts last, so a kill
        during the deletion leaves either the whole directory or nothing. A finished run's
        record stays (only the record: the outputs it lists remain that run's own, so a failed
        ``--resume`` of a finished run never orphans them). The directory is kept after an
        interruption or a filesystem error."""
        self.lock.release()
        if remove and os.path.isdir(self.path):
            if os.path.exists(os.path.join(self.path, RECORD)):
                keep_only_record(self.path)
            else:
                done = self.path + _DONE_TAG + str(os.getpid())
                os.replace(self.path, done)
                remove_receipts_last(done)
        self.closed = True


#: The finished run's record, relative to its work directory: all that stays after success.
RECORD = os.path.join("receipts", "done", "000000.json")


def keep_only_record(path: str) -> None:
    """Delete everything in the work directory ``path`` but :data:`RECORD` (a kill part way
    leaves the record and some leftovers; the next ``--resume`` finishes the job)."""
    kept = os.path.join(path, RECORD)
    for directory in (path, os.path.dirname(os.path.dirname(kept)), os.path.dirname(kept)):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            full = os.path.join(directory, name)
            if full == kept or kept.startswith(full + os.sep):
                continue
            if os.path.isdir(full) and not os.path.islink(full):
                remove_tree(full, path)
            else:
                os.unlink(full)


def remove_receipts_last(path: str) -> None:
    """Delete a work directory, its receipts (the commit points) after everything else."""
    for name in os.listdir(path):
        if name != "receipts":
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                remove_tree(full, path)
            else:
                os.unlink(full)
    remove_tree(path, os.path.dirname(os.path.abspath(path)))
