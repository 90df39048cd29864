"""The alignments a run pads for and records: FP8 blocks beside CP/TP/SP (docs/FORMAT.md "FP8
alignment"), from preprocess-sft's flags to the metadata, the gate and the Megatron adapters."""

import json
from collections import Counter
import os

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.reader import MMapIndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CONVERSATIONS = os.path.join(EXAMPLES, "conversations.jsonl")


def run(prefix, *extra):
    summary = prefix.parent / f"{prefix.name}.summary.json"
    assert main(["--input", CONVERSATIONS, "--tokenizer", TOKENIZER, "--output-prefix", str(prefix),
                 "--pack-size", "2048", "--quiet", "--summary-json", str(summary), *extra]) == 0
    return json.loads(summary.read_text())


def stored_lengths(prefix):
    ds = MMapIndexedDataset(str(prefix), check_packs=True)
    out = []
    for i in range(len(ds)):
        bounds = ds[i].seq_boundaries
        out.extend(np.diff(bounds).tolist())
    return ds.metadata, np.asarray(out)


# ---------------------------------------------------------------- FP8 alignment


def test_fp8_pads_every_sequence_for_the_recipe_and_records_it(tmp_path):
    s = run(tmp_path / "f" / "ds", "--cp", "2", "--fp8", "mxfp8")
    meta, lengths = stored_lengths(tmp_path / "f" / "ds")
    assert meta.pad_seq_to_mult == 32 * 2 * 2 == s["pack_size"] // 16   # the block times 2*CP
    assert meta.parallelism == {"cp": 2, "tp": 1, "sp": False, "fp8": "mxfp8"}
    assert lengths.size == s["conversations"] and (lengths % 128 == 0).all()
    plain = run(tmp_path / "p" / "ds", "--cp", "2")
    meta0, lengths0 = stored_lengths(tmp_path / "p" / "ds")
    assert meta0.parallelism == {"cp": 2, "tp": 1, "sp": False} and meta0.pad_seq_to_mult == 4
    assert s["padding_tokens"] > plain["padding_tokens"] and (np.sort(lengths) >= np.sort(lengths0)).all()
    gate = pytest.importorskip("megatron_sft_idx.gate")
    report = gate.check([str(tmp_path / "f" / "ds")], level="standard")
    assert report.passed, report.format_text()


def test_fp8_flag_refuses_an_unknown_recipe(tmp_path, capsys):
    assert main(["--input", CONVERSATIONS, "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "x"),
                 "--fp8", "nvfp4", "--quiet"]) == 2
    assert "--fp8: invalid choice: 'nvfp4'" in capsys.readouterr().err


def test_gate_refuses_a_multiple_below_the_recorded_parallelism(tmp_path):
    gate = pytest.importorskip("megatron_sft_idx.gate")
    rng = np.random.default_rng(7)
    ok, bad = str(tmp_path / "ok"), str(tmp_path / "bad")
    write_shard(ok, random_packs(rng, 6, pack_size=256, pad_mult=64),
                metadata={"pad_seq_to_mult": 64, "parallelism": {"cp": 2, "tp": 1, "sp": False, "fp8": "tensorwise"}},
                pack_size=256)
    write_shard(bad, random_packs(rng, 6, pack_size=256, pad_mult=4),
                metadata={"pad_seq_to_mult": 4, "parallelism": {"cp": 2, "tp": 1, "sp": False, "fp8": "mxfp8"}},
                pack_size=256)
    assert gate.check([ok]).passed
    report = gate.check([bad])
    found = [f for f in report.shards[0].findings if f.code == "PAD_MULTIPLE_BELOW_PARALLELISM"]
    assert not report.passed and len(found) == 1
    assert "pad_seq_to_mult is 4" in found[0].message and "CP 2, TP 1, FP8 mxfp8" in found[0].message
    assert "multiple of 128" in found[0].message


