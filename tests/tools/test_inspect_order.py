"""``inspect-idx DATA --order``: a balanced order's straggler report next to the shuffle's, for the
planned topology or another, refusing an order of other data."""

import json

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import CostModel, Topology, plan_order, shard_pack_costs
from megatron_sft_idx.batching.report import order_reports
from megatron_sft_idx.tools.inspect_cli import main


@pytest.fixture()
def data(tmp_path):
    prefix = str(tmp_path / "s")
    write_shard(prefix, random_packs(np.random.default_rng(2), 96, pack_size=64, max_seqs=6))
    model = CostModel(1.0, 1.0)
    order = plan_order(shard_pack_costs(MMapIndexedDataset(prefix), model), Topology(4, 1, 16), model, seed=5,
                       epochs=2)
    order.save(prefix + ".order")
    other = str(tmp_path / "other")
    write_shard(other, random_packs(np.random.default_rng(3), 96, pack_size=64, max_seqs=6))
    return prefix, order, other


def test_auto_reports_the_planned_topology_next_to_the_shuffle(data, capsys):
    prefix, order, _ = data
    assert main([prefix, "--order", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    expected = order_reports(order)
    assert view["balanced"] == expected["balanced"].summary and view["shuffle"] == expected["shuffle"].summary
    assert view["balanced"]["mean"] < view["shuffle"]["mean"]
    assert (view["packs"], view["epochs"], view["seed"]) == (96, 2, 5)
    assert main([prefix, "--order", "auto"]) == 0
    text = capsys.readouterr().out
    assert "DP 4, micro-batch 1, global batch 16" in text and " shuffle " in text and "balanced" in text


def test_another_topology_is_reported_with_a_note(data, capsys, tmp_path):
    prefix, order, _ = data
    plot = str(tmp_path / "o.png")
    assert main([prefix, "--order", prefix + ".order", "--dp", "2", "--global-batch-size", "8", "--json",
                 "--plot", plot]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["topology"] == Topology(2, 1, 8).to_dict() and view["planned_topology"] == order.topology.to_dict()
    assert "re-plan the order" in view["notes"][0]
    assert view["balanced"] == order_reports(order, topology=Topology(2, 1, 8))["balanced"].summary
    assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # --balance-for, the name of the setting in every command, reports the same
    assert main([prefix, "--order", prefix + ".order", "--balance-for", "2,1,8", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert (same["topology"], same["balanced"]) == (view["topology"], view["balanced"])
    assert main([prefix, "--order", "--balance-for", "2,1,8", "--dp", "2"]) == 2
    assert "the parts of --balance-for" in capsys.readouterr().err


def test_an_order_of_other_data_and_a_missing_one_are_refused(data, capsys):
    prefix, _, other = data
    assert main([other, "--order", prefix + ".order"]) == 1
    assert "planned for other data" in capsys.readouterr().err
    assert main([other, "--order"]) == 1
    assert "no balanced order beside the data" in capsys.readouterr().err


def test_topology_flags_need_order(data, capsys):
    assert main([data[0], "--dp", "2"]) == 2
    assert "goes with --order" in capsys.readouterr().err


def test_an_order_with_counts_shows_each_steps_denominator_and_refuses_other_masks(tmp_path, capsys):
    from megatron_sft_idx.batching.trained import trained_counts

    prefix = str(tmp_path / "c")
    packs = random_packs(np.random.default_rng(4), 40, pack_size=64, max_seqs=4)
    write_shard(prefix, packs)
    ds = MMapIndexedDataset(prefix)
    model = CostModel(1.0, 1.0)
    order = plan_order(shard_pack_costs(ds, model), Topology(2, 2, 8), model, seed=5, trained=trained_counts(ds))
    order.save(prefix + ".order")
    assert main([prefix, "--order", "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["denominators"]["rules"]["stored"]["steps"]
    assert steps == order.step_trained("stored").sum(axis=(1, 2)).tolist() and len(steps) == 5
    assert main([prefix, "--order"]) == 0
    assert f"step: global (rank min..max): 0: {steps[0]:,}" in capsys.readouterr().out
    ids, loss, starts = packs[3]
    packs[3] = (ids, np.zeros_like(loss), starts)   # the same index, other masks
    write_shard(str(tmp_path / "d"), packs)
    order.save(str(tmp_path / "d.order"))
    assert main([str(tmp_path / "d"), "--order"]) != 0
    assert "pack 3's trained tokens" in capsys.readouterr().err
