"""Retries with exponential backoff and jitter, within a wall-clock deadline, ending in an
error that names the object.

Each store classifies its client's exceptions into one of four outcomes; this
module only runs the loop, so the policy (which failures are worth another try,
how long to wait, how long an operation may take) is stated once for every client.
Each attempt runs under its own budget (:func:`~._deadline.run_bounded`), never more
than what is left of the operation's :class:`~._deadline.Deadline`; pauses are cut short
by the deadline too.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from typing import Callable, Optional, TypeVar

from ..errors import ObjectChangedError, RemoteStorageError, RemoteTimeoutError, ShardError, ShardNotFoundError
from ._deadline import AttemptTimeout, Deadline, run_bounded

T = TypeVar("T")
logger = logging.getLogger("megatron_sft_idx.storage")


class Outcome(enum.Enum):
    RETRY = "retry"        # throttling, 5xx, reset, timeout, short body: try again after a pause
    MISSING = "missing"    # 404 / no such key: never retried
    CHANGED = "changed"    # precondition failed: the object was replaced since open
    FATAL = "fatal"        # access denied, bad request, bad range: retrying cannot help


class ShortReadError(IOError):
    """The server sent fewer (or more) bytes than the range asked for, or a body that fails
    its checksum: retried, never used."""


def backoff_delay(attempt: int, base: float, ceiling: float) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(ceiling, base * 2**attempt)]."""
    return random.uniform(0, min(ceiling, base * (2 ** attempt)))


def with_retries(op: Callable[[], T], *, what: str, path: str, classify: Callable[[BaseException], Outcome],
                 attempts: int, base: float, ceiling: float, deadline: Optional[Deadline] = None,
                 request_seconds: Optional[float] = None,
                 on_retry: Optional[Callable[[BaseException], None]] = None) -> T:
    """Run ``op`` until it succeeds, retrying transient failures ``attempts`` times in total,
    each attempt bounded by ``request_seconds`` and all of them by ``deadline`` (both None:
    ``op`` runs in the calling thread, unbounded, as in unit tests of the policy).

    Raises:
        ShardNotFoundError: the object does not exist.
        ObjectChangedError: the object changed since it was opened (a precondition failed).
        RemoteTimeoutError: an attempt outlived its budget and the deadline allowed no other.
        RemoteStorageError: a permanent failure, or transient ones outlasting every attempt.
    """
    bounded = deadline is not None or request_seconds is not None
    if deadline is None:
        deadline = Deadline(float("inf"))
    last: Optional[BaseException] = None
    tried = 0
    for attempt in range(attempts):
        budget = min(deadline.remaining(), request_seconds if request_seconds is not None else float("inf"))
        if budget <= 0:
            break
        tried += 1
        try:
            return run_bounded(op, budget) if bounded else op()
        except ShardError:
            raise
        except Exception as exc:  # classified below; anything unknown is FATAL, never swallowed
            outcome = classify(exc)
            if outcome is Outcome.MISSING:
                raise ShardNotFoundError(f"{what}: no such object", path=path,
                                         hint="check the URL; for a shard, all five files must be uploaded") from None
            if outcome is Outcome.CHANGED:
                raise ObjectChangedError(f"{what}: the object changed since the shard was opened",
                                         path=path) from None
            if outcome is Outcome.FATAL:
                raise RemoteStorageError(f"{what} failed: {_describe(exc)}", path=path) from None
            last = exc
            if on_retry is not None:
                on_retry(exc)
            if attempt + 1 < attempts:
                delay = min(backoff_delay(attempt, base, ceiling), max(0.0, deadline.remaining()))
                logger.info("%s %s: %s; retry %d/%d in %.2f s", what, path, _describe(exc), attempt + 1,
                            attempts - 1, delay)
                time.sleep(delay)
    if last is None or tried < attempts or _is_timeout(last):
        raise _timeout(what, path, tried, attempts, deadline, request_seconds, last)
    raise RemoteStorageError(f"{what} failed after {attempts} attempts; last error: {_describe(last)}",
                             path=path, field="retries", expected=f"success within {attempts} attempts",
                             hint="the store kept throttling, resetting or failing; check it and the "
                                  "network, or raise MEGATRON_SFT_IDX_RETRIES")


def _is_timeout(exc: BaseException) -> bool:
    """A timeout of ours or of the client's sockets (botocore's Read/ConnectTimeoutError)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TimeoutError) or type(exc).__name__ in ("ReadTimeoutError", "ConnectTimeoutError"):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _timeout(what: str, path: str, tried: int, attempts: int, deadline: Deadline,
             request_seconds: Optional[float], last: Optional[BaseException]) -> RemoteTimeoutError:
    """The error for an operation that ran out of time: its own budget, or every attempt's."""
    spent = tried < attempts or deadline.remaining() <= 0.05 * deadline.seconds
    field = "operation_timeout" if spent else "request_timeout"
    if spent:
        budget = f"the operation's budget of {deadline.seconds:.3g} s"
    else:
        budget = f"the request budget of {request_seconds:.3g} s" if request_seconds is not None else "time"
    per = f" of at most {request_seconds:.3g} s" if request_seconds is not None else ""
    then = "" if last is None or isinstance(last, AttemptTimeout) else f"; last error: {_describe(last)}"
    expected = (f"an answer within {request_seconds:.3g} s per request, {deadline.seconds:.3g} s per operation"
                if request_seconds is not None else None)
    return RemoteTimeoutError(f"{what}: no complete response within {budget} ({tried} attempt"
                              f"{'s' if tried != 1 else ''}{per} in {deadline.elapsed():.1f} s){then}", path=path,
                              field=field, expected=expected)


def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return "none"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