def test_gate_calls_an_unreadable_parallelism_record_invalid(tmp_path):
    gate = pytest.importorskip("megatron_sft_idx.gate")
    prefix = str(tmp_path / "odd")
    write_shard(prefix, random_packs(np.random.default_rng(8), 4, pack_size=64, pad_mult=4),
                metadata={"pad_seq_to_mult": 4, "parallelism": {"cp": 2, "fp8": "fp4"}})
    report = gate.check([prefix])
    assert not report.passed
    assert any(f.code == "METADATA_INVALID" and "unknown FP8 recipe" in f.message for f in report.shards[0].findings)


# ---------------------------------------------------------------- the adapters refuse, naming both


@pytest.fixture(scope="module")
def cp2_shard(tmp_path_factory):
    """A shard padded for CP 2 alone (multiple 4), in each layout."""
    d = tmp_path_factory.mktemp("cp2")
    out = {}
    for layout in ("stored", "runtime"):
        prefix = str(d / layout)
        rng = np.random.default_rng(9)
        packs = random_packs(rng, 12, pack_size=256, pad_mult=4)
        if layout == "runtime":   # each stored length one more than a multiple of 4
            packs = [_runtime(p) for p in packs]
        write_shard(prefix, packs, pack_size=260, metadata={
            "pad_seq_to_mult": 4, "pad_layout": layout, "parallelism": {"cp": 2, "tp": 1, "sp": False}})
        out[layout] = prefix
    return out


def _runtime(pack):
    ids, loss, starts = pack
    bounds = np.append(starts, ids.size)
    new_ids, new_loss, new_starts = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        new_starts.append(sum(x.size for x in new_ids))
        new_ids.append(np.append(ids[a:b], ids[b - 1]))
        new_loss.append(np.append(loss[a:b], 0))
    return np.concatenate(new_ids), np.concatenate(new_loss).astype(np.uint8), np.asarray(new_starts, np.int64)


def test_megatron_adapter_refuses_data_not_padded_for_the_runs_fp8(cp2_shard):
    M = pytest.importorskip("megatron_sft_idx.training.megatron")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_sft_idx.training.megatron import SFTIndexedDataset, SFTIndexedDatasetConfig

    def build(**kw):
        config = SFTIndexedDatasetConfig(random_seed=1, sequence_length=512, blend=([cp2_shard["stored"]], None),
                                         split="1,0,0", tokenizer=None, **kw)
        return BlendedMegatronDatasetBuilder(SFTIndexedDataset, [4, 0, 0], lambda: True, config).build()

    train, _, _ = build(context_parallel_size=2)   # what it was padded for
    assert len(train) == 4
    with pytest.raises(ShardError) as info:
        build(context_parallel_size=2, fp8_recipe="mxfp8")
    message = str(info.value)
    assert info.value.field == "pad_seq_to_mult" and info.value.path == cp2_shard["stored"]
    assert "padded to multiples of 4 (for CP 2, TP 1)" in message and "(CP 2, FP8 mxfp8) needs multiples of 128" in message
    assert M.padding_divisor(SFTIndexedDatasetConfig(random_seed=1, sequence_length=512, tokenizer=None, split="1",
                                                     context_parallel_size=2, sequence_parallel_size=4,
                                                     fp8_recipe="mxfp8", blend=([cp2_shard["stored"]], None))) == 512
    with pytest.raises(ShardError, match="unknown FP8 recipe"):
        build(context_parallel_size=2, fp8_recipe="custom")


def test_megatron_config_from_args_reads_the_fp8_recipe():
    M = pytest.importorskip("megatron_sft_idx.training.megatron")
    from types import SimpleNamespace

    args = SimpleNamespace(data_path=["/nowhere/a"], split="1", seq_length=512, context_parallel_size=2,
                           fp8="hybrid", fp8_recipe="mxfp8")
    assert M.config_from_args(args).fp8_recipe == "mxfp8" and M.padding_divisor(M.config_from_args(args)) == 128
    args.fp8 = None
    assert M.config_from_args(args).fp8_recipe is None and M.padding_divisor(M.config_from_args(args)) == 4


