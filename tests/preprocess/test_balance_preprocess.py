"""``--balance-for`` in preprocess-sft and repack-sft: the order beside the shards, end to end.

The order covers the output as a reader opens it (one shard, or a set's manifest order), is
recorded by the manifest, never changes a shard's bytes, is planned again (the same bytes) by a
resumed run, and is an output like the shards (refused without --overwrite, removed with it).
The adapters serving it are tested against the installed stacks in tests/compat/test_balanced_*.py.
"""

import json
import os
import zlib

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import CostModel, Order, Topology, shard_pack_costs
from megatron_sft_idx.batching.serve import checked_order, resolve_order
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.repack_cli import repack_main
from support.token_inputs import tokens_input


def pre(tmp_path, prefix, *extra, store=None):
    args = ["--input", tokens_input(tmp_path / "in.jsonl"), "--input-format", "tokens", "--vocab-size", "50",
            "--pad-id", "0", "--pack-size", "256", "--output-prefix", str(prefix), "--quiet", *extra]
    if store:
        args += ["--store", str(store)]
    return main(args)


def crcs(prefix):
    return {s: zlib.crc32(open(prefix + s, "rb").read()) for s in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")}


def test_one_flag_writes_the_order_beside_the_shard_and_leaves_its_bytes(tmp_path, capsys):
    plain, balanced = str(tmp_path / "plain"), str(tmp_path / "bal")
    assert pre(tmp_path, plain) == 0
    assert not os.path.exists(plain + ".order")
    assert pre(tmp_path, balanced, "--balance-for", "4,2,16", "--cost-model", "llama3.2-1b", "--balance-epochs", "2",
               "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["orders"] == [balanced + ".order"]
    assert crcs(plain) == crcs(balanced)   # the shard's bytes do not depend on the order
    order = Order.load(balanced + ".order")
    assert (order.topology, order.seed, order.epochs, order.cost_model.name) == (Topology(4, 2, 16), 1234, 2,
                                                                                 "llama3.2-1b")
    assert order.source == {"path": "bal", "shards": ["bal"], "packs": [len(MMapIndexedDataset(balanced))]}
    checked_order(resolve_order("auto", balanced), MMapIndexedDataset(balanced), seed=1234)
    assert order.stats["balanced"]["mean"] <= order.stats["shuffle"]["mean"]


def test_a_set_gets_one_order_over_its_manifest_and_the_manifest_records_it(tmp_path):
    store = tmp_path / "store"
    assert pre(tmp_path, tmp_path / "first", store=store) == 0
    out = str(tmp_path / "set")
    assert repack_main(["--store", str(store), "--output-prefix", out, "--pack-size", "256", "--pad-id", "0",
                        "--max-packs-per-shard", "20", "--balance-for", "2,1,8", "--balance-seed", "77",
                        "--cost-model", "2.5,0.25", "--quiet"]) == 0
    record = json.load(open(out + ".json"))["order"]
    data = open(out + ".order", "rb").read()
    assert (record["file"], record["size"], record["crc32"], record["seed"]) == ("set.order", len(data),
                                                                               zlib.crc32(data), 77)
    assert record["topology"] == Topology(2, 1, 8).to_dict()
    assert (record["cost_model"]["linear"], record["cost_model"]["attention"]) == (2.5, 0.25)
    order = resolve_order("auto", out + ".json")
    source = open_packed(out + ".json")
    assert len(source.prefixes) > 2 and order.num_packs == len(source)
    # the order's pack ids are the manifest's global index: its costs are the set's, concatenated
    np.testing.assert_allclose(order.costs, shard_pack_costs(source, CostModel(2.5, 0.25)))
    checked_order(order, source, seed=77)
    with pytest.raises(ShardError, match="another data seed"):
        checked_order(order, source, seed=1234)


def test_a_resumed_run_plans_the_same_order_again(tmp_path):
    prefix = str(tmp_path / "r")
    flags = ("--balance-for", "4,1,8")
    assert pre(tmp_path, prefix, *flags) == 0
    first = open(prefix + ".order", "rb").read()
    assert pre(tmp_path, prefix, *flags, "--resume") == 0      # finished: a no-op that checks the order too
    assert open(prefix + ".order", "rb").read() == first
    os.unlink(prefix + ".order")                                # a recorded output missing: the run is done again
    assert pre(tmp_path, prefix, *flags, "--resume", "--overwrite") == 0
    assert open(prefix + ".order", "rb").read() == first


def test_the_order_is_an_output_refused_and_replaced_like_the_shards(tmp_path, capsys):
    prefix = str(tmp_path / "o")
    open(prefix + ".order", "wb").write(b"an order of an earlier run")
    assert pre(tmp_path, prefix) == 1   # an existing output, without --overwrite (as for a shard)
    assert "o.order" in capsys.readouterr().err
    assert pre(tmp_path, prefix, "--overwrite") == 0
    assert not os.path.exists(prefix + ".order")   # no stale order beside shards it was not planned for


@pytest.mark.parametrize("flags, message", [
    (["--balance-for", "4,1,6"], "global_batch_size must be a multiple"),
    (["--balance-for", "4,1"], "DP,MBS,GBS"),
    (["--balance-seed", "3"], "give it"),
    (["--exchange-window", "2"], "give it"),
    (["--balance-for", "4,1,8", "--cost-model", "gpt5"], "preset or LINEAR,ATTENTION"),
])
def test_usage_errors_name_the_flag(tmp_path, capsys, flags, message):
    assert pre(tmp_path, tmp_path / "u", *flags) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "u") + ".idx")


