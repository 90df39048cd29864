"""Engines: what runs the units of a step (datatrove's executor layout).

* :mod:`.base` — the contract: the :class:`Step` protocol, :func:`run_unit`,
  :func:`report_progress`; it imports no engine;
* :mod:`.local` — :class:`LocalEngine`, this process or a pool of forked workers (``--workers N``);
* :mod:`.ray` — :class:`RayEngine`, Ray tasks on a cluster (``--engine ray``), the same steps.

:func:`make_engine` is the one place that chooses between them. Steps never import an engine,
engines never import a step, and the same steps give byte-identical output under either.
"""

from __future__ import annotations

from typing import Optional

from ...errors import ShardError
from .base import Engine, OnDone, OnProgress, Step, report_progress, run_unit
from .local import LocalEngine
from .ray import RayEngine

ENGINES = ("local", "ray")


def make_engine(kind: str, workers: int, ray_address: Optional[str] = None) -> Engine:
    """The engine for ``--engine kind``.

    Raises:
        ShardError: an unknown kind; MissingExtraError: ``ray`` without Ray installed (names the
            extra to install).
    """
    if kind == "local":
        return LocalEngine(workers)
    if kind == "ray":
        return RayEngine(address=ray_address, workers=workers)
    raise ShardError(f"unknown engine {kind!r}", field="engine", expected=list(ENGINES), actual=kind)


__all__ = ["Engine", "Step", "OnDone", "OnProgress", "run_unit", "report_progress", "LocalEngine", "RayEngine",
           "ENGINES", "make_engine"]