def test_bridge_adapter_refuses_a_pad_multiple_the_data_does_not_satisfy(cp2_shard):
    B = pytest.importorskip("megatron_sft_idx.training.bridge")
    ds = B.PackedSFTDataset(cp2_shard["runtime"], eos_id=0, pad_seq_to_mult=4)
    assert len(ds) == 12
    with pytest.raises(ShardError) as info:
        B.PackedSFTDataset(cp2_shard["runtime"], eos_id=0, pad_seq_to_mult=8)
    assert info.value.field == "pad_seq_to_mult" and info.value.actual == 8
    assert "padded to multiples of 4 (for CP 2, TP 1)" in str(info.value) and "pad_seq_to_mult is 8" in str(info.value)


# ---------------------------------------------------------------- prompt-only sequences

PROMPT_ONLY_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "only a question"}]
RECORDS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
           {"messages": PROMPT_ONLY_CHAT},
           {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]},
           {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}]


def prompt_only_run(tmp_path, *extra, records=RECORDS):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = tmp_path / "out" / "ds"
    summary = tmp_path / "summary.json"
    rc = main(["--input", str(data), "--tokenizer", TOKENIZER, "--output-prefix", str(prefix), "--pack-size", "256",
               "--quiet", "--summary-json", str(summary), *extra])
    return rc, prefix, (json.loads(summary.read_text()) if rc == 0 else None)


def sequences(prefix):
    ds = MMapIndexedDataset(str(prefix), check_packs=True)
    out = []
    for i in range(len(ds)):
        p = ds[i]
        for a, b in zip(p.seq_boundaries[:-1], p.seq_boundaries[1:]):
            out.append((p.input_ids[a:b].tolist(), p.loss_mask[a:b].tolist()))
    return ds.metadata, out


def test_prompt_only_error_is_todays_rule(tmp_path, capsys):
    rc, _, _ = prompt_only_run(tmp_path)
    assert rc == 1 and "d.jsonl:2: no token is trained" in capsys.readouterr().err
    rc, prefix, s = prompt_only_run(tmp_path, "--skip-bad", "--overwrite")
    meta, _ = sequences(prefix)
    assert s["records_skipped"] == {"no_trainable_tokens": 2} and "prompt_only" not in s
    assert "prompt_only" not in meta.extra


def test_prompt_only_keep_stores_them_whole_with_no_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    rc, prefix, s = prompt_only_run(tmp_path, "--prompt-only", "keep")
    meta, seqs = sequences(prefix)
    assert rc == 0 and s["conversations"] == 4 and s["records_skipped"] == {}
    assert s["prompt_only"] == {"policy": "keep", "stored": 2, "dropped": 0}
    assert meta.extra["prompt_only"] == "keep"
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    text = tok.apply_chat_template(PROMPT_ONLY_CHAT, tokenize=False)
    rendered = tok(text, add_special_tokens=False)["input_ids"]
    untrained = sorted(ids for ids, mask in seqs if not any(mask))
    assert untrained == sorted([rendered, [5, 6, 7, 8]])
    assert sum(any(mask) for _, mask in seqs) == 2   # the two trained conversations, as without the flag


def test_prompt_only_drop_counts_them_without_skip_bad(tmp_path):
    rc, prefix, s = prompt_only_run(tmp_path, "--prompt-only", "drop")
    meta, seqs = sequences(prefix)
    assert rc == 0 and s["conversations"] == 2 and all(any(mask) for _, mask in seqs)
    assert s["records_skipped"] == {"prompt_only_dropped": 2}
    assert s["prompt_only"] == {"policy": "drop", "stored": 0, "dropped": 2}
    assert meta.extra["prompt_only"] == "drop"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n')   # a bad record is still an error: drop is about prompt-only ones
    assert main(["--input", str(bad), "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "b"),
                 "--prompt-only", "drop", "--quiet"]) == 1


# ------------------------------------------- prompt-only sequences: --verify-masks, per-turn, --mix

