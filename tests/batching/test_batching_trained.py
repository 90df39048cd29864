"""Trained tokens: counted from real shards as each consumer trains them, recorded with the order
as every step's denominators (order file 1.1), refused when they are not the data's, and evened
out by label-balanced steps. The replays of the trainers' rules are tests/batching/test_batching_audit.py."""

import json
import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel, shard_pack_costs
from megatron_sft_idx.batching.layout import Topology, base_permutation, where
from megatron_sft_idx.batching.order import HEADER_SIZE, Order
from megatron_sft_idx.batching.report import straggler_report, trained_summary
from megatron_sft_idx.batching.trained import (BRIDGE_06, LAYOUT_BRIDGE, LAYOUT_MEGATRON, STORED, TrainedCounts,
                                               cp_sequence_counts, step_table, trained_counts)
from megatron_sft_idx.errors import HeaderError, ShardError
from megatron_sft_idx.legacy import consumer_loss_counts
from megatron_sft_idx.multi import MultiShardDataset
from tests.support.shardgen import random_packs, write_shard

EOS = 7
MODEL = CostModel.from_preset("llama3-8b")
QUADRATIC = CostModel(1.0, 1.0)   # attention-heavy: a pack of one 256-token sequence costs ~8x one of 8 short ones


def packs_with_eos(rng, count, **kw):
    """Random packs whose tokens include the EOS id often (vocab 16), label-aligned masks."""
    return random_packs(rng, count, vocab=16, **kw)


@pytest.fixture
def shard(tmp_path):
    rng = np.random.default_rng(3)
    packs = packs_with_eos(rng, 60, pad_mult=4)
    write_shard(str(tmp_path / "a"), packs, metadata={"pad_seq_to_mult": 4})
    return str(tmp_path / "a"), packs


def by_loop(packs, eos=EOS):
    """Per sequence: the stored mask's trained positions, and without EOS inputs (a plain loop)."""
    stored, bridge = [], []
    for ids, loss, starts in packs:
        ends = list(starts[1:]) + [len(ids)]
        for a, b in zip(starts, ends):
            stored.append(sum(int(loss[j] != 0) for j in range(a, b - 1)))
            bridge.append(sum(int(loss[j] != 0 and ids[j] != eos) for j in range(a, b - 1)))
    return stored, bridge


def test_counts_are_each_sequences_trained_positions(shard):
    prefix, packs = shard
    counts = trained_counts(MMapIndexedDataset(prefix), eos_id=EOS)
    stored, bridge = by_loop(packs)
    assert counts.sequence[STORED].tolist() == stored
    assert counts.sequence[BRIDGE_06].tolist() == bridge
    assert counts.rules == (STORED, BRIDGE_06) and counts.num_packs == 60
    assert counts.pack(STORED).tolist() == [sum(int(x) for x in p[1]) for p in packs]   # (last positions are 0)
    # the totals are what inspect-idx --consumers counts for each consumer
    ds = MMapIndexedDataset(prefix)
    a = ds.arrays()
    total = consumer_loss_counts(a.tokens, a.loss_mask, a.seq_starts, a.seq_offsets, a.sequence_lengths, eos_id=EOS)
    assert int(counts.pack(STORED).sum()) == total["megatron-lm"] == total["trl-padding-free"]
    assert int(counts.pack(BRIDGE_06).sum()) == total["megatron-bridge-0.6"]
    live = [sum(1 for c in stored[o:o + n] if c) for o, n in zip(np.cumsum([0] + [len(p[2]) for p in packs]),
                                                                   [len(p[2]) for p in packs])]
    assert counts.pack_sequences(STORED).tolist() == live


def test_counts_of_a_set_follow_its_global_pack_index(tmp_path):
    rng = np.random.default_rng(4)
    parts = [packs_with_eos(rng, n) for n in (7, 11)]
    for k, packs in enumerate(parts):
        write_shard(str(tmp_path / f"s_{k:06d}"), packs)
    multi = MultiShardDataset.open([str(tmp_path / "s_000000"), str(tmp_path / "s_000001")])
    counts = trained_counts(multi)
    assert counts.sequence[STORED].tolist() == by_loop(parts[0] + parts[1])[0]
    joined = TrainedCounts.concat(trained_counts(MMapIndexedDataset(str(tmp_path / f"s_{k:06d}"))) for k in (0, 1))
    np.testing.assert_array_equal(joined.sequence_offsets, counts.sequence_offsets)
    with pytest.raises(ShardError, match="share their rules"):
        TrainedCounts.concat([counts, trained_counts(multi, eos_id=1)])


