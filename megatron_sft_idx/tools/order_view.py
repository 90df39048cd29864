"""``inspect-idx DATA --order [FILE|auto]``: the straggler report of a balanced order, next to the
shuffled order the adapters would serve without it (:mod:`megatron_sft_idx.batching.report`).

The order is first proven to be this data's (every pack's cost recomputed from the shards'
indexes with the order's cost model, :meth:`~megatron_sft_idx.batching.Order.check_costs`); the
report is for the topology it was planned for, or the one ``--dp`` / ``--micro-batch-size`` /
``--global-batch-size`` give (the others taken from the order), with a note when they differ.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from ..batching.cost import shard_pack_costs
from ..batching.layout import Topology
from ..batching.report import format_report, order_reports, plot_report
from ..batching.serve import resolve_order
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
    if plot:
        out["plot"] = plot_report(reports, plot)
    out["reports"] = reports
    return out


def format_order_view(view: dict) -> str:
    """The text report: one header line, the table (:func:`~megatron_sft_idx.batching.report.format_report`)."""
    topology = Topology.from_dict(view["topology"])
    lines: List[str] = [f"{view['packs']:,} packs, {view['epochs']} epoch(s), seed {view['seed']}, "
                        f"{topology.describe()}, cost model {view['cost_model']['name']}; predicted straggler "
                        "overhead per step (max rank cost / mean - 1):",
                        format_report(view["reports"], view["notes"])]
    if view.get("plot"):
        lines.append(f"plot written to {view['plot']}")
    return "\n".join(lines)
