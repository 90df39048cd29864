"""``--engine ray``: the same steps as Ray tasks, one task per unit, on any Ray cluster.

The driver submits one task per unit and keeps only the receipts the tasks return; the tasks
read the inputs and write the store, the plan and the staged shards themselves. A store or work
directory on disk must be on a filesystem every node sees at the same path; one in object
storage (``--store s3://...``; the work directory beside an ``s3://`` output) is mirrored by
each task on its own node and written back to the bucket by it (the driver wraps the steps:
:mod:`.mirrored`, this engine does not know). Units are idempotent (a receipt is the commit
point), so a task lost with its node is simply run again (``max_retries=1``).

Cluster: ``--ray-address`` or ``RAY_ADDRESS`` is joined, never replaced; without either, a
local one-node cluster bound to 127.0.0.1 is started for the run and shut down after it.
Ray is the optional ``[ray]`` extra and is imported only here. The driver does not print what
the cluster's processes print (``log_to_driver=False``): its stdout stays the command's own
(``--json``), whatever a node says as it dies; a task's errors come back as exceptions and its
counts in its receipt, and each node keeps its processes' logs in its Ray log directory.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

from ..._extras import MissingExtraError, require_extra
from ...errors import ShardError
from .base import OnDone, Step, run_unit

log = logging.getLogger("megatron_sft_idx.preprocess")


def _require_ray():
    require_extra("ray", "ray")
    import ray

    return ray


def _ray_unit(step: Step, unit: int):
    """Runs in a Ray worker: ``("done", receipt)`` or ``("error", ShardError)`` (never raises
    for a project error, so the driver gets the error itself rather than Ray's wrapper)."""
    try:
        return "done", run_unit(step, unit)
    except (ShardError, MissingExtraError) as exc:
        return "error", exc


class RayEngine:
    """Runs each unit of a step as a Ray task (1 CPU each); see the module docstring."""

    name = "ray"

    def __init__(self, address: Optional[str] = None, workers: Optional[int] = None) -> None:
        ray = self._ray = _require_ray()
        self._started = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            if address:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            else:
                ray.init(num_cpus=workers or None, include_dashboard=False, _node_ip_address="127.0.0.1",
                         logging_level=logging.WARNING, log_to_driver=False)
                self._started = True
        self._remote = ray.remote(num_cpus=1, max_retries=1)(_ray_unit)
        self._info = {"kind": self.name, "address": ray.get_runtime_context().gcs_address,
                      "started_here": self._started, "cpus": int(ray.cluster_resources().get("CPU", 0))}

    def describe(self) -> dict:
        """The cluster it ran on: its address, whether this run started it, its CPUs."""
        return dict(self._info)

    def map(self, step: Step, units: Sequence[int], on_done: OnDone, on_progress=None) -> None:
        """Units as Ray tasks; progress moves per finished unit (``on_progress`` is not used)."""
        ray = self._ray
        step_ref = ray.put(step)
        refs = {self._remote.remote(step_ref, unit): unit for unit in units}
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
                for ref in ready:
                    unit = refs.pop(ref)
                    kind, payload = self._get(ref, step, unit)
                    if kind == "error":
                        raise payload
                    on_done(payload)
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise

    def _get(self, ref, step: Step, unit: int):
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayError as exc:  # the worker died, the node was lost, ...
            raise ShardError(f"{step.name} unit {unit} failed on the Ray cluster: {exc.__class__.__name__}: {exc}",
                             hint="rerun with --resume to continue from the completed units") from None

    def on_every_node(self, fn, *args, timeout: float = 60.0) -> int:
        """``fn(*args)`` once on every alive node of the cluster (a zero-CPU task pinned to it);
        returns on how many it ran. Best effort: a node that fails or does not answer within
        ``timeout`` seconds is logged (cleaning up after a run never fails the run)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy   # (ray: the optional extra)

        ray = self._ray
        task = ray.remote(num_cpus=0, max_retries=0)(fn)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                .remote(*args) for node in ray.nodes() if node.get("Alive")]
        if not refs:
            return 0
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = 0
        for ref in ready:
            try:
                ray.get(ref)
                done += 1
            except ray.exceptions.RayError as exc:
                log.warning("a node's cleanup after the run failed: %s", exc)
        if late:
            log.warning("%d node(s) did not clean up within %.0f s", len(late), timeout)
        return done

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
            self._started = False
