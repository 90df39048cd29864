"""Publishing a set of files so that readers see all of them or none.

Files are written under temporary names ``<final>.tmp-<pid>-<token>``, fsynced,
then renamed over their final names in a fixed order with the file every
reader needs (``.idx``) last, and the directory is fsynced. A temporary whose
writer process is gone is a leftover of a crash; :func:`clear_stale_temporaries`
removes those, never one that a live process is still writing.

:func:`publish` is the writer's half of the protocol that lets readers open one
generation of a shard without locks (``_files.py``): the gating file goes first and
comes back last, as a file created for this publication, and publications into one
directory take turns under a lock on the directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
from typing import BinaryIO, Callable, Iterable, Iterator, List, Sequence, Tuple

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
        import fcntl
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except (ImportError, OSError):
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


def publish(pairs: Sequence[Tuple[str, str]], unpublish_first: str, remove: Iterable[str] = ()) -> None:
    """Rename each ``(tmp, final)`` in order; ``pairs[-1]`` is the file that makes the set visible.

    ``unpublish_first`` (the final name of that gating file) is removed before
    anything is renamed, so that while an existing shard is being replaced no
    reader can pair its old index with new data; then the files in ``remove``
    (old files the new set lacks). If a rename fails, every file already renamed
    is removed again: the prefix then holds no dataset at all rather than a mixture.

    ``pairs[-1]``'s temporary must be a file created for this publication, never a
    link to one published before: readers tell generations apart by its inode.
    """
    for tmp, _ in pairs:
        fsync_file(tmp)
    with directory_lock(unpublish_first):
        try:
            os.unlink(unpublish_first)
        except FileNotFoundError:
            pass
        fsync_dir(unpublish_first)
        remove_quietly(remove)
        done: List[str] = []
        try:
            for tmp, final in pairs:
                os.replace(tmp, final)
                done.append(final)
                if os.path.lexists(tmp):
                    # rename() of two links to one inode succeeds and does nothing (POSIX): the
                    # final name already holds this content (a rerun of a killed promotion).
                    os.unlink(tmp)
        except BaseException:
            for final in done:
                try:
                    os.unlink(final)
                except OSError:
                    pass
            raise
        fsync_dir(pairs[-1][1])


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
