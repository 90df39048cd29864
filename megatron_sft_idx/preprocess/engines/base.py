"""The contract between steps and engines: what a step is, how a unit runs, how it reports progress.

A *step* is a small frozen object with a ``name`` and ``run(unit) -> receipt``: it does the
work of one unit (an input file, a partition, an output shard), publishes the unit's artifacts
and writes its receipt, and knows nothing of who runs it. An *engine* runs the units of a step
(``map(step, units, on_done, on_progress=None)``), hands every receipt to the driver, which
keeps nothing else, and says what it is (``describe()``) and when it is done (``close()``).

Every engine runs a unit through :func:`run_unit`, so a unit fails the same way everywhere:
bad input as the step's ``ShardError``, a filesystem refusal as an ``OutputError`` naming the
path, anything else as a ``ShardError`` carrying the worker's traceback. A unit reports
progress within itself through :func:`report_progress`, to whichever engine runs it.
This module imports no engine.
"""

from __future__ import annotations

import traceback
from typing import Callable, Optional, Protocol, Sequence

from ..._extras import MissingExtraError
from ...errors import ShardError
from ..records.errors import output_error


class Step(Protocol):
    """A unit of work by number; optionally ``prepare()``, called once in the process that forks
    local workers (e.g. to load a tokenizer they then share)."""

    name: str
    writes_to: str   # where the step writes: named when the filesystem refuses a write

    def run(self, unit: int) -> dict: ...


OnDone = Callable[[dict], None]
OnProgress = Callable[[int, int], None]   # (unit, amount done since its last report)


class Engine(Protocol):
    """Runs the units of steps; the local pool and the Ray engine are the two."""

    name: str

    def map(self, step: Step, units: Sequence[int], on_done: OnDone,
            on_progress: Optional[OnProgress] = None) -> None: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


_report: Optional[Callable[[int], None]] = None   # set by the engine around each unit it runs


def report_progress(amount: int) -> None:
    """The running unit has done ``amount`` more of its work (in the units the driver sized it
    in); the driver's progress moves before the unit ends. A no-op where nobody listens."""
    if _report is not None:
        _report(amount)


def run_reporting(step: Step, unit: int, report: Optional[Callable[[int], None]]) -> dict:
    """:func:`run_unit`, with ``report`` receiving the unit's :func:`report_progress` calls."""
    global _report
    _report = report
    try:
        return run_unit(step, unit)
    finally:
        _report = None


def run_unit(step: Step, unit: int) -> dict:
    """``step.run(unit)`` with failures named the same way under every engine."""
    try:
        return step.run(unit)
    except (ShardError, MissingExtraError):
        raise
    except OSError as exc:
        raise output_error(exc, where=getattr(step, "writes_to", None)) from None
    except Exception as exc:
        raise ShardError(f"{step.name} unit {unit} failed: {exc.__class__.__name__}: {exc}",
                         hint="this is a bug; the worker's traceback follows:\n" + traceback.format_exc()) from None
