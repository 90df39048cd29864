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

from ..format import PUBLISH_ORDER
from ..publishing import StagedOrder
from .config import PackJob

__all__ = ["stage_orders", "BalanceStep"]


def stage_orders(job: PackJob, shards: Sequence, located: Sequence,
                 manifests: Sequence) -> Tuple[List[StagedOrder], Dict[str, str]]:
    """The orders of a run with ``--balance-for`` (none without it), one per split, and the
    splits that get none, each with why (fewer packs than one global batch: module doc).

    ``shards`` are the run's :class:`~.materialize.OutputShard`\\ s (finals), ``located`` the same
    with ``staged`` where each one's files are now; ``manifests`` the staged set's
    ``(manifest path, finals)``, empty when the run writes one shard.

    Raises:
        ShardError: the topology or cost model is refused (see
            :class:`~megatron_sft_idx.preprocess.config.BalanceSettings`).
    """
    balance = job.balance
    topology = balance.topology()
    if topology is None:
        return [], {}
    from ..batching.balance import plan_order
    from ..batching.cost import shard_pack_costs
    from ..batching.serve import order_path_for, order_record
    from ..batching.trained import TrainedCounts, trained_counts
    from ..reader import MMapIndexedDataset

    model = balance.model(job.settings.pad_multiple, job.settings.pad_layout)
    seed = job.pack.seed if balance.balance_seed is None else balance.balance_seed
    by_manifest = {finals: path for path, finals in manifests}
    out, none = [], {}
    for split in sorted({s.split for s in shards}):
        mine = [(s.final, where.staged) for s, where in zip(shards, located) if s.split == split]
        finals = tuple(final for final, _ in mine)
        data_path = by_manifest.get(finals, finals[0])
        parts = [MMapIndexedDataset(local) for _, local in mine]
        packs = sum(len(p) for p in parts)
        if packs < topology.global_batch_size:
            name = next(s.metadata["extra"]["split"] for s in shards if s.split == split)
            none[name] = (f"{packs:,} packs, fewer than one global batch of {topology.global_batch_size:,} "
                                  f"({topology.describe()}): no step to balance")
            continue
        costs = np.concatenate([shard_pack_costs(p, model) for p in parts])   # the set's global pack index
        counts = TrainedCounts.concat(trained_counts(p) for p in parts)       # every step's denominators
        source = {"path": os.path.basename(data_path), "shards": [os.path.basename(f) for f in finals],
                  "packs": [len(p) for p in parts]}
        order = plan_order(costs, topology, model, seed=seed, epochs=balance.balance_epochs,
                           exchange_window=balance.exchange_window, source=source, trained=counts,
                           balance_labels=balance.balance_labels)
        data, final = order.to_bytes(), order_path_for(data_path)
        manifest = data_path if data_path in by_manifest.values() else None
        out.append(StagedOrder(final, data, manifest, order_record(order, os.path.basename(final), len(data)), order))
    return out, none


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

    @property
    def writes_to(self) -> str:
        return os.path.dirname(self.located[0].staged)

    def reads(self, unit: int) -> List[str]:
        return [s.staged + x for s in self.located for x in PUBLISH_ORDER]

    def run(self, unit: int) -> dict:
        orders, none = stage_orders(self.job, self.shards, self.located, self.manifests)
        return {"unit": unit, "orders": orders, "not_written": none}
