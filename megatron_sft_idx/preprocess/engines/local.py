"""The local engine: a step's units in this process, or in a pool of forked worker processes.

``--workers 1`` (or a single unit) runs the units here, one after another; ``--workers N``
forks N workers that take units from a queue and send back receipts and progress. Workers
ignore Ctrl-C (the driver handles it), die with the driver (even on SIGKILL) and are killed by
it when it stops for any reason, so an interrupted run never leaves one behind.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
from typing import Optional, Sequence

from ..._extras import MissingExtraError
from ..._signals import Terminated, signals_deferred, worker_signals
from ...errors import ShardError
from .base import OnDone, OnProgress, Step, run_reporting


class LocalEngine:
    """Units in this process, or in ``workers`` forked processes (see the module docstring)."""

    name = "local"

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))

    def map(self, step: Step, units: Sequence[int], on_done: OnDone, on_progress: Optional[OnProgress] = None) -> None:
        units = list(units)
        if self.workers == 1 or len(units) <= 1:
            for unit in units:
                report = None if on_progress is None else (lambda amount, unit=unit: on_progress(unit, amount))
                on_done(run_reporting(step, unit, report))
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
            results.put(("done", unit, run_reporting(step, unit,
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
                # Workers inherit this process's objects frozen (here unfrozen at once): a worker's
                # first full collection would otherwise walk, and copy on write, the whole loaded
                # heap (transformers, the tokenizer): ~0.1 CPU-s a worker in a cold run.
                gc.freeze()
                try:
                    for p in self.procs:
                        p.start()
                finally:
                    gc.unfreeze()
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