def test_the_balance_flags_fill_the_same_settings_for_both_commands():
    import dataclasses

    from megatron_sft_idx.preprocess import BalanceSettings, Config, RepackConfig
    from megatron_sft_idx.preprocess.cli import _config, build_parser
    from megatron_sft_idx.preprocess.repack_cli import _repack_config, build_repack_parser

    pre_args = ["--input", "a.jsonl", "--output-prefix", "/o/ds", "--tokenizer", "tok"]
    re_args = ["--store", "/s", "--output-prefix", "/o/ds"]
    flags = ["--balance-for", "8,2,64", "--cost-model", "qwen2.5-7b", "--balance-epochs", "3", "--balance-seed", "9",
             "--exchange-window", "2", "--balance-labels"]
    pre = _config(build_parser().parse_args(pre_args + flags)).balance
    re = _repack_config(build_repack_parser().parse_args(re_args + flags)).balance
    assert pre == re == BalanceSettings(balance_for=(8, 2, 64), cost_model="qwen2.5-7b", balance_epochs=3,
                                        balance_seed=9, exchange_window=2, balance_labels=True)
    for f in dataclasses.fields(BalanceSettings):   # every field moved off its default by its flag
        if f.name != "step_size":   # (a mixture's alternative to --balance-for: below)
            assert getattr(pre, f.name) != getattr(BalanceSettings(), f.name), f.name
    step = ["--mix", "m.json", "--output-prefix", "/o/ds", "--step-size", "4"]
    assert _config(build_parser().parse_args(step + ["--tokenizer", "tok"])).balance == \
        _repack_config(build_repack_parser().parse_args(step)).balance == BalanceSettings(step_size=4)
    # the defaults are the flags' defaults, and flat keywords reach the group
    assert _config(build_parser().parse_args(pre_args)).balance == Config(["a"], "o").balance == BalanceSettings()
    assert RepackConfig("/s", "/o", balance_for=(2, 1, 4)).balance == BalanceSettings(balance_for=(2, 1, 4))


def test_a_split_smaller_than_a_global_batch_gets_no_order_and_the_summary_says_why(tmp_path, capsys):
    """issue 33, item 3: an order with no step is not written. The summary names the split and
    the sizes; the split's manifest records no order; "auto" on that split refuses, naming the
    file it looked for (both training doors serve an order through resolve_order, and only for
    their train split)."""
    prefix = str(tmp_path / "sp")
    flags = ("--split", "90,5,5", "--balance-for", "2,1,16", "--max-packs-per-shard", "40")
    assert pre(tmp_path, prefix, *flags, "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["orders"] == [prefix + "_train.order"]
    packs = {name: sp["packs"] for name, sp in summary["splits"].items()}
    assert packs["train"] >= 16 and packs["valid"] < 16 and packs["test"] < 16
    assert summary["orders_not_written"] == {
        name: f"{packs[name]} packs, fewer than one global batch of 16 ({Topology(2, 1, 16).describe()}): "
              "no step to balance" for name in ("valid", "test")}
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".order")) == ["sp_train.order"]
    assert "order" in json.load(open(prefix + "_train.json"))
    checked_order(resolve_order("auto", prefix + "_train.json"), open_packed(prefix + "_train.json"), seed=1234)
    for name in ("valid", "test"):
        data = prefix + f"_{name}" + (".json" if os.path.exists(prefix + f"_{name}.json") else "")
        if data.endswith(".json"):
            assert "order" not in json.load(open(data))
        with pytest.raises(ShardError, match="no balanced order beside the data") as e:
            resolve_order("auto", data)
        assert "smaller than one global batch" in e.value.hint
    # the table says it too, with the sizes
    from megatron_sft_idx.preprocess.summary import format_summary

    text = format_summary(summary)
    assert f"no order for valid  {packs['valid']} packs, fewer than one global batch of 16" in text
