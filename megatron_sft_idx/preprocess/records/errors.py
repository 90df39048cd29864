"""Locating bad input records, and naming filesystem failures of the output.

The classes themselves are ``megatron_sft_idx.errors.InputError`` and ``OutputError``.
"""

from __future__ import annotations

import errno

from ...errors import InputError, OutputError

__all__ = ["InputError", "OutputError", "input_error", "output_error", "duplicate_key"]

_OS_REASONS = {
    errno.ENOSPC: ("no space left on the device", "free space or choose another --output-prefix / --store"),
    errno.EDQUOT: ("disk quota exceeded", "free space or choose another --output-prefix / --store"),
    errno.EROFS: ("the filesystem is read-only", "choose a writable --output-prefix / --store"),
    errno.EACCES: ("permission denied", "choose a directory you can write to"),
    errno.EPERM: ("operation not permitted", "choose a directory you can write to"),
    errno.ENOTDIR: ("a parent of this path is not a directory", "choose another --output-prefix / --store"),
    errno.EEXIST: ("a file is in the way of a directory", "choose another --output-prefix / --store"),
    errno.EIO: ("input/output error from the device", "check the disk and rerun"),
    errno.EFBIG: ("a file exceeds the size limit (ulimit -f, or the filesystem's)", "raise the limit"),
}


def input_error(message: str, path: str, line: int, field=None, reason: str = "bad_record",
                hint=None) -> InputError:
    """An :class:`InputError` located at ``path:line``; ``reason`` is the skip-count key."""
    err = InputError(message, path=f"{path}:{line}", field=field, hint=hint)
    err.reason = reason
    return err


def duplicate_key(key: str, path: str, line: int, where) -> InputError:
    """The refusal of a record (or a JSON string inside it, ``where``) whose object names ``key``
    twice: JSON readers differ in which one counts, so the record has no one meaning (reason
    ``duplicate_key``)."""
    inside = f"'{where}' holds" if where else "the record holds"
    return input_error(f"{inside} an object that names the key {key!r} twice: JSON readers differ in which one "
                       "counts, so it has no one meaning", path, line, field=where or key, reason="duplicate_key",
                       hint="keep one of them (fix the producer), or pass --skip-bad to skip and count such records")


def output_error(exc: OSError, resumable: bool = True, where=None) -> OutputError:
    """An :class:`OutputError` naming the path the system refused (``where`` when the error
    carries none, as a failed ``write`` does) and what to do.

    ``resumable``: completed units survive, so the hint says ``--resume`` continues from them.
    """
    what, todo = _OS_REASONS.get(exc.errno, (exc.strerror or str(exc), "fix the destination"))
    hint = todo + ("; then rerun with --resume to continue from the completed units" if resumable else "")
    err = OutputError(f"cannot write: {what}", path=exc.filename or where, hint=hint)
    err.errno = exc.errno
    return err
