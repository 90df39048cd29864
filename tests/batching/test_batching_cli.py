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


def test_one_spelling_per_setting_and_the_old_ones_as_aliases(shards, tmp_path, capsys):
    """--balance-for DP,MBS,GBS, --cost-model, --balance-seed, --balance-epochs and
    --pad-seq-to-mult (the spellings of preprocess-sft and repack-sft) plan the same order as
    their other names --dp/--micro-batch-size/--global-batch-size, --model or --linear/--attention,
    --seed, --epochs and --pad-multiple; a setting given both ways is a usage error."""
    a = str(shards / "a")
    one = ["--balance-for", "2,2,8", "--cost-model", "1,0.5", "--balance-seed", "9", "--balance-epochs", "2",
           "--pad-seq-to-mult", "4"]
    other = ["--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--linear", "1", "--attention",
             "0.5", "--seed", "9", "--epochs", "2", "--pad-multiple", "4"]
    for k, argv in enumerate((one, other)):
        assert main([a, *argv, "--out", str(tmp_path / f"{k}.order"), "--json"]) == 0
    assert (tmp_path / "0.order").read_bytes() == (tmp_path / "1.order").read_bytes()
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert report["topology"] == Topology(2, 2, 8).to_dict() and report["cost_model"]["pad_multiple"] == 4
    assert main([a, "--balance-for", "2,1,4", "--model", "qwen2.5-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"]["name"] == "qwen2.5-7b"
    for argv in (["--balance-for", "2,1,4", "--dp", "2"], [],
                 ["--balance-for", "2,1,4", "--cost-model", "llama3-70b", "--linear", "1", "--attention", "1"]):
        assert main([a, *argv]) == 2
    assert main([a, "--balance-for", "2,x,4"]) == 2
    assert "DP,MBS,GBS" in capsys.readouterr().err


def test_an_order_with_no_step_is_not_written(shards, tmp_path, capsys):
    """70 packs and a global batch of 128: the report says 0 steps; --out writes nothing, saying why."""
    out = tmp_path / "none.order"
    assert main([str(shards / "a"), "--balance-for", "2,1,128", "--out", str(out)]) == 2
    assert "70 packs, fewer than one global batch of 128" in capsys.readouterr().err and not out.exists()
    assert main([str(shards / "a"), "--balance-for", "2,1,128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["balanced"]["steps"] == 0


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
