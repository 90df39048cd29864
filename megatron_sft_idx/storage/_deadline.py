"""Wall-clock budgets for remote requests and operations.

A socket timeout bounds one ``recv``, not a request: a server that sends a byte every few
seconds never lets a 20 s read timeout fire, and a request costs (attempts x read timeout)
when the server accepts and never answers. So the budget is enforced from outside the
request:

* every attempt of a request runs in a thread of this module's daemon pool, and its caller
  waits for it at most the attempt's budget (:func:`run_bounded`). When the budget runs
  out, the caller raises at once and marks the attempt abandoned;
* an abandoned attempt's body reader (:mod:`._responses`) stops at its next piece, at most
  one socket read later, and drops the connection. An attempt still waiting for the first
  bytes of its response ends when the socket read timeout fires;
* an operation (all the attempts and pauses of one read, listing, download or upload) has
  a :class:`Deadline`; no attempt is given more than what is left of it.

The pool's threads are daemons, so an abandoned attempt never delays the exit of the
process, and they belong to one process (a forked DataLoader worker starts its own).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

#: Seconds an idle pool thread waits for a job before it exits.
IDLE_SECONDS = 30.0


class Deadline:
    """A wall-clock budget of ``seconds``, counted from construction (monotonic clock)."""

    __slots__ = ("seconds", "started", "expires")

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.started = time.monotonic()
        self.expires = self.started + self.seconds

    def remaining(self) -> float:
        return self.expires - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class Attempt:
    """One request in flight: when it expires, and whether its caller gave up on it."""

    __slots__ = ("expires", "abandoned")

    def __init__(self, seconds: float) -> None:
        self.expires = time.monotonic() + seconds
        self.abandoned = False

    def over(self) -> bool:
        return self.abandoned or time.monotonic() >= self.expires


class AttemptTimeout(TimeoutError):
    """One attempt outlived its budget. Retried while the operation's deadline lasts; the
    retry loop turns the last one into a :class:`~megatron_sft_idx.errors.RemoteTimeoutError`."""

    def __init__(self, seconds: float, message: str = "") -> None:
        super().__init__(message or f"no complete response within {seconds:.3g} s")
        self.seconds = seconds


_local = threading.local()


def current_attempt() -> Optional[Attempt]:
    """The attempt the calling pool thread is running (None outside :func:`run_bounded`)."""
    return getattr(_local, "attempt", None)


def check_attempt() -> None:
    """Raise :class:`AttemptTimeout` when the calling thread's attempt is over."""
    attempt = current_attempt()
    if attempt is not None and attempt.over():
        raise AttemptTimeout(0.0, "the request's time is up: it was abandoned")


def run_bounded(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` in a pool thread, waited for at most ``seconds``.

    Raises:
        AttemptTimeout: ``fn`` had not returned after ``seconds`` (it is abandoned: see the
            module doc); whatever ``fn`` raised, otherwise.
    """
    attempt = Attempt(seconds)
    done = threading.Event()
    box: list = []

    def job() -> None:
        _local.attempt = attempt
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller, which re-raises it
            box.append((False, exc))
        finally:
            _local.attempt = None
            done.set()

    _pool().submit(job)
    try:
        finished = done.wait(max(0.0, seconds))
    except BaseException:  # e.g. KeyboardInterrupt while waiting: the attempt is abandoned
        attempt.abandoned = True
        raise
    if not finished:
        attempt.abandoned = True
        raise AttemptTimeout(seconds)
    ok, value = box[0]
    if ok:
        return value
    try:
        raise value
    finally:
        del value, box  # no reference cycle through the traceback


class _Pool:
    """Daemon threads that run jobs; a thread is started when none is idle, and exits after
    :data:`IDLE_SECONDS` without work. ``idle`` counts threads waiting and not promised a job."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1  # that thread is promised this job
            self.jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, daemon=True, name="msi-request").start()

    def _work(self) -> None:
        # The job this thread was started for is in the queue; any waiting thread may take it.
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty():
                        self.idle -= 1
                        return
                continue  # a job was promised to an idle thread while this one timed out
            job()
            with self.lock:
                self.idle += 1


_POOL: Optional[_Pool] = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    global _POOL
    pool = _POOL
    if pool is None or pool.pid != os.getpid():
        with _POOL_LOCK:
            if _POOL is None or _POOL.pid != os.getpid():
                _POOL = _Pool()
            pool = _POOL
    return pool
