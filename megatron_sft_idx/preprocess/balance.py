"""``--balance-for``: the balanced pack order a run publishes beside its shards (docs/BATCHING.md).

For each split the run writes, one order over the split's packs as a reader of the output
sees them: a single shard's packs, or a set's packs in its manifest's order (the global pack
index ``open_packed(BASE.json)`` presents, which is what the adapters' ``"auto"`` order and
``plan-batches BASE.json`` permute). The order is planned from the staged shards' indexes
(sequence boundaries only, never tokens) after the checks and before the publish, and
published after the shards and before the manifests, which record it
(:func:`~megatron_sft_idx.batching.serve.order_record`); the file is ``P.order`` beside a
single shard ``P``, ``BASE.order`` beside a set's ``BASE.json``
(:func:`~megatron_sft_idx.batching.serve.order_path_for`).

The order records every planned step's trained-token denominators, counted from the staged
shards' loss masks (:mod:`megatron_sft_idx.batching.trained`; the stored mask's rule: what
Megatron-LM, Bridge ``main`` and TRL train), and with ``--balance-labels`` evens them out too.
The order is derived data: the shards' bytes never depend on it, and a resumed run plans it
again from the same packs and settings (the same bytes).

A mixture's order (``--mix``) starts each epoch from the interleaved order of its packs
(:func:`~megatron_sft_idx.batching.interleave.interleave`, from the plan's per-pack measures of
each source) instead of the adapters' shuffle, so every window of K steps holds the split's
shares; the balancing then only deals each step's packs to ranks. The run reports, per split,
the worst deviation over those windows for the interleaved order and for the shuffle
(:func:`~.mixreport.window_deviation`).

A split with fewer packs than one global batch gets no order: it would hold no step (the
samplers drop an incomplete step), and an order nobody can use is not written. The run's
summary names the split and the sizes (``orders_not_written``); its manifest records no order,
and a trainer asked for ``"auto"`` on it refuses, naming the file it looked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..batching.balance import plan_order
from ..batching.cost import shard_pack_costs
from ..batching.serve import order_path_for, order_record
from ..batching.trained import TrainedCounts, trained_counts
from ..format import PUBLISH_ORDER
from ..batching.interleave import interleave
from ..batching.layout import base_permutation
from ..publishing import StagedOrder
from ..reader import MMapIndexedDataset
from .config import PackJob
from .mixing import shares
from .mixreport import window_deviation
from .planfile import PackPlan

__all__ = ["stage_orders", "BalanceStep"]


def stage_orders(job: PackJob, shards: Sequence, located: Sequence, manifests: Sequence,
                 plan_path: str = "") -> Tuple[List[StagedOrder], Dict[str, str], Dict[str, dict]]:
    """The orders of a run with ``--balance-for`` (none without it), one per split, and the
    splits that get none, each with why (fewer packs than one global batch: module doc).

    ``shards`` are the run's :class:`~.materialize.OutputShard`\\ s (finals), ``located`` the same
    with ``staged`` where each one's files are now; ``manifests`` the staged set's
    ``(manifest path, finals)``, empty when the run writes one shard; ``plan_path`` a mixture's
    plan (its per-pack measures). Returns the orders, the splits without one, and (a mixture)
    each ordered split's window report.

    Raises:
        ShardError: the topology or cost model is refused (see
            :class:`~megatron_sft_idx.preprocess.config.BalanceSettings`).
    """
    balance = job.balance
    topology = balance.topology()
    if topology is None:
        return [], {}, {}

    model = balance.model(job.settings.pad_multiple, job.settings.pad_layout)
    seed = job.pack.seed if balance.balance_seed is None else balance.balance_seed
    by_manifest = {finals: path for path, finals in manifests}
    out, none, windows = [], {}, {}
    plan = PackPlan(plan_path, verify=False) if job.mixture is not None else None
    for split in sorted({s.split for s in shards}):
        mine = [(s.final, where.staged) for s, where in zip(shards, located) if s.split == split]
        finals = tuple(final for final, _ in mine)
        data_path = by_manifest.get(finals, finals[0])
        parts = [MMapIndexedDataset(local) for _, local in mine]
        packs = sum(len(p) for p in parts)
        if packs < topology.global_batch_size:
            none[name_of(shards, split)] = (f"{packs:,} packs, fewer than one global batch of "
                                            f"{topology.global_batch_size:,} ({topology.describe()}): no step to balance")
            continue
        costs = np.concatenate([shard_pack_costs(p, model) for p in parts])   # the set's global pack index
        counts = TrainedCounts.concat(trained_counts(p) for p in parts)       # every step's denominators
        source = {"path": os.path.basename(data_path), "shards": [os.path.basename(f) for f in finals],
                  "packs": [len(p) for p in parts]}
        base_order, mixed = None, None
        if plan is not None:   # a mixture: each epoch interleaved by its sources' shares
            mixed = _split_measures(plan, name_of(shards, split))
            base_order = lambda e, m=mixed: _interleaved(m, seed, e, job.mixture.window_steps,  # noqa: E731
                                                         topology.global_batch_size)
            source["interleave"] = {"unit": job.mixture.unit, "window_steps": job.mixture.window_steps}
        order = plan_order(costs, topology, model, seed=seed, epochs=balance.balance_epochs,
                           exchange_window=balance.exchange_window, source=source, base_order=base_order,
                           algorithm=balance.algorithm, trained=counts, balance_labels=balance.balance_labels)
        if mixed is not None:
            windows[name_of(shards, split)] = _windows(order, mixed, topology, job, seed)
        data, final = order.to_bytes(), order_path_for(data_path)
        manifest = data_path if data_path in by_manifest.values() else None
        out.append(StagedOrder(final, data, manifest, order_record(order, os.path.basename(final), len(data)), order))
    return out, none, windows


def name_of(shards: Sequence, split: int) -> str:
    """The name of split ``split`` (its shards record it)."""
    return next(s.metadata["extra"]["split"] for s in shards if s.split == split)


def _split_measures(plan: PackPlan, name: str) -> Tuple[np.ndarray, np.ndarray]:
    """``(measures [P, S], target [S])`` of a mixture's split: each pack's measure of each source
    and the split's shares in the unit (what a window should hold)."""
    i = plan.split_index(name)
    sources = plan.splits[i]["sources"]
    measures = np.asarray(plan.arrays(i)["pack_measures"], dtype=np.int64).reshape(-1, len(sources))
    return measures, shares(np.array([s["amount"] for s in sources], dtype=np.float64))


