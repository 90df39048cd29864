"""SIGINT and SIGTERM as exceptions, so that a tool's cleanup runs and nothing half-done is published.

A command line wraps its work in :func:`signals_raise`: SIGINT raises ``KeyboardInterrupt``
and SIGTERM (what a scheduler sends on preemption) raises :class:`Terminated`, so every
``finally`` between the signal and ``main`` runs (staging directories are removed,
temporaries unlinked) and ``main`` returns the conventional status, 130 or 143
(:func:`exit_code`), without a traceback.

An exception raised by a signal handler while Python runs inside a C callback (numba's
compiler and its cache loader call back into Python) is printed and dropped rather than
propagated. So each signal is also recorded, and the tools call :func:`raise_if_signalled`
at their safe points -- before publishing anything, between inputs -- where a dropped one
is raised again. Outside :func:`signals_raise` (library use) nothing is recorded and
:func:`raise_if_signalled` does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator, List

__all__ = ["Terminated", "signals_raise", "raise_if_signalled", "exit_code", "signal_name", "INTERRUPTS"]


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that cleanup handlers run."""


#: What :func:`signals_raise` turns into exceptions (catch these, never bare ``BaseException``).
INTERRUPTS = (KeyboardInterrupt, Terminated)

_received: List[int] = []


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


@contextlib.contextmanager
def signals_raise() -> Iterator[List[int]]:
    """SIGINT / SIGTERM raise ``KeyboardInterrupt`` / :class:`Terminated` inside the block, and are
    recorded in the list it yields. Off the main thread the signals are left alone."""

    def handler(signum, frame):
        _received.append(signum)
        raise _exception(signum)

    def unraisable(info):  # a dropped KeyboardInterrupt/Terminated is recorded: no traceback
        if not isinstance(info.exc_value, INTERRUPTS):
            previous_hook(info)

    try:
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield _received
        return
    del _received[:]
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield _received
    finally:
        sys.unraisablehook = previous_hook
        for sig, previous in old.items():
            signal.signal(sig, previous)


def raise_if_signalled() -> None:
    """Raise the exception of the first signal received inside :func:`signals_raise`, if any
    (it may have been dropped inside a C callback)."""
    if _received:
        raise _exception(_received[0])


def exit_code(exc: BaseException) -> int:
    """130 for SIGINT (``KeyboardInterrupt``), 143 for SIGTERM (:class:`Terminated`)."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def signal_name(exc: BaseException) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
