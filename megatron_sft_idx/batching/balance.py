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
from .report import straggler_report

__all__ = ["balanced_permutation", "plan_order", "DEFAULT_ALGORITHM"]

DEFAULT_ALGORITHM = "kk"
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
                         base: Optional[np.ndarray] = None) -> np.ndarray:
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

    Raises:
        ShardError: bad costs, an unknown algorithm, a window below 1, a base that is not a
            permutation of the packs.
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
    if algorithm == "shuffle" or n == 0:
        return base.copy()
    rounds = default_refine_rounds(topology, exchange_window) if refine_rounds is None else int(refine_rounds)
    out = np.empty(n, dtype=np.int64)
    _kernels.balance_epoch(base, costs, int(epoch) * n, topology.data_parallel_size, topology.micro_batch_size,
                           topology.global_batch_size, int(exchange_window), _CODES[algorithm], rounds, out)
    return out


def plan_order(costs, topology: Topology, cost_model: CostModel, *, seed: int, epochs: int = 1,
               first_epoch: int = 0, algorithm: str = DEFAULT_ALGORITHM, exchange_window: int = 1,
               refine_rounds: Optional[int] = None, source: Optional[dict] = None,
               base_order: Optional[Callable[[int], np.ndarray]] = None) -> Order:
    """An :class:`~.order.Order` of ``epochs`` balanced epochs from ``first_epoch`` on.

    ``base_order(epoch)``: the step membership to balance instead of the adapters' shuffle (a
    permutation of the packs: a mixture's interleaved order, :mod:`.interleave`).
    ``stats`` records, over the planned epochs, the predicted straggler overhead (max rank cost
    / mean - 1 per complete step) of the base order (``"shuffle"``) and of this order (see :mod:`.report`).

    Raises:
        ShardError: as :func:`balanced_permutation`; ``epochs`` below 1.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise ShardError("epochs must be an integer >= 1", field="epochs", actual=epochs)
    costs = _checked_costs(costs)
    n = costs.shape[0]
    rows, bases = [], []
    for e in range(int(first_epoch), int(first_epoch) + int(epochs)):
        base = base_permutation(n, seed, e) if base_order is None else base_order(e)
        rows.append(balanced_permutation(costs, topology, seed=seed, epoch=e, algorithm=algorithm,
                                         exchange_window=exchange_window, refine_rounds=refine_rounds, base=base))
        bases.append(base)
    perms = np.stack(rows)
    start = int(first_epoch) * n
    before = straggler_report(np.concatenate(bases), costs, topology, start=start).summary
    after = straggler_report(perms.reshape(-1), costs, topology, start=start).summary
    stats = {"shuffle": before, "balanced": after}
    return Order(permutations=perms, costs=costs, topology=topology, cost_model=cost_model, seed=int(seed),
                 first_epoch=int(first_epoch), algorithm=algorithm, exchange_window=int(exchange_window),
                 source=source, stats=stats)
