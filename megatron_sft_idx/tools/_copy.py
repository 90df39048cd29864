"""Copy a file's bytes onto the end of another inside the kernel where the OS allows.

``copy_file_range`` (Linux >= 4.5; on some filesystems a reflink, no data moved),
then ``sendfile``, then a buffered ``pread``/``write``: the merge tool's data files
never pass through Python objects. A method that reports it cannot serve this pair
of files hands over to the next one at the byte where it stopped.
"""

from __future__ import annotations

import errno
import os

from ..errors import ShardError

_BUFFER = 1 << 22
_SENDFILE_MAX = 1 << 30
#: errnos meaning "this call cannot copy between these files", not "the copy failed".
_UNSUPPORTED = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.ENOTSUP}


class _Unsupported(Exception):
    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


def copy_range(src_fd: int, dst_fd: int, count: int, *, src_path: str = "?") -> str:
    """Append bytes ``[0, count)`` of ``src_fd`` at ``dst_fd``'s current position.

    Returns the method that finished the copy: ``"copy_file_range"``, ``"sendfile"`` or ``"pread"``.

    Raises:
        ShardError: the source ended before ``count`` bytes (it changed during the copy).
        OSError: the copy failed (disk full, I/O error).
    """
    done = 0
    for name, method in (("copy_file_range", _copy_file_range), ("sendfile", _sendfile), ("pread", _pread)):
        try:
            method(src_fd, dst_fd, done, count, src_path)
            return name
        except _Unsupported as stop:
            done = stop.done
    raise AssertionError("unreachable: pread/write serves every pair of files")  # pragma: no cover


def _short(src_path: str, done: int, count: int) -> ShardError:
    return ShardError("file ended while being copied (changed or truncated meanwhile?)", path=src_path,
                      field="size", expected=count, actual=done,
                      hint="do not modify input shards during a merge; check them with check-idx")


def _copy_file_range(src_fd, dst_fd, done, count, src_path) -> None:
    if not hasattr(os, "copy_file_range"):
        raise _Unsupported(done)
    _kernel_copy(lambda left, at: os.copy_file_range(src_fd, dst_fd, left, at), done, count, src_path)


def _sendfile(src_fd, dst_fd, done, count, src_path) -> None:
    if not hasattr(os, "sendfile"):
        raise _Unsupported(done)
    _kernel_copy(lambda left, at: os.sendfile(dst_fd, src_fd, at, min(left, _SENDFILE_MAX)), done, count, src_path)


def _kernel_copy(call, done: int, count: int, src_path: str) -> None:
    """Copy ``[done, count)`` with ``call(bytes left, source offset) -> bytes copied``; an errno
    meaning "not between these files" hands over to the next method at the byte reached."""
    while done < count:
        try:
            n = call(count - done, done)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                raise _Unsupported(done) from None
            raise
        if n == 0:
            raise _short(src_path, done, count)
        done += n


def _pread(src_fd, dst_fd, done, count, src_path) -> None:
    while done < count:
        chunk = os.pread(src_fd, min(_BUFFER, count - done), done)
        if not chunk:
            raise _short(src_path, done, count)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst_fd, view):]
        done += len(chunk)
