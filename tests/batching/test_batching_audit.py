"""The audit (``plan-batches --audit``): each rule's per-token weights against a token-by-token
simulation written out here, how label balancing changes them, and bad input refused. The
replays against the trainers' own gradients: tests/compat/test_loss_rules.py (megatron-core,
Megatron-Bridge), tests/training/test_step_denominators.py (transformers, TRL)."""

import json

import numpy as np
import pytest
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching.audit import AUDIT_RULES, audit_order, format_audit
from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs
from megatron_sft_idx.batching.layout import Topology, where
from megatron_sft_idx.batching.trained import trained_counts
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.tools.plan_batches_cli import main

MODEL = CostModel(1.0, 0.5)
CP = 2


@pytest.fixture(scope="module")
def cp_shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    packs = random_packs(np.random.default_rng(1), 48, pack_size=64, vocab=9, pad_mult=2 * CP, max_seqs=4)
    packs[7] = (packs[7][0], np.zeros_like(packs[7][1]), packs[7][2])   # a pack with no trained token
    write_shard(str(root / "p"), packs, metadata={"pad_seq_to_mult": 2 * CP})
    return str(root / "p"), packs


def simulated(packs, order, topo, cp, seq_length):
    """Per rule name, per complete step: (mean |w N - 1| over tokens, max, sum of weights), each
    token's weight from the rule's definition, token by token."""
    stream = order.permutations.reshape(-1)
    gbs, dp = topo.global_batch_size, topo.data_parallel_size
    micro = topo.num_microbatches
    out = {r.name: [] for r in AUDIT_RULES}
    for s in range(len(stream) // gbs):
        tokens = []   # (rank, micro-batch, cp rank, sequence id) of every trained token of the step
        seqs = []     # every sequence of the step with its trained tokens
        for g in range(s * gbs, (s + 1) * gbs):
            _, m, d, _ = (int(x) for x in where(g, topo))
            ids, loss, starts = packs[int(stream[g])]
            ends = list(starts[1:]) + [len(ids)]
            for a, b in zip(starts, ends):
                seg = (seq_length if b == len(ids) else b) - a   # Megatron-LM's segment of the sequence
                n_seq = 0
                for j in range(a, b - 1):
                    if loss[j]:
                        k = (j - a) // (seg // (2 * cp))
                        tokens.append((d, m, k if k < cp else 2 * cp - 1 - k, (g, a)))
                        n_seq += 1
                seqs.append(((g, a), n_seq))
        n = len(tokens)
        count = {}
        for d, m, c, sq in tokens:
            for key in (("mc", d, m, c), ("r", d), ("m", d, m)):
                count[key] = count.get(key, 0) + 1
        seq_n = dict(seqs)
        weights = {
            "megatron-lm:per-token": [1 / n] * n,
            "megatron-lm:per-micro-batch": [1 / (dp * cp * micro * count[("mc", d, m, c)]) for d, m, c, _ in tokens],
            "nemo-rl:token": [1 / n] * n,
            "nemo-rl:sequence": [1 / (seq_n[sq] * len(seqs)) for *_, sq in tokens],
            "transformers:num_items_in_batch": [1 / n] * n,
            "transformers:per-device": [1 / (dp * count[("r", d)]) for d, *_ in tokens],
            "transformers:per-micro-batch": [1 / (dp * micro * count[("m", d, m)]) for d, m, *_ in tokens],
        }
        for name, w in weights.items():
            dev = [abs(x * n - 1) for x in w]
            out[name].append((sum(dev) / n, max(dev), sum(w)))
    return out


def test_the_audit_is_a_token_by_token_simulation_of_each_rule(cp_shard):
    prefix, packs = cp_shard
    ds = MMapIndexedDataset(prefix)
    counts = trained_counts(ds)
    topo = Topology(2, 2, 8)
    for order in (plan_order(shard_pack_costs(ds, MODEL), topo, MODEL, seed=4, epochs=2, trained=counts),
                  plan_order(shard_pack_costs(ds, MODEL), topo, MODEL, seed=4, epochs=2, trained=counts,
                             balance_labels=True, exchange_window=3, label_slack=0.05)):
        results = {r.rule.name: r for r in audit_order(order, counts, cp=CP, source=ds, seq_length=64)}
        want = simulated(packs, order, topo, CP, 64)
        for name, steps in want.items():
            got = results[name]
            np.testing.assert_allclose(got.mean_dev, [s[0] for s in steps], rtol=1e-9, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(got.max_dev, [s[1] for s in steps], rtol=1e-9, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(got.scale, [s[2] for s in steps], rtol=1e-6, err_msg=name)
        assert results["megatron-lm:per-token"].summary()["max_dev"] < 1e-12
        assert results["megatron-lm:per-micro-batch"].summary()["max_dev"] > 0.1   # unequal CP shares
        # the shards are padded for Megatron-LM (stored layout): Bridge's runtime segments do not split
        assert "not trainable with CP 2" in results["megatron-bridge:default"].summary()["note"]


def test_label_balancing_brings_per_rank_normalisation_to_the_token_mean(tmp_path):
    rng = np.random.default_rng(2)
    packs = []
    for _ in range(256):   # answer-heavy and prompt-heavy packs of the same length
        ids, loss, starts = random_packs(rng, 1, pack_size=128, max_seqs=2, full=True)[0]
        loss = (rng.random(128) < rng.choice([0.15, 0.85])).astype(np.uint8)
        loss[np.append(starts[1:], 128) - 1] = 0
        packs.append((ids, loss, starts))
    write_shard(str(tmp_path / "l"), packs, pack_size=128)
    ds = MMapIndexedDataset(str(tmp_path / "l"))
    counts, costs = trained_counts(ds), shard_pack_costs(ds, MODEL)
    topo = Topology(8, 1, 64)
    audits = {}
    for name, kw in (("shuffle", dict(algorithm="shuffle")), ("balanced", {}),
                     ("labels", dict(balance_labels=True, label_slack=0.01))):
        order = plan_order(costs, topo, MODEL, seed=1, epochs=2, trained=counts, **kw)
        audits[name] = audit_order(order, counts)
    per_device = {k: next(r for r in v if r.rule.name == "transformers:per-device").summary() for k, v in audits.items()}
    assert per_device["labels"]["mean_dev"] < per_device["shuffle"]["mean_dev"] / 5, per_device
    text = format_audit(audits)
    assert text.splitlines()[0].split()[:3] == ["rule", "shuffle", "mean"]
    assert "transformers:per-device" in text and "worst step" in text


def test_plan_batches_audit_prints_and_writes_json(cp_shard, tmp_path, capsys):
    prefix, _ = cp_shard
    assert main([prefix, "--balance-for", "2,2,8", "--audit", "--cp", "2", "--json", "--epochs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cp"] == 2 and set(report["audit"]) == {"shuffle", "balanced", "labels"}
    assert [r["rule"] for r in report["audit"]["labels"]] == [r.name for r in AUDIT_RULES]
    assert set(report["trained"]) == {"rule", "shuffle", "balanced", "labels"}
    out = tmp_path / "p.order"
    assert main([prefix, "--balance-for", "2,2,8", "--balance-labels", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trained tokens ('stored' rule) per step" in text and f"wrote {out}" in text
    assert main([prefix, "--audit", "--order", str(out)]) == 0   # the order's own topology
    text = capsys.readouterr().out
    assert "DP 2, micro-batch 2, global batch 8, CP 1" in text and "megatron-lm:per-micro-batch" in text


def test_bad_input_is_one_clear_error(cp_shard, tmp_path, capsys):
    prefix, packs = cp_shard
    out = tmp_path / "p.order"
    assert main([prefix, "--balance-for", "2,2,8", "--out", str(out)]) == 0
    capsys.readouterr()
    # a topology the packs cannot fill
    assert main([prefix, "--balance-for", "8,2,64", "--audit"]) == 2
    assert "fewer than one global batch of 64" in capsys.readouterr().err
    # a CP size the packs cannot be split for
    assert main([prefix, "--balance-for", "2,2,8", "--audit", "--cp", "4"]) == 1
    err = capsys.readouterr().err
    assert "not a multiple of 2 * CP = 8" in err and "pack" in err
    # an order from other data: the same index, other masks
    changed = list(packs)
    ids, loss, starts = changed[11]
    changed[11] = (ids, np.where(loss == 1, 0, loss).astype(np.uint8), starts)
    write_shard(str(tmp_path / "o"), changed, metadata={"pad_seq_to_mult": 2 * CP})
    assert main([str(tmp_path / "o"), "--audit", "--order", str(out)]) == 1
    assert "pack 11's trained tokens" in capsys.readouterr().err
    assert main([str(tmp_path / "o"), "--audit", "--order", str(out), "--out", str(tmp_path / "x")]) == 2
    assert main([prefix, "--balance-for", "2,2,8", "--cp", "2"]) == 2
    assert main([prefix, "--balance-for", "2,2,8", "--no-counts", "--balance-labels"]) == 2


def test_an_order_without_counts_cannot_be_label_balanced_but_can_be_audited(cp_shard, tmp_path, capsys):
    prefix, _ = cp_shard
    out = tmp_path / "bare.order"
    assert main([prefix, "--balance-for", "2,2,8", "--no-counts", "--out", str(out)]) == 0
    assert "trained tokens" not in capsys.readouterr().out
    assert main([prefix, "--audit", "--order", str(out)]) == 0   # audited with the data's counts
    with pytest.raises(ShardError, match="records no trained-token counts"):
        __import__("megatron_sft_idx.batching.order", fromlist=["Order"]).Order.load(out).step_trained("stored")