#: Packs below which an epoch's interleave is drawn :data:`_DRAWS` times and the draw with the
#: smallest worst window kept: with few packs a greedy walk's forced tail can cost more than the
#: draw is worth (with many it is reliably close to the target everywhere).
_FEW_PACKS, _DRAWS = 100_000, 8


def _interleaved(mixed: Tuple[np.ndarray, np.ndarray], seed: int, epoch: int, window_steps: int,
                 global_batch_size: int) -> np.ndarray:
    """Epoch ``epoch``'s interleaved order of a split's packs (module doc): the best of a few draws
    when the split has few packs, by the worst window of ``window_steps`` steps (ties: the first)."""
    measures, target = mixed
    draws = _DRAWS if measures.shape[0] < _FEW_PACKS else 1
    best, best_dev = None, None
    for j in range(draws):
        order = interleave(measures, target, seed=seed, epoch=epoch * _DRAWS + j)
        dev = window_deviation(order, measures, target, window_steps, global_batch_size)["max"] if draws > 1 else 0.0
        if best is None or dev < best_dev:
            best, best_dev = order, dev
    return best


def _windows(order, mixed: Tuple[np.ndarray, np.ndarray], topology, job: PackJob, seed: int) -> dict:
    """The worst share deviation over every window of K steps, interleaved (this order) and shuffled
    (the adapters' draw of the same epochs), over the planned epochs."""
    measures, target = mixed
    k, gbs = job.mixture.window_steps, topology.global_batch_size
    shuffled = np.concatenate([base_permutation(measures.shape[0], seed, e) for e in range(order.epochs)])
    return {"topology": topology.describe(), "epochs": order.epochs,
            "interleaved": window_deviation(order.permutations.reshape(-1), measures, target, k, gbs),
            "shuffle": window_deviation(shuffled, measures, target, k, gbs)}


@dataclass(frozen=True)
class BalanceStep:
    """Unit 0: :func:`stage_orders` where the unit runs (a work directory in object storage: the
    task pulls the staged shards, the driver gets the orders' bytes and records); returns
    ``{"unit": 0, "orders": [...], "not_written": {...}}``."""

    job: PackJob
    shards: tuple
    located: tuple
    manifests: tuple
    name: str = "balance"
    plan_path: str = ""    # a mixture's plan (its per-pack measures of each source)

    @property
    def writes_to(self) -> str:
        return os.path.dirname(self.located[0].staged)

    def reads(self, unit: int) -> List[str]:
        return [s.staged + x for s in self.located for x in PUBLISH_ORDER] + ([self.plan_path] if self.plan_path else [])

    def run(self, unit: int) -> dict:
        orders, none, windows = stage_orders(self.job, self.shards, self.located, self.manifests, self.plan_path)
        return {"unit": unit, "orders": orders, "not_written": none, "windows": windows}