def zigzag(length, cp):
    """Transformer Engine's THD split of one segment: the CP rank of each position."""
    chunk = length // (2 * cp)
    return [k if k < cp else 2 * cp - 1 - k for k in (j // chunk for j in range(length))]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_counts_split_each_segment_as_the_trainers_do(tmp_path, cp):
    rng = np.random.default_rng(5)
    packs = packs_with_eos(rng, 30, pack_size=64, pad_mult=2 * cp)
    write_shard(str(tmp_path / "m"), packs, metadata={"pad_seq_to_mult": 2 * cp})
    got = cp_sequence_counts(MMapIndexedDataset(str(tmp_path / "m")), cp, layout=LAYOUT_MEGATRON, seq_length=64)
    want = []
    for ids, loss, starts in packs:
        ends = list(starts[1:]) + [64]   # the last sequence's segment runs to seq_length (Megatron-LM's cu_seqlens)
        for a, b in zip(starts, ends):
            ranks, row = zigzag(b - a, cp), [0] * cp
            for j in range(a, min(b, len(ids)) - 1):
                row[ranks[j - a]] += int(loss[j] != 0)
            want.append(row)
    assert got.tolist() == want
    assert got.sum() == trained_counts(MMapIndexedDataset(str(tmp_path / "m"))).sequence[STORED].sum()


def test_cp_counts_refuse_a_segment_the_trainer_cannot_split(tmp_path):
    rng = np.random.default_rng(6)
    write_shard(str(tmp_path / "u"), packs_with_eos(rng, 5))   # not padded: odd lengths
    ds = MMapIndexedDataset(str(tmp_path / "u"))
    with pytest.raises(ShardError, match=r"not a multiple of 2 \* CP = 4") as err:
        cp_sequence_counts(ds, 2, layout=LAYOUT_BRIDGE, rule=STORED)
    assert err.value.path == ds.prefix and err.value.pack is not None and "--pad-seq-to-mult" in err.value.hint
    assert cp_sequence_counts(ds, 1, layout=LAYOUT_BRIDGE).shape == (trained_counts(ds).num_sequences, 1)


def test_step_table_sums_each_micro_batch_of_each_rank():
    topo = Topology(2, 3, 12)
    rng = np.random.default_rng(0)
    values = rng.integers(0, 100, 40)
    stream = rng.permutation(40)
    table = step_table(stream, values, topo, start=5)   # steps 1 and 2 are whole inside [5, 45)
    want = np.zeros((2, 2, 2), dtype=np.int64)
    step, m, r, _ = where(np.arange(5, 45), topo)
    for t in range(40):
        if 1 <= step[t] <= 2:
            want[step[t] - 1, m[t], r[t]] += values[stream[t]]
    np.testing.assert_array_equal(table, want)


# ------------------------------------------------------------------ the order file, 1.1


def planned(prefix, **kw):
    ds = MMapIndexedDataset(prefix)
    kw.setdefault("trained", trained_counts(ds, eos_id=EOS))
    return plan_order(shard_pack_costs(ds, MODEL), Topology(2, 2, 8), MODEL, seed=9, epochs=3, **kw)


def test_the_order_records_every_steps_denominators_and_reads_them_back(shard, tmp_path):
    order = planned(shard[0])
    order.save(tmp_path / "x.order")
    raw = (tmp_path / "x.order").read_bytes()
    assert struct.unpack_from("<HH", raw, 8) == (1, 1)
    back = Order.load(tmp_path / "x.order")
    for rule in (STORED, BRIDGE_06):
        table = back.step_trained(rule)
        assert table.shape == (22, 2, 2)   # 3 * 60 // 8 complete steps
        want = step_table(order.permutations.reshape(-1), order.trained.pack(rule), order.topology)
        np.testing.assert_array_equal(table, want)
        np.testing.assert_array_equal(back.trained.sequence[rule], order.trained.sequence[rule])
    assert back.trained.eos_id == EOS and back.label_balance is None
    back.check_trained(trained_counts(MMapIndexedDataset(shard[0]), eos_id=EOS))


def test_an_order_without_counts_is_the_same_1_0_file_as_before(shard, tmp_path):
    order = planned(shard[0], trained=None)
    data = order.to_bytes()
    assert struct.unpack_from("<HH", data, 8) == (1, 0)
    meta = json.loads(data[struct.unpack_from("<Q", data, 16)[0]:])
    assert set(meta["arrays"]) == {"permutations", "costs"} and "trained" not in meta
    back = Order.from_bytes(data)
    assert back.trained is None
    with pytest.raises(ShardError, match="records no trained-token counts"):
        back.step_trained(STORED)


def _rewrite(data, edit):
    """The file with its metadata edited by ``edit(meta)`` or arrays by ``edit(body)``, CRCs redone."""
    meta_off, meta_len = struct.unpack_from("<QQ", data, 16)
    meta = json.loads(data[meta_off:meta_off + meta_len])
    body = bytearray(data[HEADER_SIZE:meta_off])
    edit(meta, body, HEADER_SIZE)
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    body = bytes(body) + raw
    head = bytearray(data[:HEADER_SIZE])
    struct.pack_into("<QQQ", head, 16, meta_off, len(raw), meta_off + len(raw))
    struct.pack_into("<I", head, 56, zlib.crc32(body))
    struct.pack_into("<I", head, 60, zlib.crc32(bytes(head[:60])))
    return bytes(head) + body


def test_inconsistent_denominators_are_refused(shard):
    data = planned(shard[0]).to_bytes()

    def bump_step(meta, body, base):   # one recorded step count off by one
        off = meta["arrays"]["trained.stored.steps"][0] - base
        struct.pack_into("<q", body, off, struct.unpack_from("<q", body, off)[0] + 1)

    with pytest.raises(HeaderError, match="recorded steps of step 0 .* are not what its packs' counts give"):
        Order.from_bytes(_rewrite(data, bump_step), "x.order")

    def bad_rules(meta, body, base):
        meta["trained"]["rules"] = ["stored", "everything"]

    with pytest.raises(HeaderError, match="must name known rules"):
        Order.from_bytes(_rewrite(data, bad_rules))

    def no_eos(meta, body, base):
        meta["trained"]["eos_id"] = None

    with pytest.raises(HeaderError, match="eos_id"):
        Order.from_bytes(_rewrite(data, no_eos))

    def negative(meta, body, base):
        struct.pack_into("<i", body, meta["arrays"]["trained.stored.sequences"][0] - base, -1)

    with pytest.raises(HeaderError, match="negative count"):
        Order.from_bytes(_rewrite(data, negative))


def test_counts_of_other_data_are_refused_naming_the_pack(shard, tmp_path):
    order = planned(shard[0])
    rng = np.random.default_rng(3)
    packs = packs_with_eos(rng, 60, pad_mult=4)   # the same packs ...
    ids, loss, starts = packs[17]
    loss = loss.copy()
    j = int(np.flatnonzero(loss == 0)[0])
    if j in set(np.append(starts[1:], len(ids)) - 1):   # (keep the last position of a sequence 0)
        j = int(np.flatnonzero((loss == 0) & ~np.isin(np.arange(len(ids)), np.append(starts[1:], len(ids)) - 1))[0])
    loss[j] = 1                                    # ... but pack 17 trains one more position
    packs[17] = (ids, loss, starts)
    write_shard(str(tmp_path / "b"), packs, metadata={"pad_seq_to_mult": 4})
    with pytest.raises(ShardError, match="pack 17's trained tokens") as err:
        order.check_trained(trained_counts(MMapIndexedDataset(str(tmp_path / "b")), eos_id=EOS), path="x.order")
    assert err.value.pack == 17 and err.value.path == "x.order"
    other = trained_counts(MMapIndexedDataset(str(tmp_path / "b")))
    other.sequence_offsets = other.sequence_offsets[:-1]
    with pytest.raises(ShardError, match="different number of packs"):
        order.check_trained(other)


# ------------------------------------------------------------------ label-balanced steps


def label_shard(tmp_path, n=480, seed=11):
    """Packs whose trained share varies independently of their cost (prompt-heavy and answer-heavy)."""
    rng = np.random.default_rng(seed)
    packs = []
    for _ in range(n):
        ids, loss, starts = random_packs(rng, 1, pack_size=256, max_seqs=int(rng.choice([1, 8])), full=True)[0]
        share = rng.choice([0.1, 0.9])
        loss = (rng.random(len(ids)) < share).astype(np.uint8)
        loss[np.append(starts[1:], len(ids)) - 1] = 0
        packs.append((ids, loss, starts))
    write_shard(str(tmp_path / "l"), packs, pack_size=256)
    return MMapIndexedDataset(str(tmp_path / "l"))


def test_label_balancing_evens_ranks_keeps_membership_and_the_cost_band(tmp_path):
    ds = label_shard(tmp_path)
    counts, costs = trained_counts(ds), shard_pack_costs(ds, QUADRATIC)
    topo = Topology(8, 1, 96)
    plain = plan_order(costs, topo, MODEL, seed=3, epochs=2, trained=counts)
    even = plan_order(costs, topo, MODEL, seed=3, epochs=2, trained=counts, balance_labels=True, label_slack=0.01)
    before, after = (trained_summary(o.step_trained(STORED)) for o in (plain, even))
    assert after["rank_spread_mean"] < before["rank_spread_mean"] / 5, (before, after)
    assert even.stats["trained"]["balanced"] == after and even.label_balance == {"rule": STORED, "slack": 0.01}
    for e in range(2):   # each epoch a permutation, each step the shuffle's packs
        base = base_permutation(480, 3, e)
        assert sorted(even.permutations[e]) == list(range(480))
        for s in range(480 // 96):
            assert set(even.permutations[e][s * 96:(s + 1) * 96]) == set(base[s * 96:(s + 1) * 96])
    shuffled = straggler_report(np.concatenate([base_permutation(480, 3, e) for e in range(2)]), costs, topo).summary
    overhead = straggler_report(even.permutations.reshape(-1), costs, topo).summary
    assert overhead["max"] <= 2 * 0.01 + 1e-9 < shuffled["mean"]   # inside the band; better than the shuffle
    again = plan_order(costs, topo, MODEL, seed=3, epochs=2, trained=counts, balance_labels=True, label_slack=0.01)
    np.testing.assert_array_equal(again.permutations, even.permutations)


def test_label_balancing_with_an_exchange_window_evens_the_steps(tmp_path):
    ds = label_shard(tmp_path)
    counts, costs = trained_counts(ds), shard_pack_costs(ds, MODEL)
    topo = Topology(4, 2, 32)
    plain = plan_order(costs, topo, MODEL, seed=3, trained=counts, exchange_window=15)
    even = plan_order(costs, topo, MODEL, seed=3, trained=counts, exchange_window=15, balance_labels=True,
                      label_slack=0.01)
    before, after = (trained_summary(o.step_trained(STORED)) for o in (plain, even))
    assert after["step_cv"] < before["step_cv"] / 3, (before, after)
    assert after["microbatch_spread_mean"] < before["microbatch_spread_mean"], (before, after)
    assert sorted(even.permutations[0]) == list(range(480))


@pytest.mark.parametrize("kwargs, match", [
    (dict(balance_labels=True, trained=None), "needs the data's trained-token counts"),
    (dict(balance_labels=True, algorithm="shuffle"), "needs a balancing algorithm"),
    (dict(balance_labels=True, label_slack=-1.0), "label_slack"),
])
def test_label_balancing_refuses_what_it_cannot_do(shard, kwargs, match):
    with pytest.raises(ShardError, match=match):
        planned(shard[0], **kwargs)


def test_counts_of_another_pack_count_are_refused(shard):
    counts = trained_counts(MMapIndexedDataset(shard[0]))
    with pytest.raises(ShardError, match="another number of packs"):
        plan_order(np.ones(59), Topology(2, 2, 8), MODEL, seed=1, trained=counts)
