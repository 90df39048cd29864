"""Balanced steps without changing what the model learns: per-epoch pack orders for Megatron's sampler.

For each epoch the packs are first shuffled exactly as the adapters shuffle them today
(:func:`~.layout.base_permutation`), so *step membership* — which packs make up each global
batch — is the ordinary seeded shuffle. Then, inside each step, the step's packs are re-dealt
among the step's positions:

1. to data-parallel ranks, each rank keeping its count (``micro_batch_size * num_microbatches``),
   minimising the costliest rank: Karmarkar-Karp's largest differencing method with equal
   counts (``"kk"``, the default) or longest-processing-time first (``"lpt"``), then a pass of
   pairwise swaps between the costliest rank and the others while one lowers it;
2. inside a rank, to its micro-batches by LPT, the costliest micro-batch first (so micro-batch
   ``m`` costs about the same on every rank: collectives that run per micro-batch across DP
   ranks, such as MoE's expert all-to-all, wait less too), the costliest pack first in each.

The positions are Megatron's sampler layout (:mod:`.layout`), so serving the order as the
dataset's index order (``dataloader_type="single"``) hands every rank its planned packs with
no run-time communication. A step that straddles two epochs is balanced part by part (each
part inside its own epoch), so every epoch stays a permutation of the packs.

Optional, off by default, and **changing step membership**: ``exchange_window=w`` treats ``w``
consecutive steps as one group whose packs are re-dealt over all ``w * dp`` (step, rank) bins,
so a pack can move to a neighbouring step of the same window (within one epoch). It helps
where a step has too few packs per rank to balance (the report says where).

**Label-balanced steps** (``trained=`` the data's :class:`~.trained.TrainedCounts`,
``balance_labels=True``): after the cost dealing, packs are swapped between the bins of a
group so that every bin holds the same share of *trained tokens*, each bin's cost kept inside
a band of ``label_slack`` around the group's mean (:mod:`._label_kernels`); with micro-batches
of several packs, the same inside each rank. So every rank (and micro-batch) of a step trains
about as many tokens as the others -- what a per-rank or per-micro-batch loss normalisation
needs to be the token mean -- and, with ``exchange_window > 1``, every step about as many as
its neighbours. Each epoch stays a permutation of the packs.

Example::

    model = CostModel.from_preset("llama3-8b")
    order = plan_order(shard_pack_costs(ds, model), Topology(8, 1, 128), model, seed=1234, epochs=3)
    order.save("/data/train.order")
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..errors import ShardError
from . import _kernels
from .cost import CostModel
from .layout import Topology, base_permutation
from .order import ALGORITHMS, Order
from .report import straggler_report, trained_summary
from .trained import STORED, TrainedCounts

__all__ = ["balanced_permutation", "plan_order", "DEFAULT_ALGORITHM", "DEFAULT_LABEL_SLACK"]

DEFAULT_ALGORITHM = "kk"
#: How far (a fraction of the mean) label balancing may move a bin's cost: bench/balance.py.
DEFAULT_LABEL_SLACK = 0.002
_CODES = {"lpt": 0, "kk": 1}


def _checked_costs(costs) -> np.ndarray:
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ShardError("pack costs must be one-dimensional", field="costs", actual=costs.shape)
    if costs.size and not (np.all(np.isfinite(costs)) and costs.min() >= 0):
        bad = int(np.flatnonzero(~np.isfinite(costs) | (costs < 0))[0])
        raise ShardError(f"pack {bad} has cost {costs[bad]!r}; costs must be finite and >= 0", field="costs",
                         pack=bad)
    return costs


def default_refine_rounds(topology: Topology, exchange_window: int = 1) -> int:
    """Swap rounds allowed per group: 4 per bin (each round lowers the costliest bin, or stops)."""
    return 4 * topology.data_parallel_size * exchange_window


def balanced_permutation(costs, topology: Topology, *, seed: int, epoch: int, algorithm: str = DEFAULT_ALGORITHM,
                         exchange_window: int = 1, refine_rounds: Optional[int] = None,
                         base: Optional[np.ndarray] = None, labels=None,
                         label_slack: float = DEFAULT_LABEL_SLACK) -> np.ndarray:
    """Epoch ``epoch``'s balanced order of ``len(costs)`` packs (int64), see the module doc.

    Args:
        costs: cost of every pack (float64, finite, >= 0), indexed by pack id.
        topology: the training topology the order is laid out for.
        seed, epoch: the adapters' shuffle of this epoch gives the step membership.
        algorithm: ``"kk"``, ``"lpt"`` or ``"shuffle"`` (no balancing: the base order itself).
        exchange_window: steps per group (1: membership unchanged; more moves packs between
            neighbouring steps).
        refine_rounds: swap rounds per group (default :func:`default_refine_rounds`; 0: none).
        base: the membership order to balance instead of the adapters' shuffle (a permutation).
        labels: trained tokens of every pack (None: balance costs only); see the module doc.
        label_slack: the cost band label balancing keeps each bin in (a fraction of the mean, >= 0).

    Raises:
        ShardError: bad costs or labels, an unknown algorithm, a window below 1, a base that is
            not a permutation of the packs, labels with ``"shuffle"``, a negative slack.
    """
    costs = _checked_costs(costs)
    n = costs.shape[0]
    if algorithm not in ALGORITHMS:
        raise ShardError(f"unknown balancing algorithm {algorithm!r}", field="algorithm",
                         expected=list(ALGORITHMS), actual=algorithm)
    if isinstance(exchange_window, bool) or not isinstance(exchange_window, (int, np.integer)) or exchange_window < 1:
        raise ShardError("exchange_window must be an integer >= 1", field="exchange_window", actual=exchange_window)
    if base is None:
        base = base_permutation(n, seed, epoch)
    else:
        base = np.ascontiguousarray(base, dtype=np.int64)
        if base.shape != (n,) or not _kernels.is_permutation(base):
            raise ShardError("base must be a permutation of the pack ids", field="base", actual=base.shape)
    label_values = _checked_labels(labels, n, algorithm, label_slack)
    if algorithm == "shuffle" or n == 0:
        return base.copy()
    rounds = default_refine_rounds(topology, exchange_window) if refine_rounds is None else int(refine_rounds)
    out = np.empty(n, dtype=np.int64)
    _kernels.balance_epoch(base, costs, label_values, float(label_slack), int(epoch) * n,
                           topology.data_parallel_size, topology.micro_batch_size, topology.global_batch_size,
                           int(exchange_window), _CODES[algorithm], rounds, out)
    return out


def _checked_labels(labels, n: int, algorithm: str, slack) -> np.ndarray:
    """Labels as float64 (empty: none), checked."""
    if labels is None:
        return np.empty(0, dtype=np.float64)
    values = np.ascontiguousarray(labels, dtype=np.float64)
    if values.shape != (n,) or (n and not (np.all(np.isfinite(values)) and values.min() >= 0)):
        raise ShardError("labels must hold one finite count >= 0 per pack", field="labels", expected=n,
                         actual=values.shape)
    if algorithm == "shuffle":
        raise ShardError("label balancing deals packs: it needs a balancing algorithm, not \"shuffle\"",
                         field="algorithm", actual=algorithm)
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not slack >= 0:
        raise ShardError("label_slack must be a number >= 0", field="label_slack", actual=slack)
    return values


def plan_order(costs, topology: Topology, cost_model: CostModel, *, seed: int, epochs: int = 1,
               first_epoch: int = 0, algorithm: str = DEFAULT_ALGORITHM, exchange_window: int = 1,
               refine_rounds: Optional[int] = None, source: Optional[dict] = None,
               base_order: Optional[Callable[[int], np.ndarray]] = None, trained: Optional[TrainedCounts] = None,
               balance_labels: bool = False, label_rule: str = STORED,
               label_slack: float = DEFAULT_LABEL_SLACK) -> Order:
    """An :class:`~.order.Order` of ``epochs`` balanced epochs from ``first_epoch`` on.

    ``base_order(epoch)``: the step membership to balance instead of the adapters' shuffle (a
    permutation of the packs: a mixture's interleaved order, :mod:`.interleave`).
    ``trained`` (the data's counts, :func:`~.trained.trained_counts`) is recorded with the order:
    every planned step's denominators (:meth:`~.order.Order.step_trained`); ``balance_labels``
    evens trained tokens under ``label_rule`` too (module doc). ``stats`` records, over the
    planned epochs, the predicted straggler overhead (max rank cost / mean - 1 per complete step)
    of the base order (``"shuffle"``) and of this order (see :mod:`.report`), and with ``trained``
    how even each one's trained tokens are (:func:`~.report.trained_summary`).

    Raises:
        ShardError: as :func:`balanced_permutation`; ``epochs`` below 1; counts of another
            number of packs; ``balance_labels`` without counts (or of a rule not counted).
    """
    if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise ShardError("epochs must be an integer >= 1", field="epochs", actual=epochs)
    costs = _checked_costs(costs)
    n = costs.shape[0]
    if trained is not None and trained.num_packs != n:
        raise ShardError("the trained-token counts are of another number of packs than the costs", field="trained",
                         expected=n, actual=trained.num_packs)
    if balance_labels and trained is None:
        raise ShardError("label balancing needs the data's trained-token counts", field="trained",
                         hint="pass trained=trained_counts(source)")
    labels = trained.pack(label_rule) if balance_labels else None
    rows, bases = [], []
    for e in range(int(first_epoch), int(first_epoch) + int(epochs)):
        base = base_permutation(n, seed, e) if base_order is None else base_order(e)
        rows.append(balanced_permutation(costs, topology, seed=seed, epoch=e, algorithm=algorithm,
                                         exchange_window=exchange_window, refine_rounds=refine_rounds, base=base,
                                         labels=labels, label_slack=label_slack))
        bases.append(base)
    perms = np.stack(rows)
    start = int(first_epoch) * n
    before = straggler_report(np.concatenate(bases), costs, topology, start=start).summary
    after = straggler_report(perms.reshape(-1), costs, topology, start=start).summary
    stats = {"shuffle": before, "balanced": after}
    order = Order(permutations=perms, costs=costs, topology=topology, cost_model=cost_model, seed=int(seed),
                  first_epoch=int(first_epoch), algorithm=algorithm, exchange_window=int(exchange_window),
                  source=source, stats=stats, trained=trained,
                  label_balance={"rule": label_rule, "slack": float(label_slack)} if balance_labels else None)
    if trained is not None:
        rule = label_rule if balance_labels else trained.rules[0]
        shuffled = Order(permutations=np.stack(bases), costs=costs, topology=topology, cost_model=cost_model,
                         seed=int(seed), first_epoch=int(first_epoch), trained=trained)
        stats["trained"] = {"rule": rule, "shuffle": trained_summary(shuffled.step_trained(rule)),
                            "balanced": trained_summary(order.step_trained(rule))}
    return order
