"""Signals for every tool: SIGINT/SIGTERM as exceptions, commit points, workers that never
outlive their driver. The one module that installs signal handlers.

* A command line wraps its work in :func:`signals_raise` (or, for a pipeline with workers,
  :func:`terminate_as_exception`): SIGINT raises ``KeyboardInterrupt`` and SIGTERM (what a
  scheduler sends on preemption) or SIGHUP raises :class:`Terminated`, so every ``finally``
  between the signal and ``main`` runs (workers stopped, staging removed) and ``main`` returns
  the conventional status, 130 or 128 + signum (:func:`exit_code`), without a traceback.
* An exception raised by a handler while Python runs inside a C callback (numba's compiler and
  its cache loader call back into Python) is printed and dropped rather than propagated. So
  :func:`signals_raise` also records each signal, and the tools call
  :func:`raise_if_signalled` at their safe points, where a dropped one is raised again.
* A run that has published everything and recorded its completion is *committed*
  (:func:`committed`): a late signal no longer turns that success into a failure.
* A worker process calls :func:`worker_signals` so that even a SIGKILL of the driver takes it
  down (Linux ``PR_SET_PDEATHSIG``; elsewhere a worker notices its parent is gone at its next unit).

Outside a tool (library use, another thread) nothing here changes the process's handlers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Iterator, List

__all__ = ["Terminated", "INTERRUPTS", "signals_raise", "raise_if_signalled", "terminate_as_exception",
           "tool_scope", "process_entry", "committed", "signals_deferred", "die_with_parent", "worker_signals",
           "exit_code", "signal_name"]

_PR_SET_PDEATHSIG = 1
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Inside :func:`tool_scope`: whether a run has committed (its late signals are ignored).
_scope = {"depth": 0, "committed": False, "process": False}
_received: List[int] = []


class Terminated(BaseException):
    """SIGTERM (or SIGHUP) received, raised like KeyboardInterrupt so that cleanup handlers run."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {int(signum)}")
        self.signum = signum


#: What the handlers here raise (catch these, never bare ``BaseException``).
INTERRUPTS = (KeyboardInterrupt, Terminated)


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise() -> Iterator[List[int]]:
    """SIGINT / SIGTERM raise ``KeyboardInterrupt`` / :class:`Terminated` inside the block, and are
    recorded in the list it yields. Off the main thread the signals are left alone."""

    def handler(signum, frame):
        _received.append(signum)
        raise _exception(signum)

    def unraisable(info):
        # A dropped KeyboardInterrupt/Terminated is recorded: no traceback. Once a signal has
        # landed, a finalizer failing on an object it cut short (LLVM's, mid-compile) is its
        # consequence, not news: no traceback either.
        if not (isinstance(info.exc_value, INTERRUPTS) or _received):
            previous_hook(info)

    if not _on_main_thread():
        yield _received
        return
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    del _received[:]
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield _received
    finally:
        if not (_scope["process"] and _received):  # a tool ending on a signal: until it exits
            sys.unraisablehook = previous_hook
        for sig, previous in old.items():
            signal.signal(sig, previous)


def raise_if_signalled() -> None:
    """Raise the exception of the first signal received inside :func:`signals_raise`, if any
    (it may have been dropped inside a C callback)."""
    if _received:
        raise _exception(_received[0])


def _raise(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_exception():
    """Within the block, SIGTERM/SIGHUP raise :class:`Terminated` in the main thread (SIGINT keeps
    Python's ``KeyboardInterrupt``)."""
    if not _on_main_thread():
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


def is_tool_process() -> bool:
    """True when :func:`process_entry` was called: this process is a command-line tool's own."""
    return _scope["process"]


def committed() -> None:
    """The run's outputs are published and its completion recorded: inside :func:`tool_scope`
    (main thread), ignore SIGINT/SIGTERM/SIGHUP from now until the tool exits."""
    if _scope["depth"] and _on_main_thread():
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        _scope["committed"] = True


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP back within the block (main thread, POSIX); one that arrived
    is delivered when the block ends, by the handler then installed."""
    if not _on_main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
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
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_SIGNALS))
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def exit_code(exc: BaseException) -> int:
    """130 for SIGINT (``KeyboardInterrupt``), 128 + signum for :class:`Terminated` (143 for SIGTERM)."""
    if isinstance(exc, Terminated):
        return 128 + int(exc.signum)
    return 128 + signal.SIGINT


def signal_name(exc: BaseException) -> str:
    """``SIGINT``, ``SIGTERM`` or ``SIGHUP``: the signal an exception of :data:`INTERRUPTS` stands for."""
    if isinstance(exc, Terminated):
        return signal.Signals(exc.signum).name
    return "SIGINT"
