"""The file primitives of publishing: temporaries, fsync, a directory's lock, one small file.

Files are written under temporary names ``<final>.tmp-<pid>-<token>`` and fsynced; the order
in which they then replace their final names -- the commit rule, ``.idx`` last -- is
:mod:`megatron_sft_idx.publishing`'s. A temporary whose writer process is gone is a leftover
of a crash; :func:`clear_stale_temporaries` removes those, never one that a live process is
still writing. :func:`directory_lock` makes publications into one directory take turns (the
writer's half of the protocol that lets readers open one generation of a shard without
locks, ``_files.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets
import shutil
from typing import BinaryIO, Callable, Iterable, Iterator, List

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
    removed with its contents.
    """
    removed = []
    for final in final_paths:
        for tmp in glob.glob(glob.escape(final) + _TMP_TAG + "*"):
            pid = _writer_pid(tmp)
            if pid == os.getpid() or not _alive(pid):
                try:
                    if os.path.isdir(tmp) and not os.path.islink(tmp):
                        shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        os.unlink(tmp)
                    removed.append(tmp)
                except FileNotFoundError:
                    pass
    return removed


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def remove_quietly(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
