"""The plan of a mixture over several stores (preprocess/mixplan.py), on real stores of the bundled
examples: per split each source realises its share within one sequence, the splits stay disjoint,
the plan is a function of the mixture and the seed, and the checks refuse what cannot be mixed."""

import json
import os
import shutil

import numpy as np
import pytest

from megatron_sft_idx.errors import HeaderError, IncompatibleShardsError, ShardError
from megatron_sft_idx.packing import fill_sequences
from megatron_sft_idx.preprocess.config import PackSettings
from megatron_sft_idx.errors import InfeasibleMixtureError
from megatron_sft_idx.preprocess.mixplan import trained_after_cut, write_mix_plan
from megatron_sft_idx.preprocess.mixture import parse_mixture
from megatron_sft_idx.preprocess.planfile import PackPlan
from megatron_sft_idx.preprocess.plan import load_kept
from megatron_sft_idx.preprocess.store import SequenceStore
from megatron_sft_idx.preprocess.stores import StoreSet

from support.stages import CHAT, preprocess


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Three stores: the chat examples, the ShareGPT examples, and the chat examples tokenized with
    tool calls masked (another loss policy)."""
    d = tmp_path_factory.mktemp("mixstores")
    preprocess(str(d / "o1"), inputs=[CHAT[0]], store=str(d / "chat"), partition_bytes=40_000)
    preprocess(str(d / "o2"), inputs=[CHAT[1]], store=str(d / "share"))
    preprocess(str(d / "o3"), inputs=[CHAT[1]], store=str(d / "masked"), tool_call_loss="mask")
    return {n: str(d / n) for n in ("chat", "share", "masked")}


def mixture(tmp_path, sources, **top):
    doc = dict({"version": 1, "sources": sources}, **top)
    return parse_mixture(doc, str(tmp_path / "mix.json"))


def settings(**kw):
    kw.setdefault("pack_size", 1024)
    return PackSettings(**kw).plan_settings(1024)


def plan(tmp_path, stores, names, mix, s, name="m.plan"):
    st = StoreSet([SequenceStore(stores[n]) for n in names], names)
    meta = write_mix_plan(st, mix, s, str(tmp_path / name))
    return st, meta, PackPlan(str(tmp_path / name))


def per_source(p: PackPlan, i: int, count: int) -> np.ndarray:
    return np.asarray(p.arrays(i)["pack_measures"]).reshape(-1, count).sum(axis=0)


@pytest.mark.parametrize("unit", ["trained_tokens", "tokens", "sequences"])
def test_each_split_realises_the_shares_within_one_sequence(tmp_path, stores, unit):
    mix = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1},
                             {"name": "share", "store": stores["share"], "weight": 3}], unit=unit)
    st, meta, p = plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(80, 20)))
    p.validate(st)
    for i, split in enumerate(meta["splits"]):
        got = per_source(p, i, 2).astype(np.float64)   # what the packs hold, from the packs themselves
        assert got.tolist() == [s["amount"] for s in split["sources"]]
        total = got.sum()
        # one sequence of each source: its largest measure in the split
        one = [max(s["epoch_amount"] / max(s["members"], 1), 1.0) for s in split["sources"]]
        biggest = _largest_measure(st, settings(split=(80, 20)), unit)
        assert abs(got[0] - total * 0.25) <= biggest[0] + biggest[1] and abs(got[1] - total * 0.75) <= sum(biggest)
        assert max(split["sources"][1]["target_epochs"], split["sources"][0]["target_epochs"]) == pytest.approx(1.0)
        assert one[0] > 0


def _largest_measure(st, s, unit):
    out = []
    for store in st.stores:
        kept = load_kept(store, s)
        m = {"trained_tokens": trained_after_cut(store, s, kept.dropped), "tokens": kept.padded,
             "sequences": np.ones(1)}[unit]
        out.append(float(m.max()))
    return out


def test_the_plan_is_a_function_of_the_mixture_and_seed(tmp_path, stores):
    mix = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 2},
                             {"name": "share", "store": stores["share"], "weight": 1, "max_epochs": 3}], total=20000)
    plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(90, 10)), "a.plan")
    plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(90, 10)), "b.plan")
    assert (tmp_path / "a.plan").read_bytes() == (tmp_path / "b.plan").read_bytes()
    plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(90, 10), seed=7), "c.plan")
    assert (tmp_path / "a.plan").read_bytes() != (tmp_path / "c.plan").read_bytes()


def test_a_source_upsampled_repeats_whole_epochs_and_splits_stay_disjoint(tmp_path, stores):
    mix = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1},
                             {"name": "share", "store": stores["share"], "weight": 1, "max_epochs": 4}])
    st, meta, p = plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(80, 20)))
    share = meta["splits"][0]["sources"][1]
    assert 1 < share["target_epochs"] <= 4 and share["sequences"] >= share["members"]
    ids = np.asarray(p.arrays(0)["sequence_ids"])
    share_ids = ids[ids >= st.offsets[1]]
    counts = np.bincount(share_ids - st.offsets[1])
    assert counts.max() - counts[counts > 0].min() <= 1   # whole epochs, then each remainder sequence once more
    valid = set(np.asarray(p.arrays(1)["sequence_ids"]).tolist())
    assert not valid & set(ids.tolist())


def test_adding_a_source_leaves_the_other_sources_splits_unchanged(tmp_path, stores):
    two = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1}], unit="epochs")
    three = mixture(tmp_path, [{"name": "share", "store": stores["share"], "weight": 1},
                               {"name": "chat", "store": stores["chat"], "weight": 1}], unit="epochs")
    s = settings(split=(80, 20))
    st2, _, p2 = plan(tmp_path, stores, ["chat"], two, s, "two.plan")
    st3, _, p3 = plan(tmp_path, stores, ["share", "chat"], three, s, "three.plan")
    for i in range(2):
        a = np.sort(np.asarray(p2.arrays(i)["sequence_ids"]))
        b = np.asarray(p3.arrays(i)["sequence_ids"])
        b = np.sort(b[b >= st3.offsets[1]] - st3.offsets[1])
        assert np.array_equal(a, b)   # chat's split (and its epochs' sequences) whatever else is mixed


def test_trained_tokens_after_a_cut_are_what_the_packs_train(tmp_path, stores):
    for drop in ("keep", "drop"):
        s = settings(pack_size=160, truncated_turn_loss=drop)
        store = SequenceStore(stores["chat"])
        kept = load_kept(store, s)
        counted = trained_after_cut(store, s, kept.dropped)
        # the packs' own rule (fill_sequences), sequence by sequence
        want, k0 = [], 0
        for k in range(len(store.partitions)):
            ds, rows = store.part(k), store.rows(k)
            keep = np.ones(rows.size, bool)
            keep[[g - k0 for g in kept.dropped if k0 <= g < k0 + rows.size]] = False
            for j in np.flatnonzero(keep):
                pack = ds[int(j)]
                n = min(len(pack.input_ids), s.truncate_to)
                ids, mask = np.zeros(n, np.int64), np.zeros(n, np.uint8)
                fill_sequences(ids, mask, np.zeros(1, np.int64), np.asarray(pack.input_ids, np.int64),
                               np.asarray(pack.loss_mask), np.zeros(1, np.int64), np.array([n]),
                               np.array([len(pack.input_ids)]), drop == "drop")
                want.append(int(mask.sum()))
            k0 += rows.size
        assert counted.tolist() == want and (np.asarray(want) < np.asarray(
            [int(x) for x in kept.padded])).all()


def test_a_store_made_before_trained_counts_plans_the_same(tmp_path, stores):
    old = str(tmp_path / "old")
    shutil.copytree(stores["share"], old)
    receipts = os.path.join(old, "receipts", "tokenize")
    for name in os.listdir(receipts):   # as a store written before .trained: no file, no receipt entry
        path = os.path.join(receipts, name)
        r = json.load(open(path))
        for key in ("artifacts", "crc32"):
            r[key] = {k: v for k, v in r[key].items() if not k.endswith(".trained")}
        json.dump(r, open(path, "w"))
    for name in os.listdir(os.path.join(old, "parts")):
        if name.endswith(".trained"):
            os.unlink(os.path.join(old, "parts", name))
    SequenceStore(old).verify()
    mix = mixture(tmp_path, [{"name": "share", "store": stores["share"], "weight": 1}])
    plan(tmp_path, stores, ["share"], mix, settings(), "new.plan")
    plan(tmp_path, dict(stores, share=old), ["share"], mix, settings(), "old.plan")
    assert (tmp_path / "new.plan").read_bytes() == (tmp_path / "old.plan").read_bytes()


def test_stores_of_another_loss_policy_are_refused_by_name(tmp_path, stores):
    with pytest.raises(IncompatibleShardsError, match="sources 'chat' and 'masked' cannot be mixed.*loss_policy"):
        StoreSet([SequenceStore(stores["chat"]), SequenceStore(stores["masked"])], ["chat", "masked"])


def test_a_source_empty_after_filtering_and_infeasible_caps_are_refused(tmp_path, stores):
    mix = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1},
                             {"name": "share", "store": stores["share"], "weight": 1}])
    with pytest.raises(ShardError, match="source 'share' is empty after filtering"):   # every ShareGPT one overlong
        plan(tmp_path, stores, ["chat", "share"], mix, settings(pack_size=45, overlong="drop"))
    assert not (tmp_path / "m.plan").exists()
    capped = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1},
                                {"name": "share", "store": stores["share"], "weight": 1, "max_epochs": 2}],
                     total=10 ** 9)
    with pytest.raises(InfeasibleMixtureError, match="largest total the caps allow"):
        plan(tmp_path, stores, ["chat", "share"], capped, settings())
    assert not (tmp_path / "m.plan").exists()


def test_a_plan_of_other_stores_or_with_a_sequence_in_two_splits_is_refused(tmp_path, stores):
    mix = mixture(tmp_path, [{"name": "chat", "store": stores["chat"], "weight": 1},
                             {"name": "share", "store": stores["share"], "weight": 1}])
    st, meta, p = plan(tmp_path, stores, ["chat", "share"], mix, settings(split=(50, 50)))
    other = StoreSet([SequenceStore(stores["share"]), SequenceStore(stores["chat"])], ["share", "chat"])
    with pytest.raises(HeaderError, match="other sequence stores"):
        p.validate(other)
    # a valid sequence written over a train one of the same source and length, ascending kept: only
    # the rule that a sequence lives in one split can tell
    s = settings(split=(50, 50))
    padded = np.concatenate([_all_padded(x, s) for x in st.stores])
    a0, a1 = np.asarray(p.arrays(0)["sequence_ids"]), np.asarray(p.arrays(1)["sequence_ids"])
    offsets = np.asarray(p.arrays(0)["pack_offsets"])
    src = st.source_of(a1)
    swap = None
    for j in range(a0.size):
        pack = int(np.searchsorted(offsets, j, side="right") - 1)
        lo = a0[j - 1] if j > offsets[pack] else -1
        hi = a0[j + 1] if j + 1 < offsets[pack + 1] else 1 << 40
        same = np.flatnonzero((padded[a1] == padded[a0[j]]) & (src == st.source_of([a0[j]])[0])
                              & (a1 >= lo) & (a1 <= hi))
        if same.size:
            swap = (j, int(a1[same[0]]))
            break
    assert swap is not None
    raw = bytearray((tmp_path / "m.plan").read_bytes())
    at = meta["splits"][0]["arrays"]["sequence_ids"][0] + swap[0] * a0.dtype.itemsize
    raw[at:at + a0.dtype.itemsize] = np.asarray([swap[1]], a0.dtype).tobytes()
    (tmp_path / "bad.plan").write_bytes(bytes(raw))
    with pytest.raises(HeaderError, match="planned in two splits"):
        PackPlan(str(tmp_path / "bad.plan"), verify=False).validate(st)


def _all_padded(store, s):
    """Every store sequence's padded length (-1 for one the settings drop), store order."""
    kept = load_kept(store, s)
    out = np.full(store.sequence_count, -1, np.int64)
    keep = np.ones(store.sequence_count, bool)
    keep[kept.dropped] = False
    out[keep] = kept.padded
    return out
