"""The straggler report: per-step rank costs by hand, the overhead's distribution, the table and the plot."""

import numpy as np
import pytest

from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel
from megatron_sft_idx.batching.layout import Topology
from megatron_sft_idx.batching.report import (format_report, order_reports, plot_report, step_costs,
                                              straggler_report, summarize_overhead)


def test_step_costs_by_hand():
    # DP 2, micro-batch 1, global batch 4: positions 0,2 -> rank 0 and 1,3 -> rank 1 in each step
    topo = Topology(2, 1, 4)
    costs = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    stream = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2])
    assert step_costs(stream, costs, topo).tolist() == [[5.0, 10.0], [16.0 + 1.0, 32.0 + 2.0]]
    # starting at global position 2, only the step [4, 8) lies wholly inside: stream[2:6], packs 2..5
    assert step_costs(stream, costs, topo, start=2).tolist() == [[4.0 + 16.0, 8.0 + 32.0]]


def test_overhead_is_max_over_mean_minus_one():
    topo = Topology(2, 1, 4)
    report = straggler_report(np.array([0, 1, 2, 3, 0, 0, 0, 0]), np.array([1.0, 2.0, 4.0, 8.0]), topo)
    # step 0: ranks 5 and 10 -> 10 / 7.5 - 1; step 1: ranks 2 and 2 -> 0
    assert report.overhead.tolist() == pytest.approx([1 / 3, 0.0])
    assert report.summary["steps"] == 2 and report.summary["max"] == pytest.approx(1 / 3)
    assert report.summary["steps_over_10pct"] == 1 and report.summary["share_over_10pct"] == 0.5
    assert report.first_step == 0


def test_zero_cost_steps_have_no_overhead():
    report = straggler_report(np.zeros(4, dtype=np.int64), np.zeros(1), Topology(2, 1, 4))
    assert report.overhead.tolist() == [0.0]


def test_summary_quantiles():
    s = summarize_overhead(np.linspace(0, 0.2, 101))
    assert s["p50"] == pytest.approx(0.1) and s["p99"] == pytest.approx(0.198) and s["mean"] == pytest.approx(0.1)
    assert s["steps_over_10pct"] == 50
    assert summarize_overhead(np.empty(0)) == {"steps": 0}


def test_table_and_few_packs_warning():
    costs = np.random.default_rng(0).uniform(1, 10, 64)
    order = plan_order(costs, Topology(8, 1, 16), CostModel(1.0, 0.0), seed=0)
    text = format_report(order_reports(order))
    assert "shuffle" in text and "balanced" in text and "steps > 10 %" in text
    assert "2 pack(s) per rank per step (< 4)" in text and "exchange_window" in text
    wide = plan_order(costs, Topology(2, 1, 16), CostModel(1.0, 0.0), seed=0)
    assert "note:" not in format_report(order_reports(wide))


def test_order_reports_match_the_order_stats():
    costs = np.random.default_rng(1).uniform(1, 10, 200)
    order = plan_order(costs, Topology(4, 1, 8), CostModel(1.0, 0.0), seed=2, epochs=2)
    reports = order_reports(order)
    assert reports["shuffle"].summary == order.stats["shuffle"]
    assert reports["balanced"].summary == order.stats["balanced"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    costs = np.random.default_rng(2).uniform(1, 10, 400)
    order = plan_order(costs, Topology(4, 1, 8), CostModel(1.0, 0.0), seed=2)
    path = plot_report(order_reports(order), str(tmp_path / "r.png"))
    data = (tmp_path / "r.png").read_bytes()
    assert path.endswith("r.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
