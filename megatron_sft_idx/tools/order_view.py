"""``inspect-idx DATA --order [FILE|auto]``: the straggler report of a balanced order, next to the
shuffled order the adapters would serve without it (:mod:`megatron_sft_idx.batching.report`).

The order is first proven to be this data's (every pack's cost recomputed from the shards'
indexes with the order's cost model, :meth:`~megatron_sft_idx.batching.Order.check_costs`; and
every sequence's trained tokens recounted from the shards' loss masks when the order records
them, :meth:`~megatron_sft_idx.batching.Order.check_trained`); the report is for the topology it
was planned for, or the one ``--dp`` / ``--micro-batch-size`` / ``--global-batch-size`` give
(the others taken from the order), with a note when they differ. An order that records counts
also shows its denominators: each step's global trained tokens (what a token-mean loss divides
by; ``denominators.steps`` in ``--json``, every step) and their spread over ranks.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from ..batching.cost import shard_pack_costs
from ..batching.layout import Topology
from ..batching.report import format_report, order_reports, plot_report, trained_summary
from ..batching.serve import resolve_order
from ..batching.trained import step_table, trained_counts
from ..multi import MultiShardDataset

__all__ = ["order_view", "format_order_view"]


def order_view(shards: Sequence[str], spec: str, *, dp: Optional[int] = None, micro_batch_size: Optional[int] = None,
               global_batch_size: Optional[int] = None, plot: Optional[str] = None) -> dict:
    """The report as a JSON-able dict (``reports`` holds the :class:`StragglerReport`\\ s too).

    Raises:
        ShardError: the data does not open; no order (``"auto"`` needs one local shard prefix or
            manifest); an order of other packs; an inconsistent topology.
    """
    data_path = shards[0] if len(shards) == 1 else None
    order = resolve_order(spec, data_path)
    source = MultiShardDataset.open(list(shards) if len(shards) > 1 else shards[0])
    order.check_costs(shard_pack_costs(source, order.cost_model), path=data_path)
    if order.trained is not None:
        order.check_trained(trained_counts(source, eos_id=order.trained.eos_id), path=data_path)
    planned = order.topology
    topology = Topology(dp or planned.data_parallel_size, micro_batch_size or planned.micro_batch_size,
                        global_batch_size or planned.global_batch_size)
    reports = order_reports(order, topology=topology)
    notes = [] if order.exchange_window > 1 else reports["balanced"].warnings()
    mismatch = order.topology_mismatch(topology)
    if mismatch:
        notes.insert(0, mismatch)
    out = {"packs": order.num_packs, "epochs": order.epochs, "seed": order.seed, "topology": topology.to_dict(),
           "planned_topology": planned.to_dict(), "cost_model": order.cost_model.to_dict(),
           "exchange_window": order.exchange_window, "notes": notes,
           **{name: r.summary for name, r in reports.items()}}
    if order.trained is not None:
        out["denominators"] = _denominators(order, topology)
    if plot:
        out["plot"] = plot_report(reports, plot)
    out["reports"] = reports
    return out


def _denominators(order, topology) -> dict:
    """Per rule: every complete step's global trained tokens, per-rank extremes, the summary."""

    out = {"first_step": -(-order.first_epoch * order.num_packs // topology.global_batch_size), "rules": {}}
    for rule in order.trained.rules:
        table = step_table(order.permutations.reshape(-1), order.trained.pack(rule), topology,
                           order.first_epoch * order.num_packs)
        ranks = table.sum(axis=1)
        out["rules"][rule] = {"steps": table.sum(axis=(1, 2)).tolist(), "rank_min": ranks.min(axis=1).tolist(),
                              "rank_max": ranks.max(axis=1).tolist(), "summary": trained_summary(table)}
    return out


def format_order_view(view: dict) -> str:
    """The text report: one header line, the table (:func:`~megatron_sft_idx.batching.report.format_report`)."""
    topology = Topology.from_dict(view["topology"])
    lines: List[str] = [f"{view['packs']:,} packs, {view['epochs']} epoch(s), seed {view['seed']}, "
                        f"{topology.describe()}, cost model {view['cost_model']['name']}; predicted straggler "
                        "overhead per step (max rank cost / mean - 1):",
                        format_report(view["reports"], view["notes"])]
    for rule, d in view.get("denominators", {}).get("rules", {}).items():
        first, steps, s = view["denominators"]["first_step"], d["steps"], d["summary"]
        shown = ", ".join(f"{first + k}: {n:,} ({lo:,}..{hi:,})" for k, (n, lo, hi)
                          in enumerate(zip(steps[:6], d["rank_min"], d["rank_max"])))
        lines.append(f"trained tokens per step ({rule!r} rule; a token-mean loss divides by them), step: global "
                     f"(rank min..max): {shown}{', ...' if len(steps) > 6 else ''}; over {len(steps):,} steps "
                     f"{int(s.get('step_min', 0)):,}..{int(s.get('step_max', 0)):,}, CV "
                     f"{100 * s.get('step_cv', 0):.2f} %, rank spread mean {100 * s.get('rank_spread_mean', 0):.2f} %")
    if view.get("plot"):
        lines.append(f"plot written to {view['plot']}")
    return "\n".join(lines)