TWO_TURNS = {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
                          {"role": "user", "content": "second"}, {"role": "assistant", "content": "two"}]}


@pytest.mark.parametrize("loss_on", ["assistant", "per-turn", "last-turn"])
def test_prompt_only_keep_passes_verify_masks_under_each_loss_mode(tmp_path, loss_on):
    """Every sequence checked, the kept prompt-only ones included: a chat record rendered whole
    (as --loss-on all renders it) with no trained token, a token record as given. Per-turn once
    refused them (its reference path has no turn to render)."""
    rc, prefix, s = prompt_only_run(tmp_path, "--prompt-only", "keep", "--loss-on", loss_on, "--verify-masks", "50",
                                    records=RECORDS + [TWO_TURNS])
    _, seqs = sequences(prefix)
    assert rc == 0 and s["prompt_only"] == {"policy": "keep", "stored": 2, "dropped": 0}
    assert len(seqs) == (6 if loss_on == "per-turn" else 5)   # per-turn: one sequence per reply
    v = s["verify_masks"]
    assert v["failures"] == 0 and v["checked"] == v["eligible"] == len(seqs)
    assert sum(not any(mask) for _, mask in seqs) == 2


def test_verify_masks_catches_a_kept_prompt_only_sequence_stored_wrong(tmp_path, monkeypatch, capsys):
    """Fault injection: the encoder keeps a prompt-only chat record with one trained label; the
    check, which renders it the way --prompt-only keep must, refuses the run."""
    from megatron_sft_idx.preprocess.records.encode import RecordEncoder

    keep = RecordEncoder._prompt_only

    def one_trained(self, line, raw, path):
        out = keep(self, line, raw, path)
        if out is not None and len(out[0]) > 4:
            out[1][2] = 1
        return out

    monkeypatch.setattr(RecordEncoder, "_prompt_only", one_trained)
    for loss_on in ("assistant", "per-turn"):
        rc, _, _ = prompt_only_run(tmp_path, "--prompt-only", "keep", "--loss-on", loss_on, "--verify-masks", "50",
                                   "--overwrite")
        assert rc == 1 and "loss mask differs from the reference encoding" in capsys.readouterr().err


def test_prompt_only_keep_in_a_mixture_with_per_turn(tmp_path):
    """--mix: each source's store keeps its prompt-only records; the shards hold them with no
    loss under their source, and record the policy per source (``sources[i].prompt_only``: a
    mixture's sources may come from stores made with other policies)."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS + [TWO_TURNS]))
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"version": 1, "unit": "sequences", "sources": [
        {"name": "chat", "inputs": [CONVERSATIONS], "store": str(tmp_path / "stores" / "chat"), "weight": 1},
        {"name": "prompts", "inputs": [str(data)], "store": str(tmp_path / "stores" / "prompts"), "weight": 1}]}))
    prefix = tmp_path / "out" / "ds"
    summary = tmp_path / "summary.json"
    assert main(["--mix", str(mix), "--tokenizer", TOKENIZER, "--output-prefix", str(prefix), "--pack-size", "2048",
                 "--loss-on", "per-turn", "--prompt-only", "keep", "--quiet", "--summary-json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["prompt_only"]["policy"] == "keep" and s["prompt_only"]["stored"] == 2
    ds = MMapIndexedDataset(str(prefix), check_packs=True)
    assert [src.name for src in ds.metadata.sources] == ["chat", "prompts"]
    assert all(src.extra["prompt_only"] == "keep" for src in ds.metadata.sources)
    untrained, replies = Counter(), Counter()
    for i in range(len(ds)):
        p, src = ds[i], ds.source_ids(i)
        for k, (a, b) in enumerate(zip(p.seq_boundaries[:-1], p.seq_boundaries[1:])):
            (replies if p.loss_mask[a:b].any() else untrained)[ds.sources[src[k]]] += 1
    assert untrained == {"prompts": 2}                 # the two prompt-only records, whole, no loss
    assert replies["prompts"] == 4                     # per-turn: one sequence per reply (1 + 1 + 2)
