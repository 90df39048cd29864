"""Steps, and the engines that run their units.

A *step* is a small frozen object with a ``name`` and ``run(unit) -> receipt``: it does the
work of one unit (an input file, a partition, an output shard), publishes the unit's artifacts
and writes its receipt, and knows nothing of who runs it. An *engine* runs the units of a step
(``map``) and hands every receipt to the driver, which keeps nothing else (and, where the
engine can, the units' :func:`report_progress` calls, so progress moves within a long unit):

* :class:`LocalEngine` — in this process (one worker, or one unit), or a pool of forked
  worker processes (``--workers N``);
* :class:`~megatron_sft_idx.preprocess.ray_engine.RayEngine` — Ray tasks on a cluster
  (``--engine ray``), the same steps.

Every engine runs a unit through :func:`run_unit`, so a unit fails the same way everywhere:
bad input as the step's ``ShardError``, a filesystem refusal as an ``OutputError`` naming the
path, anything else as a ``ShardError`` carrying the worker's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import traceback
from typing import Callable, Optional, Protocol, Sequence

from .._extras import MissingExtraError
from ..errors import ShardError
from .errors import output_error
from .._signals import Terminated, signals_deferred, worker_signals


class Step(Protocol):
    """A unit of work by number; optionally ``prepare()``, called once in the process that forks
    local workers (e.g. to load a tokenizer they then share)."""

    name: str
    writes_to: str   # where the step writes: named when the filesystem refuses a write

    def run(self, unit: int) -> dict: ...


OnDone = Callable[[dict], None]
OnProgress = Callable[[int, int], None]   # (unit, amount done since its last report)

_report: Optional[Callable[[int], None]] = None   # set by the engine around each unit it runs


def report_progress(amount: int) -> None:
    """The running unit has done ``amount`` more of its work (in the units the driver sized it
    in); the driver's progress moves before the unit ends. A no-op where nobody listens."""
    if _report is not None:
        _report(amount)


def _run_reporting(step: Step, unit: int, report: Optional[Callable[[int], None]]) -> dict:
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


class LocalEngine:
    """Units in this process, or in ``workers`` forked processes.

    Workers ignore Ctrl-C (the driver handles it), die with the driver (even on SIGKILL) and are
    killed by it when it stops for any reason, so an interrupted run never leaves one behind.
    """

    name = "local"

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))

    def map(self, step: Step, units: Sequence[int], on_done: OnDone, on_progress: Optional[OnProgress] = None) -> None:
        units = list(units)
        if self.workers == 1 or len(units) <= 1:
            for unit in units:
                report = None if on_progress is None else (lambda amount, unit=unit: on_progress(unit, amount))
                on_done(_run_reporting(step, unit, report))
            return
        prepare = getattr(step, "prepare", None)
        if prepare is not None:
            prepare()
        _Pool(step, units, min(self.workers, len(units))).run(on_done, on_progress)

    def describe(self) -> dict:
        return {"kind": self.name, "workers": self.workers}

    def close(self) -> None:
        pass


def _worker_main(step, parent_pid, tasks, results) -> None:
    worker_signals(parent_pid)
    while True:
        unit = tasks.get()
        if unit is None:
            return
        try:
            results.put(("done", unit, _run_reporting(step, unit,
                                                      lambda amount, unit=unit: results.put(("progress", unit, amount)))))
        except BaseException as exc:  # report, never hang the driver
            if not isinstance(exc, (ShardError, MissingExtraError)):
                exc = ShardError(f"{step.name} unit {unit} failed: {exc.__class__.__name__}: {exc}")
            results.put(("error", unit, exc))
            return


class _Pool:
    def __init__(self, step: Step, units: list, workers: int) -> None:
        ctx = mp.get_context("fork")
        self.units = units
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        for unit in units:
            self.tasks.put(unit)
        for _ in range(workers):
            self.tasks.put(None)
        self.procs = [ctx.Process(target=_worker_main, args=(step, os.getpid(), self.tasks, self.results),
                                  daemon=True, name=f"{step.name}-{w}") for w in range(workers)]
        self.step = step

    def run(self, on_done: OnDone, on_progress: Optional[OnProgress] = None) -> None:
        pending = set(self.units)
        try:
            with signals_deferred():  # a signal during fork would land in the fork hooks
                for p in self.procs:
                    p.start()
            while pending:
                item = self._next(pending)
                if item is None:
                    continue
                kind, unit, payload = item
                if kind == "error":
                    raise payload
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(unit, payload)
                    continue
                pending.discard(unit)
                on_done(payload)
        finally:
            self._stop()

    def _next(self, pending: set):
        """The next result, or None after a quiet interval in which every worker is still fine.

        Raises:
            Terminated: a worker was ended by SIGTERM/SIGINT (the process group was signalled).
            ShardError: a worker died (killed, out of memory) or all exited with units undone.
        """
        try:
            return self.results.get(timeout=0.5)
        except queue.Empty:
            pass
        for p in self.procs:
            if p.exitcode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):
                raise Terminated(-p.exitcode)
            if p.exitcode not in (None, 0):
                raise ShardError(f"{self.step.name} worker {p.name} died with exit code {p.exitcode} "
                                 f"(killed, or out of memory)", hint="rerun with --resume to continue")
        if all(p.exitcode is not None for p in self.procs):
            try:  # the last results may still be in flight
                return self.results.get(timeout=1.0)
            except queue.Empty:
                raise ShardError(f"{self.step.name} workers exited with {len(pending)} units undone") from None
        return None

    def _stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()  # never block exit on a feeder thread with nobody reading
            q.close()


def make_engine(kind: str, workers: int, ray_address=None):
    """The engine for ``--engine kind``.

    Raises:
        ShardError: ``ray`` without Ray installed (names the extra to install).
    """
    if kind == "local":
        return LocalEngine(workers)
    if kind == "ray":
        from .ray_engine import RayEngine

        return RayEngine(address=ray_address, workers=workers)
    raise ShardError(f"unknown engine {kind!r}", field="engine", expected=["local", "ray"], actual=kind)
