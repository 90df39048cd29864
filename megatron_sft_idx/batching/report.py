"""The predicted cost of every step on every rank, and how long ranks wait for the slowest.

For a sample stream (pack ids at consecutive global positions) laid out by Megatron's sampler
(:mod:`.layout`), each complete step's cost per data-parallel rank is the sum of its packs'
costs. The **straggler overhead** of a step is ``max rank cost / mean rank cost - 1``: the
extra time of the step over a perfectly balanced one, if time is proportional to cost (it is
a model, not a measurement). Its distribution over steps (mean, p50, p90, p99, max) and the
share of steps over 10 % summarise an order; :func:`plot_report` draws it (matplotlib, the
``tools`` extra).

Below :data:`FEW_PACKS_PER_RANK` packs per rank per step, re-dealing a step's packs cannot
even them out (a rank holding one pack with a 32k-token sequence is the step): the report
says so, and points at ``exchange_window`` (bench/balance.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from .._extras import require_extra
from ..errors import ShardError
from . import _kernels
from .layout import Topology, base_permutation

__all__ = ["StragglerReport", "step_costs", "straggler_report", "summarize_overhead", "format_report", "order_reports",
           "plot_report", "FEW_PACKS_PER_RANK", "trained_summary", "format_trained"]

#: Packs per rank per step below which balancing alone leaves much of the overhead (bench/balance.py).
FEW_PACKS_PER_RANK = 4
_QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99))


def step_costs(stream, costs, topology: Topology, start: int = 0) -> np.ndarray:
    """``float64[steps, dp]``: cost per rank of every step wholly inside the stream.

    ``stream[t]`` is the pack served at global position ``start + t``.
    """
    stream = np.ascontiguousarray(stream, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    gbs = topology.global_batch_size
    first = -(-int(start) // gbs)
    last = (int(start) + stream.shape[0]) // gbs
    out = np.zeros((max(0, last - first), topology.data_parallel_size), dtype=np.float64)
    if out.shape[0]:
        _kernels.step_rank_costs(stream, costs, int(start), topology.data_parallel_size, topology.micro_batch_size,
                                 gbs, out)
    return out


def summarize_overhead(overhead: np.ndarray) -> Dict[str, float]:
    """Mean, quantiles, max and the share over 10 % of per-step overheads (fractions, not %)."""
    if overhead.size == 0:
        return {"steps": 0}
    out = {"steps": int(overhead.size), "mean": float(overhead.mean())}
    for name, q in _QUANTILES:
        out[name] = float(np.percentile(overhead, q))
    out["max"] = float(overhead.max())
    out["steps_over_10pct"] = int(np.count_nonzero(overhead > 0.10))
    out["share_over_10pct"] = float(out["steps_over_10pct"] / overhead.size)
    return out


@dataclass
class StragglerReport:
    """Per-step predicted costs (``costs[step, rank]``), overheads and their summary."""

    topology: Topology
    first_step: int
    costs: np.ndarray
    overhead: np.ndarray
    summary: Dict[str, float]

    @property
    def packs_per_rank(self) -> int:
        return self.topology.per_rank

    def warnings(self) -> List[str]:
        """Sentences about what balancing cannot fix here (empty when nothing)."""
        out = []
        if self.topology.data_parallel_size > 1 and self.packs_per_rank < FEW_PACKS_PER_RANK:
            out.append(f"{self.packs_per_rank} pack(s) per rank per step (< {FEW_PACKS_PER_RANK}): re-dealing a "
                       "step's packs among ranks cannot even out packs of very different cost; consider "
                       "exchange_window > 1 (moves packs between neighbouring steps: changes step membership) "
                       "or a larger global batch")
        return out


def straggler_report(stream, costs, topology: Topology, start: int = 0) -> StragglerReport:
    """The report of a stream of pack ids starting at global position ``start`` (complete steps)."""
    per_rank = step_costs(stream, costs, topology, start)
    mean = per_rank.mean(axis=1) if per_rank.size else np.empty(0)
    peak = per_rank.max(axis=1) if per_rank.size else np.empty(0)
    overhead = np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0) - 1.0
    summary = summarize_overhead(overhead)
    summary["packs_per_rank"] = topology.per_rank
    return StragglerReport(topology=topology, first_step=-(-int(start) // topology.global_batch_size),
                           costs=per_rank, overhead=overhead, summary=summary)


def format_report(reports: Dict[str, StragglerReport], notes: Optional[List[str]] = None) -> str:
    """A text table, one row per named report (e.g. ``{"shuffle": r0, "balanced": r1}``), then
    ``notes`` (default: the first report's :meth:`~StragglerReport.warnings`)."""
    head = ["order", "steps", "mean %", "p50 %", "p90 %", "p99 %", "max %", "steps > 10 %"]
    rows = []
    for name, r in reports.items():
        s = r.summary
        if not s.get("steps"):
            rows.append([name, "0"] + ["-"] * (len(head) - 2))
            continue
        rows.append([name, f"{s['steps']:,}"] + [f"{100 * s[k]:.2f}" for k in ("mean", "p50", "p90", "p99", "max")]
                    + [f"{s['steps_over_10pct']:,} ({100 * s['share_over_10pct']:.1f} %)"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows]]
    if notes is None:
        first = next(iter(reports.values()), None)
        notes = first.warnings() if first is not None else []
    return "\n".join(lines + [f"note: {n}" for n in notes])


def plot_report(reports: Dict[str, StragglerReport], path: str, title: Optional[str] = None,
                max_steps: int = 2000) -> str:
    """Draw each report's per-step overhead (left, the first ``max_steps`` steps) and its
    cumulative distribution (right) into a PNG at ``path``; returns ``path``.

    Raises:
        MissingExtraError: matplotlib is not installed (the ``tools`` extra).
    """
    require_extra("tools", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, r in reports.items():
        shown = r.overhead[:max_steps] * 100
        left.plot(np.arange(shown.size) + r.first_step, shown, lw=0.7, label=name)
        x = np.sort(r.overhead) * 100
        right.plot(x, np.arange(1, x.size + 1) / max(1, x.size), label=name)
    left.set_xlabel("step")
    left.set_ylabel("straggler overhead (%)")
    right.set_xlabel("straggler overhead (%)")
    right.set_ylabel("share of steps at or below")
    right.axvline(10, color="grey", lw=0.6, ls="--")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = next(iter(reports.values()), None)
    fig.suptitle(title or (f"predicted straggler overhead, {first.topology.describe()}" if first else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def order_reports(order, epochs: Optional[Sequence[int]] = None,
                  topology: Optional[Topology] = None) -> Dict[str, StragglerReport]:
    """``{"shuffle": ..., "balanced": ...}`` reports of an :class:`~.order.Order`'s epochs, sliced
    for ``topology`` (default: the one it was planned for; another shows what a run with that
    topology would see of it)."""
    topology = order.topology if topology is None else topology

    n = order.num_packs
    chosen = list(range(order.first_epoch, order.first_epoch + order.epochs)) if epochs is None else list(epochs)
    for a, b in zip(chosen, chosen[1:]):
        if b != a + 1:
            raise ShardError("epochs must be consecutive", field="epochs", actual=chosen)
    start = chosen[0] * n if chosen else 0
    base = np.concatenate([base_permutation(n, order.seed, e) for e in chosen]) if chosen else np.empty(0, np.int64)
    ours = np.concatenate([order.permutation(e) for e in chosen]) if chosen else np.empty(0, np.int64)
    return {"shuffle": straggler_report(base, order.costs, topology, start),
            "balanced": straggler_report(ours, order.costs, topology, start)}


def _spread(values: np.ndarray) -> np.ndarray:
    """Per row: ``(max - min) / mean`` (0 for a row of zeros)."""
    mean = values.mean(axis=1)
    return np.divide(values.max(axis=1) - values.min(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)


def trained_summary(table: np.ndarray) -> Dict[str, float]:
    """How even the trained tokens of a step table (``[steps, micro-batches, dp]``,
    :func:`~.trained.step_table`) are: per step, its total (``step_mean``, and ``step_cv``, the
    coefficient of variation over steps); the spread ``(max - min) / mean`` over ranks of each
    step (``rank_spread_mean``, ``_p99``, ``_max``) and over its micro-batches of every rank
    (``microbatch_spread_mean``, ``_max``). Fractions, not %."""
    table = np.asarray(table, dtype=np.float64)
    if table.shape[0] == 0:
        return {"steps": 0}
    totals = table.sum(axis=(1, 2))
    ranks = _spread(table.sum(axis=1))
    micro = _spread(table.reshape(table.shape[0], -1))
    mean = float(totals.mean())
    return {"steps": int(table.shape[0]), "step_mean": mean, "step_min": float(totals.min()),
            "step_max": float(totals.max()), "step_cv": float(totals.std() / mean) if mean else 0.0,
            "rank_spread_mean": float(ranks.mean()), "rank_spread_p99": float(np.percentile(ranks, 99)),
            "rank_spread_max": float(ranks.max()), "microbatch_spread_mean": float(micro.mean()),
            "microbatch_spread_max": float(micro.max())}


def format_trained(summaries: Dict[str, Dict[str, float]]) -> str:
    """A text table of :func:`trained_summary` results, one row per named order."""
    head = ["order", "tokens/step", "step CV %", "rank spread mean %", "p99 %", "max %", "micro-batch spread mean %"]
    rows = []
    for name, s in summaries.items():
        if not s.get("steps"):
            rows.append([name] + ["-"] * (len(head) - 1))
            continue
        rows.append([name, f"{s['step_mean']:,.0f}", f"{100 * s['step_cv']:.2f}"]
                    + [f"{100 * s[k]:.2f}" for k in ("rank_spread_mean", "rank_spread_p99", "rank_spread_max",
                                                     "microbatch_spread_mean")])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows])
