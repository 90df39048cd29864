"""Retries with exponential backoff and jitter, ending in an error that names the object.

Each store classifies its client's exceptions into one of four outcomes; this
module only runs the loop, so the policy (which failures are worth another try,
how long to wait) is stated once for every client.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from typing import Callable, Optional, TypeVar

from ..errors import ObjectChangedError, RemoteStorageError, ShardError, ShardNotFoundError

T = TypeVar("T")
logger = logging.getLogger("megatron_sft_idx.storage")


class Outcome(enum.Enum):
    RETRY = "retry"        # throttling, 5xx, reset, timeout, short body: try again after a pause
    MISSING = "missing"    # 404 / no such key: never retried
    CHANGED = "changed"    # precondition failed: the object was replaced since open
    FATAL = "fatal"        # access denied, bad request, bad range: retrying cannot help


class ShortReadError(IOError):
    """The server sent fewer (or more) bytes than the range asked for: retried, never used."""


def backoff_delay(attempt: int, base: float, ceiling: float) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(ceiling, base * 2**attempt)]."""
    return random.uniform(0, min(ceiling, base * (2 ** attempt)))


def with_retries(op: Callable[[], T], *, what: str, path: str, classify: Callable[[BaseException], Outcome],
                 attempts: int, base: float, ceiling: float,
                 on_retry: Optional[Callable[[BaseException], None]] = None) -> T:
    """Run ``op`` until it succeeds, retrying transient failures ``attempts`` times in total.

    Raises:
        ShardNotFoundError: the object does not exist.
        ObjectChangedError: the object changed since it was opened (a precondition failed).
        RemoteStorageError: a permanent failure, or transient ones outlasting every attempt.
    """
    last: Optional[BaseException] = None
    for attempt in range(attempts):
        try:
            return op()
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
                delay = backoff_delay(attempt, base, ceiling)
                logger.info("%s %s: %s; retry %d/%d in %.2f s", what, path, _describe(exc), attempt + 1,
                            attempts - 1, delay)
                time.sleep(delay)
    raise RemoteStorageError(f"{what} failed after {attempts} attempts; last error: {_describe(last)}",
                             path=path, field="retries", expected=f"success within {attempts} attempts",
                             hint="the store kept throttling, resetting or failing; check it and the "
                                  "network, or raise MEGATRON_SFT_IDX_RETRIES")


def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return "none"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
