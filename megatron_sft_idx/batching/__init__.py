"""Planned batches: what steps cost, balanced pack orders for Megatron's samplers, dynamic batches.

Modules (imported on first use; only :mod:`.loaders` needs torch):

* :mod:`.cost` — ``CostModel`` (linear + attention FLOPs per sequence, from model dimensions
  or set directly; presets), ``pack_costs`` / ``shard_pack_costs``, ``microbatch_cost``;
* :mod:`.layout` — ``Topology``; how Megatron's sampler deals positions to ranks; the
  adapters' per-epoch shuffle;
* :mod:`.balance` — ``plan_order`` / ``balanced_permutation``: each step's packs re-dealt among
  its ranks and micro-batches, step membership unchanged;
* :mod:`.order` — ``Order`` and its strict file (``save`` / ``load``), with every step's
  trained-token denominators when planned with them;
* :mod:`.trained` — ``trained_counts``: every sequence's trained tokens under each consumer's
  rule, read from the loss masks; ``step_table``: their sums per step, micro-batch and rank;
* :mod:`.denominators` — what the adapters serve: each step's global count
  (``step_trained_tokens``), each pack checked against the order;
* :mod:`.audit` — ``audit_order``: each trainer's loss normalisation replayed on the steps;
* :mod:`.serve` — ``resolve_order`` (an order by path, or ``"auto"``: the one beside the
  data), ``checked_order`` (its seed and pack costs proven against the data and the run) and
  ``served_order`` (both, as the adapters take an order);
* :mod:`.samples` — ``sample_index``: the sample order every training adapter serves (a
  balanced order's positions, or epochs of the seeded shuffle, a block-local order, or in order);
* :mod:`.dynamic` — ``plan_dynamic``: NeMo-RL's token-budget micro-batches, from lengths;
* (``StoreSequences`` and ``sequence_lengths``, a sequence store's verified sequences and their
  lengths -- no tokens read -- live with the store: :mod:`megatron_sft_idx.preprocess.sequences`);
* :mod:`.report` — per-step predicted cost per rank, straggler overhead, plot;
* :mod:`.loaders` — ``OrderedDataset``, ``DynamicBatchSampler``, ``SequenceDataset``,
  ``DynamicCollator`` (torch).

``docs/BATCHING.md`` is the user's guide.
"""

from .._lazy import lazy_getattr

_PUBLIC = {
    "CostModel": ".cost",
    "ModelShape": ".cost",
    "PRESETS": ".cost",
    "pack_costs": ".cost",
    "shard_pack_costs": ".cost",
    "microbatch_cost": ".cost",
    "Topology": ".layout",
    "base_permutation": ".layout",
    "balanced_permutation": ".balance",
    "plan_order": ".balance",
    "Order": ".order",
    "TrainedCounts": ".trained",
    "trained_counts": ".trained",
    "step_table": ".trained",
    "audit_order": ".audit",
    "AUDIT_RULES": ".audit",
    "TopologyMismatchWarning": ".order",
    "resolve_order": ".serve",
    "checked_order": ".serve",
    "served_order": ".serve",
    "sample_index": ".samples",
    "DynamicBatchPlan": ".dynamic",
    "plan_dynamic": ".dynamic",
    "StragglerReport": ".report",
    "straggler_report": ".report",
    "order_reports": ".report",
    "format_report": ".report",
    "plot_report": ".report",
    "OrderedDataset": ".loaders",
    "SequenceDataset": ".loaders",
    "DynamicBatchSampler": ".loaders",
    "DynamicCollator": ".loaders",
}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC, globals())


def __dir__():
    return sorted(__all__)
