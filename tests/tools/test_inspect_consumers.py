"""inspect-idx --consumers: per-consumer trained positions, against a per-position reference loop;
the gate's BRIDGE_ALIGNMENT_PADDING_TRAINED on a shard converted from Bridge-style CP packs."""

import json

import numpy as np
import pytest

from megatron_sft_idx.gate import check
from megatron_sft_idx.tools import inspect_consumers
from megatron_sft_idx.tools.inspect_cli import main as inspect_main
from megatron_sft_idx.tools.inspect_consumers import consumer_audit, format_consumer_audit
from support.shardgen import write_shard

EOS = 2
CONVERTED = {"converted_from": {"format": "npy", "path": "/data/b.npy", "loss_mask": "as_written",
                                "bridge_eos_id": EOS}}


def cp_packs(rng, count, mult=4, pack_size=64, trained_padding=True):
    """Bridge-style CP packs: each runtime segment (length - 1) padded with EOS to the multiple;
    the padding stored with loss 1 (as Bridge's prompt-template packer does) when asked."""
    packs = []
    for _ in range(count):
        ids, loss, starts = [], [], []
        while True:
            real = int(rng.integers(2, 14))
            total = -(-(real - 1) // mult) * mult + 1
            if len(ids) + total > pack_size:
                break
            starts.append(len(ids))
            seq = list(rng.integers(3, 500, real))
            seq[rng.integers(0, real)] = EOS if rng.random() < 0.3 else seq[0]  # an EOS inside, sometimes
            mask = list(rng.integers(0, 2, real))
            pad = total - real
            ids += seq + [EOS] * pad
            loss += mask[:-1] + [int(trained_padding)] * pad + [0] if pad else mask[:-1] + [0]
        packs.append((np.array(ids), np.array(loss, dtype=np.uint8), np.array(starts)))
    return packs


def reference(packs, eos, mult):
    out = {"megatron-lm": 0, "megatron-bridge-0.6": 0, "megatron-bridge-next": 0, "trl-padding-free": 0,
           "eos_inputs_trained": 0, "alignment_padding_trained": 0}
    for ids, loss, starts in packs:
        out["megatron-lm"] += int(loss.sum())
        bounds = list(starts) + [len(ids)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            last_real = max([j for j in range(a, b - 1) if ids[j] != eos], default=a - 1)
            for j in range(a, b - 1):
                if loss[j]:
                    out["megatron-bridge-next"] += 1
                    out["trl-padding-free"] += 1
                    if ids[j] == eos:
                        out["eos_inputs_trained"] += 1
                        out["alignment_padding_trained"] += int(mult > 1 and j > last_real)
                    else:
                        out["megatron-bridge-0.6"] += 1
    return out


@pytest.mark.parametrize("chunk", [1 << 20, 70])
def test_counts_equal_a_per_position_reference(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(inspect_consumers, "CHUNK_TOKENS", chunk)  # several chunks, whole packs each
    rng = np.random.default_rng(5)
    packs = cp_packs(rng, 30)
    write_shard(tmp_path / "s", packs, metadata={"pad_seq_to_mult": 4, "pad_layout": "runtime",
                                                 "source": CONVERTED})
    audit = consumer_audit([str(tmp_path / "s")])
    want = reference(packs, EOS, 4)
    assert {k: audit["total"][k] for k in want} == want
    assert want["alignment_padding_trained"] > 0 and audit["shards"][0]["eos_id"] == EOS
    assert "EOS alignment padding" in format_consumer_audit(audit)


def test_without_an_eos_id_bridge_06_is_unknown_and_the_cli_says_so(tmp_path, capsys):
    packs = cp_packs(np.random.default_rng(6), 5, mult=1)
    write_shard(tmp_path / "s", packs)
    assert inspect_main([str(tmp_path / "s"), "--consumers"]) == 0
    out = capsys.readouterr().out
    assert "unknown (pass --eos-id)" in out and "trl-padding-free" in out
    assert inspect_main([str(tmp_path / "s"), "--consumers", "--eos-id", str(EOS), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total"] == {**{k: doc["total"][k] for k in doc["total"]}, **reference(packs, EOS, 1)}
    assert inspect_main([str(tmp_path / "s"), "--eos-id", "2"]) == 2  # --eos-id goes with --consumers


def test_an_old_converted_shard_is_named(tmp_path):
    write_shard(tmp_path / "s", cp_packs(np.random.default_rng(7), 3, mult=1),
                metadata={"source": {"converted_from": {"format": "parquet", "path": "/d"}}})
    text = format_consumer_audit(consumer_audit([str(tmp_path / "s")], eos_id=EOS))
    assert "converted with Bridge 0.6's normalisation" in text


def test_the_gate_warns_on_trained_alignment_padding_of_a_bridge_written_pack(tmp_path):
    rng = np.random.default_rng(8)
    meta = {"pad_seq_to_mult": 4, "pad_layout": "runtime", "source": CONVERTED}
    write_shard(tmp_path / "bad", cp_packs(rng, 10), metadata=meta)
    write_shard(tmp_path / "good", cp_packs(rng, 10, trained_padding=False), metadata=meta)
    write_shard(tmp_path / "ours", cp_packs(rng, 10), metadata={"pad_seq_to_mult": 4, "pad_layout": "runtime"})
    report = check([str(tmp_path / "bad"), str(tmp_path / "good"), str(tmp_path / "ours")])
    bad, good, ours = report.shards
    found = [f for f in bad.findings if f.code == "BRIDGE_ALIGNMENT_PADDING_TRAINED"]
    assert len(found) == 1 and found[0].severity == "warning" and found[0].pack is not None
    assert bad.passed and not check(str(tmp_path / "bad"), strict=True).passed
    assert "BRIDGE_ALIGNMENT_PADDING_TRAINED" not in good.codes() + ours.codes()  # not Bridge-written: no claim


def test_the_eos_id_comes_from_the_recorded_tokenizer_unless_given(tmp_path, capsys):
    """Issue 44 item 2: a shard that records its tokenizer needs no --eos-id; the flag still wins."""
    packs = cp_packs(np.random.default_rng(9), 6, mult=1)
    tokenizer = {"name": "t", "files_sha256": "a" * 64, "eos_id": EOS, "vocab_size": 1000}
    write_shard(tmp_path / "s", packs, vocab_size=1000, metadata={"tokenizer": tokenizer})
    assert inspect_main([str(tmp_path / "s"), "--consumers"]) == 0
    out = capsys.readouterr().out
    assert "unknown" not in out and "EOS id 2 from the recorded tokenizer" in out
    assert inspect_main([str(tmp_path / "s"), "--consumers", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total"] == {**doc["total"], **reference(packs, EOS, 1)}
    assert (doc["shards"][0]["eos_id"], doc["shards"][0]["eos_from"]) == (EOS, "tokenizer")
    assert inspect_main([str(tmp_path / "s"), "--consumers", "--eos-id", "7", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["shards"][0]["eos_id"], doc["shards"][0]["eos_from"]) == (7, "--eos-id")
    assert doc["total"] == {**doc["total"], **reference(packs, 7, 1)}
