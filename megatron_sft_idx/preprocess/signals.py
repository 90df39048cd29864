"""Signals: SIGTERM as an exception in the driver, and workers that never outlive it.

A scheduler preempts with SIGTERM; Python's default for it kills the process without running
``finally`` blocks, which would leave worker processes orphaned. :func:`terminate_as_exception`
turns it into :class:`Terminated` so the engines stop their workers and temporaries are
removed on the way out (exit 143; Ctrl-C is ``KeyboardInterrupt``, exit 130). A worker process
calls :func:`die_with_parent` so that even a SIGKILL of the driver takes it down (Linux
``PR_SET_PDEATHSIG``; elsewhere a worker notices its parent is gone at its next unit).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Inside :func:`tool_scope`: whether a run has committed (its late signals are ignored).
_scope = {"depth": 0, "committed": False, "process": False}


class Terminated(BaseException):
    """SIGTERM (or SIGHUP) received: stop, clean up, exit 128 + signum."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def _raise(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_exception():
    """Within the block, SIGTERM/SIGHUP raise :class:`Terminated` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        if not _scope["committed"]:  # committed: keep ignoring until the tool exits
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def tool_scope():
    """A command-line tool's lifetime. Once its run commits (:func:`committed`), a late SIGINT or
    SIGTERM -- while cleaning up, printing the summary or exiting -- is ignored: the outputs are
    published, and turning that success into exit 143 would make ``--resume`` find nothing to
    resume. Outside a tool (a library call) signals are never changed this way."""
    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    _scope["depth"] += 1
    try:
        yield
    finally:
        _scope["depth"] -= 1
        if _scope["depth"] == 0 and _scope["committed"] and not _scope["process"]:
            _scope["committed"] = False
            for s, handler in saved.items():
                signal.signal(s, handler)


def process_entry() -> None:
    """This process is a command-line tool (its command line, not a library call): a committed
    run keeps ignoring SIGINT/SIGTERM/SIGHUP until the process exits, so a signal during the
    interpreter's shutdown cannot turn a finished run into a killed one."""
    _scope["process"] = True


def committed() -> None:
    """The run's outputs are published and its completion recorded: inside :func:`tool_scope`
    (main thread), ignore SIGINT/SIGTERM/SIGHUP from now until the tool exits."""
    if _scope["depth"] and threading.current_thread() is threading.main_thread():
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        _scope["committed"] = True


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP back within the block (main thread, POSIX); one that arrived
    is delivered when the block ends, by the handler then installed."""
    signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def worker_signals(parent_pid: int) -> None:
    """In a worker: Ctrl-C is the parent's to handle, SIGTERM kills, the parent's death kills."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):  # forked while the parent held signals back
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def exit_code(exc: BaseException) -> int:
    """130 for Ctrl-C, 128 + signum for a termination signal."""
    if isinstance(exc, Terminated):
        return 128 + int(exc.signum)
    return 130
