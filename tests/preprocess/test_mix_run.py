"""``preprocess-sft --mix`` and ``repack-sft --mix`` end to end, on the bundled examples: the shards
hold each source at its share per split (read back from the shards' own source ids and loss
masks), repacking gives the same bytes without tokenizing, adding a source tokenizes only that
source, and bad input is one error with nothing published."""

import json
import os
import shutil

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.gate import check
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.repack_cli import repack_main

from support.stages import CHAT, TOKENIZER, files_of


def write_mix(path, sources, **top):
    path.write_text(json.dumps(dict({"version": 1, "window_steps": 2, "sources": sources}, **top)))
    return str(path)


def run_cli(fn, argv, capsys):
    code = fn(argv + ["--json", "-q"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


PACK = ["--pack-size", "1024", "--split", "85,15", "--balance-for", "1,1,2"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A mixture of the two example files (by trained tokens, 1:3), tokenized by preprocess-sft --mix."""
    d = tmp_path_factory.mktemp("mixrun")
    mix = write_mix(d / "mix.json", [{"name": "chat", "inputs": [CHAT[0]], "store": "stores/chat", "weight": 1},
                                     {"name": "share", "inputs": [CHAT[1]], "store": "stores/share", "weight": 3}])
    code = main(["--mix", mix, "--tokenizer", TOKENIZER, "--output-prefix", str(d / "out" / "ds"), "--check",
                 "--summary-json", str(d / "summary.json"), "-q"] + PACK)
    assert code == 0
    return d, mix, json.loads((d / "summary.json").read_text())


def shard_counts(prefix):
    """Per source: sequences and trained tokens, read from the shard set itself."""
    ds = open_packed(prefix + ".json") if os.path.exists(prefix + ".json") else MMapIndexedDataset(prefix)
    names = ds.sources
    seqs, trained = np.zeros(len(names), np.int64), np.zeros(len(names), np.int64)
    for i in range(len(ds)):
        pack, ids = ds[i], ds.source_ids(i)
        bounds = pack.seq_boundaries
        for k, src in enumerate(ids):
            seqs[src] += 1
            trained[src] += int(pack.loss_mask[bounds[k]:bounds[k + 1]].sum())
    return names, seqs, trained


def test_the_shards_hold_each_source_at_its_share_per_split(first):
    d, _, summary = first
    report = summary["mixture"]
    assert report["unit"] == "trained_tokens" and [s["name"] for s in report["stores"]] == ["chat", "share"]
    for split in ("train", "valid"):
        names, seqs, trained = shard_counts(str(d / "out" / f"ds_{split}"))
        rows = report["splits"][split]["sources"]
        assert list(names) == ["chat", "share"]
        assert seqs.tolist() == [r["sequences"] for r in rows]
        assert trained.tolist() == [r["trained_tokens"] for r in rows]
        share = trained / trained.sum()
        # within one sequence of each source: the largest a sequence of the split trains
        assert abs(share[0] - 0.25) < 600 / trained.sum(), share
        assert rows[0]["target_share"] == 0.25 and rows[1]["epochs"] == pytest.approx(1.0)
        dp = [r["data_path"] for r in rows]
        assert all(0 < x["trained_share"] < 1 for x in dp) and sum(x["samples"] for x in dp) == pytest.approx(
            report["splits"][split]["packs"])
    windows = report["splits"]["train"]["windows"]
    assert windows["interleaved"]["max"] <= windows["shuffle"]["max"]
    assert summary["check"]["shards"] == 2 and os.path.exists(d / "out" / "ds_train.order")


def test_the_mixture_is_the_same_wherever_its_files_lie(first, tmp_path):
    """The same files under another directory give the same packs and order: a mixture's draws are
    seeded by its stores' content, not by the paths their inputs were found at (which the store id
    records). Only the shards' metadata (which names the store) may differ."""
    d, _, _ = first
    where = tmp_path / "elsewhere" / "a" / "much" / "longer" / "path"
    where.mkdir(parents=True)
    copies = [str(shutil.copy(path, where / os.path.basename(path))) for path in CHAT[:2]]
    mix = write_mix(where / "mix.json", [{"name": "chat", "inputs": [copies[0]], "store": "stores/chat", "weight": 1},
                                         {"name": "share", "inputs": [copies[1]], "store": "stores/share", "weight": 3}])
    assert main(["--mix", mix, "--tokenizer", TOKENIZER, "--output-prefix", str(where / "out" / "ds"), "-q"] + PACK) == 0
    for split in ("train", "valid"):
        for suffix in (".bin", ".loss.bin", ".idx", ".seq.bin", ".order"):
            name = f"ds_{split}{suffix}"
            assert (where / "out" / name).read_bytes() == (d / "out" / name).read_bytes(), name


def test_repack_gives_the_same_bytes_without_tokenizing(first, tmp_path, capsys):
    d, mix, _ = first
    code, s, err = run_cli(repack_main, ["--mix", mix, "--output-prefix", str(tmp_path / "ds")] + PACK, capsys)
    assert code == 0, err
    assert files_of(str(tmp_path)) == files_of(str(d / "out"))
    assert "tokenize" not in s["seconds"] and s["mixture"] == json.loads((d / "summary.json").read_text())["mixture"]


def test_adding_a_source_tokenizes_only_that_source(first, tmp_path, capsys):
    d, _, _ = first
    stores = tmp_path / "stores"
    shutil.copytree(d / "stores", stores)
    before = {n: os.path.getmtime(stores / n / "receipts" / "tokenize" / "000000.json") for n in ("chat", "share")}
    mix = write_mix(tmp_path / "mix.json", [
        {"name": "chat", "inputs": [CHAT[0]], "store": "stores/chat", "weight": 1},
        {"name": "share", "inputs": [CHAT[1]], "store": "stores/share", "weight": 3},
        {"name": "both", "inputs": CHAT, "store": "stores/both", "weight": 1, "max_epochs": 2}])
    code, s, err = run_cli(main, ["--mix", mix, "--tokenizer", TOKENIZER, "--output-prefix",
                                  str(tmp_path / "out" / "ds")] + PACK, capsys)
    assert code == 0, err
    partitions = {n: len(os.listdir(stores / n / "receipts" / "tokenize")) for n in ("chat", "share", "both")}
    assert s["resumed_units"]["tokenize"] == partitions["chat"] + partitions["share"]
    assert {n: os.path.getmtime(stores / n / "receipts" / "tokenize" / "000000.json") for n in before} == before
    assert [r["name"] for r in s["mixture"]["splits"]["train"]["sources"]] == ["chat", "share", "both"]
    names, seqs, _ = shard_counts(str(tmp_path / "out" / "ds_train"))
    assert names == ("chat", "share", "both") and (seqs > 0).all()


def test_resume_of_a_finished_mixture_is_a_no_op_until_a_store_changes(first, tmp_path, capsys):
    d, _, _ = first
    shutil.copytree(d / "stores", tmp_path / "stores")
    mix = write_mix(tmp_path / "mix.json", [{"name": "chat", "store": "stores/chat", "weight": 1},
                                            {"name": "share", "store": "stores/share", "weight": 3}])
    argv = ["--mix", mix, "--output-prefix", str(tmp_path / "out" / "ds")] + PACK
    assert run_cli(repack_main, argv, capsys)[0] == 0
    code, s, _ = run_cli(repack_main, argv + ["--resume"], capsys)
    assert code == 0 and s["resumed_units"] == {"done": 1}


BAD = {
    "infeasible": ([{"name": "chat", "store": "stores/chat", "weight": 1},
                    {"name": "share", "store": "stores/share", "weight": 3, "max_epochs": 1}], {"total": 10 ** 9},
                   "largest total the caps allow"),
    "missing store": ([{"name": "chat", "store": "stores/none", "weight": 1}], {}, "source 'chat'"),
    "not a mixture": ("[1, 2]", {}, "must be a JSON object"),
    "weight nan": ('{"version": 1, "sources": [{"name": "a", "store": "s", "weight": NaN}]}', {}, "not valid"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_error_and_nothing_is_published(first, tmp_path, capsys, name):
    d, _, _ = first
    shutil.copytree(d / "stores", tmp_path / "stores")
    sources, top, words = BAD[name]
    path = tmp_path / "mix.json"
    if isinstance(sources, str):
        path.write_text(sources)
        mix = str(path)
    else:
        mix = write_mix(path, sources, **top)
    code, _, err = run_cli(repack_main, ["--mix", mix, "--output-prefix", str(tmp_path / "out" / "ds")] + PACK,
                           capsys)
    assert code == 1 and words in err and err.count("error:") == 1, err
    assert not os.path.exists(tmp_path / "out") or not [n for n in os.listdir(tmp_path / "out")
                                                       if not n.startswith(".")]


def test_stores_of_another_template_or_loss_policy_are_refused(first, tmp_path, capsys):
    d, _, _ = first
    mix = write_mix(tmp_path / "mix.json", [
        {"name": "chat", "store": str(d / "stores" / "chat"), "weight": 1},
        {"name": "masked", "inputs": [CHAT[1]], "store": "masked", "weight": 1}])
    code, _, err = run_cli(main, ["--mix", mix, "--tokenizer", TOKENIZER, "--tool-call-loss", "mask",
                                  "--output-prefix", str(tmp_path / "out" / "ds")] + PACK, capsys)
    assert code == 1 and "sources 'chat' and 'masked' cannot be mixed" in err and "loss_policy" in err
    assert not [n for n in os.listdir(tmp_path / "out") if not n.startswith(".")]


def test_plan_only_reports_the_mixture_in_seconds(first, tmp_path, capsys):
    d, mix, summary = first
    code, s, err = run_cli(repack_main, ["--mix", mix, "--plan-only", str(tmp_path / "m.plan"), "--pack-size", "1024",
                                         "--split", "85,15"], capsys)
    assert code == 0, err
    assert {k: v for k, v in s["mixture"].items() if k != "splits"} == \
        {k: v for k, v in summary["mixture"].items() if k != "splits"}
    for split, rep in s["mixture"]["splits"].items():
        assert rep["sources"] == [{k: v for k, v in r.items()} for r in summary["mixture"]["splits"][split]["sources"]]
    assert repack_main(["--mix", mix, "--plan-only", str(tmp_path / "n.plan"), "--pack-size", "1024",
                        "--split", "85,15"]) == 0
    text = capsys.readouterr().out
    assert "mixture by trained tokens" in text and "data_path share" in text


def test_usage_errors(first, tmp_path, capsys):
    _, mix, _ = first
    assert main(["--mix", mix, "--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", "x"]) == 2
    assert "give it without --input" in capsys.readouterr().err
    assert main(["--mix", mix, "--tokenizer", TOKENIZER, "--output-prefix", "x", "--verify-masks", "3"]) == 2
    assert "--verify-masks" in capsys.readouterr().err
    assert repack_main(["--output-prefix", "x"]) == 2
    assert "--store is required (or --mix FILE" in capsys.readouterr().err
    assert repack_main(["--store", "s", "--output-prefix", "x", "--mix-plot", "p.png"]) == 2


def test_the_gate_refuses_a_shard_whose_source_ids_were_damaged(first, tmp_path):
    d, _, _ = first
    shutil.copytree(d / "out", tmp_path / "out")
    prefix = str(tmp_path / "out" / "ds_train")
    ds = MMapIndexedDataset(prefix)
    at = ds.seq_header.sources_offset
    del ds
    raw = bytearray(open(prefix + ".seq.idx", "rb").read())
    raw[at] = 9
    open(prefix + ".seq.idx", "wb").write(raw)
    report = check([prefix])
    assert not report.passed and "SEQ_IDX_BODY_CRC" in {f.code for f in report.shards[0].findings}


def test_virtual_packs_of_a_mixture_plan_equal_the_shards(first, tmp_path, capsys):
    from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset

    d, mix, _ = first
    assert repack_main(["--mix", mix, "--plan-only", str(tmp_path / "m.plan"), "--pack-size", "1024", "--split",
                        "85,15", "-q"]) == 0
    stores = [str(d / "stores" / "chat"), str(d / "stores" / "share")]
    ds = VirtualPackedDataset(stores, str(tmp_path / "m.plan"), split="train")
    shard = open_packed(str(d / "out" / "ds_train.json"))
    assert len(ds) == len(shard) and ds.sources == shard.sources == ("chat", "share")
    for i in range(len(ds)):
        a, b = ds[i], shard[i]
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert ds.source_ids(i).tolist() == shard.source_ids(i).tolist()
    with pytest.raises(Exception, match="from its stores"):
        VirtualPackedDataset(stores[0], str(tmp_path / "m.plan"), split="train")


def test_a_step_size_orders_the_mixture_by_windows_for_any_data_parallel_size(first, tmp_path, capsys):
    import warnings

    from megatron_sft_idx.batching import Order, Topology

    d, mix, _ = first
    argv = ["--mix", mix, "--output-prefix", str(tmp_path / "ds"), "--pack-size", "1024", "--split", "85,15",
            "--step-size", "2"]
    code, s, err = run_cli(repack_main, argv, capsys)
    assert code == 0, err
    windows = s["mixture"]["splits"]["train"]["windows"]
    assert windows["topology"] == "DP 1, micro-batch 1, global batch 2" and windows["interleaved"]["windows"] > 0
    order = Order.load(str(tmp_path / "ds_train.order"))
    assert order.algorithm == "shuffle" and order.source["interleave"]["window_steps"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # steps alone: any DP and micro-batch of that global batch
        assert not order.warn_if_mismatch(Topology(2, 1, 2))
    assert order.topology_mismatch(Topology(1, 1, 4)) is not None
    # the shards are those of the --balance-for run: an order never changes them
    for name in ("ds_train.bin", "ds_train.seq.idx", "ds_valid.idx"):
        assert (tmp_path / name).read_bytes() == (d / "out" / name).read_bytes()
    assert main(["--mix", mix, "--tokenizer", TOKENIZER, "--output-prefix", "x", "--step-size", "2",
                 "--balance-for", "1,1,2"]) == 2
    assert "--step-size" in capsys.readouterr().err


def test_a_damaged_store_partition_is_named_and_nothing_is_published(first, tmp_path, capsys):
    d, _, _ = first
    shutil.copytree(d / "stores", tmp_path / "stores")
    part = tmp_path / "stores" / "share" / "parts" / "part_000000.bin"
    raw = bytearray(part.read_bytes())
    raw[10] ^= 0xFF
    part.write_bytes(bytes(raw))
    mix = write_mix(tmp_path / "mix.json", [{"name": "chat", "store": "stores/chat", "weight": 1},
                                            {"name": "share", "store": "stores/share", "weight": 3}])
    code, _, err = run_cli(repack_main, ["--mix", mix, "--output-prefix", str(tmp_path / "out" / "ds")] + PACK, capsys)
    assert code == 1 and "partition 0 does not verify" in err and "stores/share" in err
    assert not [n for n in os.listdir(tmp_path / "out") if not n.startswith(".")]
