"""plan-batches: shards in, the report and an order file out; exit codes for bad input."""

import json

import numpy as np
import pytest
from support.shardgen import random_packs, write_shard

from megatron_sft_idx.batching import CostModel, Order, Topology, plan_order, shard_pack_costs
from megatron_sft_idx.tools.plan_batches_cli import main
from megatron_sft_idx.multi import MultiShardDataset


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(0)
    for name, n in (("a", 70), ("b", 50)):
        write_shard(str(root / name), random_packs(rng, n, pack_size=64))
    return root


def test_plans_the_order_of_several_shards(shards, tmp_path, capsys):
    out = tmp_path / "x.order"
    rc = main([str(shards / "a"), str(shards / "b"), "--dp", "4", "--global-batch-size", "16", "--epochs", "2",
               "--linear", "1", "--attention", "0.5", "--seed", "9", "--out", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packs"] == 120 and report["epochs"] == 2 and report["topology"]["data_parallel_size"] == 4
    assert report["balanced"]["mean"] < report["shuffle"]["mean"]
    order = Order.load(out)
    model = CostModel(1.0, 0.5)
    source = MultiShardDataset.open([str(shards / "a"), str(shards / "b")])
    expected = plan_order(shard_pack_costs(source, model), Topology(4, 1, 16), model, seed=9, epochs=2)
    np.testing.assert_array_equal(order.permutations, expected.permutations)
    assert order.source == {"shards": [str(shards / "a"), str(shards / "b")], "packs": [70, 50]}


def test_text_report_and_plot(shards, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    assert main([str(shards / "*"), "--dp", "8", "--global-batch-size", "16", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "120 packs, DP 8, micro-batch 1, global batch 16, cost model llama3-8b" in text
    assert "balanced" in text and "2 pack(s) per rank per step" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, code, message", [
    (["{missing}", "--dp", "2", "--global-batch-size", "4"], 2, "error:"),
    (["{a}", "--dp", "2", "--global-batch-size", "5"], 2, "global_batch_size must be a multiple"),
    (["{a}", "--dp", "2", "--global-batch-size", "4", "--exchange-window", "0"], 2, "exchange_window"),
])
def test_usage_errors_exit_2(shards, tmp_path, capsys, argv, code, message):
    argv = [a.format(missing=str(tmp_path / "none"), a=str(shards / "a")) for a in argv]
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_linear_without_attention_is_a_usage_error(shards, capsys):
    assert main([str(shards / "a"), "--dp", "2", "--global-batch-size", "4", "--linear", "1"]) == 2
    assert "plan-batches: error: --linear and --attention go together" in capsys.readouterr().err


def test_a_corrupt_shard_exits_1(shards, tmp_path, capsys):
    import shutil

    for suffix in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"):
        shutil.copyfile(str(shards / "a") + suffix, str(tmp_path / "c") + suffix)
    with open(str(tmp_path / "c") + ".seq.bin", "r+b") as f:
        f.truncate(8)
    assert main([str(tmp_path / "c"), "--dp", "2", "--global-batch-size", "4"]) == 1
    assert str(tmp_path / "c") in capsys.readouterr().err
