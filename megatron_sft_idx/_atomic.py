"""The file primitives of publishing: temporaries, fsync, a directory's lock, one small file.

Files are written under temporary names ``<final>.tmp-<pid>-<token>`` and fsynced; the order
in which they then replace their final names -- the commit rule, ``.idx`` last -- is
:mod:`megatron_sft_idx.publishing`'s. A temporary whose writer process is gone is a leftover
of a crash; :func:`clear_stale_temporaries` removes those, never one that a live process is
still writing. :func:`directory_lock` makes publications into one directory take turns (the
writer's half of the protocol that lets readers open one generation of a shard without
locks, ``_files.py``).

Every directory tree the package deletes goes through :func:`remove_tree`, which refuses a
path that is not strictly inside the directory its caller owns: a name made from anything
outside the run (an object key, a URL's last level) can never point a deletion at the node's
temporary directory, a cache shared with other runs, or a user's files
(``tests/project/test_tree_removal.py`` finds any other ``rmtree``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import threading
from typing import BinaryIO, Callable, Dict, Iterable, Iterator, List, Mapping

from .errors import ShardError

_TMP_TAG = ".tmp-"


def temporary_path(final_path: str) -> str:
    return f"{final_path}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}"


def _writer_pid(tmp_path: str) -> int:
    tail = tmp_path.rsplit(_TMP_TAG, 1)[-1]
    try:
        return int(tail.split("-", 1)[0])
    except ValueError:
        return -1


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clear_stale_temporaries(final_paths: Iterable[str]) -> List[str]:
    """Remove temporaries of ``final_paths`` left by processes that no longer run.

    A temporary may be a directory (the merge tool stages a whole shard in one); it is
    removed with its contents. Each directory is listed once, however many of ``final_paths``
    it holds (a store partition's five files: one listing, not five, of a directory that
    holds every partition's).
    """
    by_dir: Dict[str, List[str]] = {}
    for final in final_paths:
        directory, name = os.path.split(final)
        by_dir.setdefault(directory, []).append(name + _TMP_TAG)
    removed = []
    for directory, heads in by_dir.items():
        try:
            # (only names holding the tag can be temporaries: a store's directory holds every
            # partition's files, and each partition's writer lists it -- matching every name
            # against every head made the partitions' start quadratic, ~3 ms each at 88)
            names = sorted(n for n in os.listdir(directory or ".") if _TMP_TAG in n)
        except OSError:   # (as glob: a directory that is missing or unreadable holds none)
            continue
        for head in heads:
            for name in names:
                if name.startswith(head):
                    _remove_if_stale(os.path.join(directory, name), removed)
    return removed


def _remove_if_stale(tmp: str, removed: List[str]) -> None:
    pid = _writer_pid(tmp)
    if pid == os.getpid() or not _alive(pid):
        try:
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                remove_tree(tmp, os.path.dirname(os.path.abspath(tmp)))
            else:
                os.unlink(tmp)
            removed.append(tmp)
        except FileNotFoundError:
            pass


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: signals a helper thread of this module never takes: the kernel delivers them to the main
#: thread, which handles them at once (a handler run on another thread waits for the main one)
_MAIN_THREAD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} if hasattr(signal, "SIGHUP") else set()


def _helper(target: Callable, *args) -> threading.Thread:
    """A started daemon thread running ``target(*args)`` with :data:`_MAIN_THREAD_SIGNALS` blocked."""
    def run() -> None:
        if _MAIN_THREAD_SIGNALS and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
        target(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def fsync_files(paths: Iterable[str]) -> None:
    """:func:`fsync_file` of every path, concurrently: the call returns when all are durable, as
    one after another would, in about one sync's time instead of one per file (a journaling
    filesystem commits the concurrent syncs together: 6 files, 24 -> 6 ms on this project's
    machine). One short-lived thread per file beyond the first: a pool's threads would not
    survive the fork of a local engine's workers.

    Raises:
        OSError: the first file that could not be synced (after every sync has ended).
    """
    paths = list(paths)
    errors: List[BaseException] = []

    def sync(path: str) -> None:
        try:
            fsync_file(path)
        except Exception as exc:  # re-raised in the calling thread below (an interrupt raises at once)
            errors.append(exc)

    threads = [_helper(sync, path) for path in paths[1:]]
    if paths:
        sync(paths[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the renames still happened
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_lock(path: str) -> Iterator[None]:
    """Exclusive ``flock`` on the directory holding ``path``, so that two publications into
    it never interleave. Best effort: where the filesystem refuses ``flock`` (some network
    filesystems), publications proceed unlocked."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def write_file_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace one small file atomically: ``write(f)`` fills a temporary, which is
    fsynced and renamed over ``path``; readers see the old file or the new one, never a part."""
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(path)


def write_files_atomically(files: Mapping[str, bytes], alongside: Callable[[], None] = lambda: None) -> None:
    """Create or replace small files atomically, each as :func:`write_file_atomically` does, in
    one sync's wait: all are written to temporaries, fsynced concurrently while ``alongside()``
    runs in this thread (a shard's own commit, say), then renamed over their paths (after
    ``alongside`` returned), and each directory is fsynced once. Nothing is renamed when
    ``alongside`` or a write fails; the temporaries are removed.

    Raises:
        OSError: a write, sync or rename failed; whatever ``alongside`` raises.
    """
    tmps = {path: temporary_path(path) for path in files}
    errors: List[BaseException] = []

    def sync() -> None:
        try:
            fsync_files(tmps.values())
        except Exception as exc:  # re-raised in the calling thread below (an interrupt raises at once)
            errors.append(exc)

    try:
        for path, data in files.items():
            with open(tmps[path], "wb") as f:
                f.write(data)
        syncing = _helper(sync)
        try:
            alongside()
        finally:
            syncing.join()
        if errors:
            raise errors[0]
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        remove_quietly(tmp for tmp in tmps.values() if os.path.lexists(tmp))
    for path in {os.path.dirname(os.path.abspath(path)): path for path in files}.values():
        fsync_dir(path)   # (the directory holding path)


def remove_quietly(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def inside(path: str, within: str) -> bool:
    """Whether ``path`` names an entry strictly inside the directory ``within``: its parent
    resolved (links followed), its last level taken as it is (a link there is the link itself),
    never ``within`` itself nor anything beside or above it."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if name in ("", ".", ".."):
        return False
    base = os.path.realpath(within)
    target = os.path.join(os.path.realpath(os.path.dirname(path)), name)
    return target != base and os.path.commonpath([base, target]) == base


def remove_tree(path: str, within: str, ignore_errors: bool = True) -> None:
    """Delete the directory tree ``path`` (a link there: the link alone; nothing there: nothing),
    the one way the package removes a tree (module doc).

    ``within``: the directory the caller created or owns (a run's work directory, a mirror's home,
    a staging directory's parent); ``path`` must be strictly inside it. ``ignore_errors``: as
    :func:`shutil.rmtree` takes it.

    Raises:
        ShardError: ``path`` is not strictly inside ``within`` (nothing is removed).
        OSError: the removal failed and ``ignore_errors`` is false.
    """
    if not inside(path, within):
        raise ShardError("refusing to delete a directory outside the one this run owns", path=path,
                         field="remove", expected=f"a path strictly inside {within}",
                         hint="a name made from a URL or an object key pointed outside the run's own directories; "
                              "report it")
    target = os.path.abspath(path)
    if os.path.islink(target):
        os.unlink(target)
        return
    if not os.path.lexists(target):
        return
    shutil.rmtree(target, ignore_errors=ignore_errors)
