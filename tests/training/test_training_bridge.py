"""Megatron-Bridge packed interface: dataset semantics and the vectorised collate."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.training.bridge import PackedSFTDataset, build_samples_mapping, bridge_datasets
from megatron_sft_idx.training.collate import PackedCollator

PACK = 64
PAD = 0


def cp_padded_pack(rng, mult, pack_size=PACK, max_seqs=6):
    """A pack whose sequences end in alignment padding (PAD = EOS tokens, zero loss) so that each
    runtime segment (stored length minus one: Megatron-Bridge's layout) is a multiple."""
    ids, loss, starts = [], [], [0]
    while True:
        real = int(rng.integers(2, 20))
        total = -(-(real - 1) // mult) * mult + 1
        if starts[-1] + total > pack_size or len(starts) > max_seqs:
            break
        seq = rng.integers(1, 1000, real)  # never PAD: alignment padding is the only EOS
        mask = rng.integers(0, 2, real)
        mask[-1] = 0
        ids += list(seq) + [PAD] * (total - real)
        loss += list(mask) + [0] * (total - real)
        starts.append(starts[-1] + total)
    starts = starts[:-1] or [0]
    if not ids:
        ids, loss = [5] * (mult + 1), [0] * (mult + 1)
    return np.array(ids), np.array(loss, dtype=np.uint8), np.array(starts)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("bridge") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(11), 40, pack_size=PACK))
    return prefix


@pytest.fixture(scope="module")
def cp_shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("bridge_cp") / "s")
    rng = np.random.default_rng(12)
    write_shard(prefix, [cp_padded_pack(rng, 4) for _ in range(30)],
                metadata={"pad_seq_to_mult": 4, "pad_layout": "runtime"})
    return prefix


def assert_batches_equal(a, b):
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# --------------------------------------------------------------------------- dataset


def test_getitem_is_bridges_packed_sample(shard):
    ds = PackedSFTDataset(shard)
    item = ds[3]
    assert set(item) == {"input_ids", "seq_boundaries", "loss_mask"}
    pack = ds.source[3]
    np.testing.assert_array_equal(item["seq_boundaries"], np.append(pack.seq_start_id, pack.packed_len))
    assert len(ds) == 40 and ds.max_seq_length == PACK


def test_negative_index_is_a_zero_loss_padding_sample(shard):
    ds = PackedSFTDataset(shard, max_num_samples=100)
    pad = ds[-1]
    real = ds.source[int(ds.samples_mapping[-1])]
    np.testing.assert_array_equal(pad["input_ids"], real.input_ids)
    assert real.loss_mask.any() and not pad["loss_mask"].any()
    assert int(ds.collate_fn([pad])["loss_mask"].sum()) == 0


def test_samples_mapping_is_epoch_level_shuffle():
    mapping = build_samples_mapping(10, 25, seed=3)
    assert mapping.shape == (25,)
    assert sorted(mapping[:10]) == list(range(10)) and sorted(mapping[10:20]) == list(range(10))
    assert set(mapping[20:]) <= set(range(10)) and len(set(mapping[20:])) == 5
    np.testing.assert_array_equal(mapping, build_samples_mapping(10, 25, seed=3))
    assert not np.array_equal(mapping, build_samples_mapping(10, 25, seed=4))


def test_exact_resume_with_samples_mapping(shard):
    k = 37
    run = PackedSFTDataset(shard, max_num_samples=120, seed=9, pad_to_max_length=True)
    continuous = [run.collate_fn([run[i], run[i + 1]]) for i in range(k, 100, 2)]
    restarted = PackedSFTDataset(shard, max_num_samples=120, seed=9, pad_to_max_length=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(restarted, range(k, 101)), batch_size=2,
                                         collate_fn=restarted.collate_fn, num_workers=2)
    for a, b in zip(continuous, loader):
        assert_batches_equal(a, b)


def test_bridge_datasets_from_a_build_context(shard):
    class Tok:
        eos_id = 7

    ctx = type("Ctx", (), {"train_samples": 50, "valid_samples": 5, "test_samples": 0, "tokenizer": Tok()})
    train, valid, test = bridge_datasets(ctx(), train=shard, valid=shard, test=shard)
    assert len(train) == 50 and len(valid) == 5 and test is None
    assert train.collate_fn.eos_id == 7


# --------------------------------------------------------------------------- collate


OPTIONS = st.fixed_dictionaries({
    "pad_to_max_length": st.booleans(),
    "pad_cu_seqlens": st.booleans(),
    "batch": st.integers(1, 5),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=40, deadline=None)
@given(opts=OPTIONS, cp=st.booleans())
def test_collate_keeps_every_boundary_and_position(shard, cp_shard, opts, cp):
    """Exact equality with Megatron-Bridge's own collate is tests/compat/test_bridge_parity.py;
    here: the layout invariants on random batches of random shards."""
    ds = PackedSFTDataset(cp_shard if cp else shard, eos_id=PAD,
                          pad_to_max_length=opts["pad_to_max_length"] or opts["pad_cu_seqlens"],
                          pad_cu_seqlens=opts["pad_cu_seqlens"])
    rng = np.random.default_rng(opts["seed"])
    batch = [ds[int(i)] for i in rng.integers(-len(ds), len(ds), opts["batch"])]
    out = ds.collate_fn(batch)
    assert "padding_mask" not in out and "pad_between_seqs" not in out  # Bridge 0.6.2 returns neither
    check_batch(batch, out)


def check_batch(batch, out):
    """Attention, positions and loss never cross a sequence boundary or touch padding."""
    cu = out.get("cu_seqlens_q_padded", out["cu_seqlens_q"]).numpy()
    logical = out["cu_seqlens_q"].numpy()
    for b, item in enumerate(batch):
        bnd = np.asarray(item["seq_boundaries"])
        ids = np.asarray(item["input_ids"])
        seg = np.diff(bnd) - 1
        phys = np.concatenate(([0], np.cumsum(seg)))
        # Every sequence boundary is a cu_seqlens boundary: no segment spans two sequences.
        assert set(phys.tolist()) <= set(cu[b].tolist())
        assert (np.diff(cu[b]) >= 0).all() and (np.diff(logical[b]) >= 0).all()
        tokens, labels = out["tokens"][b].numpy(), out["labels"][b].numpy()
        pos, loss = out["position_ids"][b].numpy(), out["loss_mask"][b].numpy()
        for k in range(len(seg)):
            lo, hi = phys[k], phys[k + 1]
            np.testing.assert_array_equal(tokens[lo:hi], ids[bnd[k]:bnd[k + 1] - 1])
            np.testing.assert_array_equal(labels[lo:hi], ids[bnd[k] + 1:bnd[k + 1]])
            np.testing.assert_array_equal(pos[lo:hi], np.arange(hi - lo))  # restart per sequence
        assert not loss[tokens == PAD].any()  # Bridge: no loss where the input is EOS (= padding)
        assert not loss[phys[-1]:].any() and (pos[phys[-1]:] == 0).all()


def test_padded_sequences_get_logical_and_physical_boundaries(cp_shard):
    ds = PackedSFTDataset(cp_shard, eos_id=PAD, pad_to_max_length=True)
    assert ds.summary.pad_seq_to_mult == 4 and ds.collate_fn.pad_seq_to_mult == 4
    out = ds.collate_fn([ds[0], ds[1]])
    logical, phys = out["cu_seqlens_q"], out["cu_seqlens_q_padded"]
    assert (np.diff(phys.numpy()[:, :-1]) % 4 == 0).all()  # runtime segments are the multiple
    assert (np.diff(logical.numpy()) <= np.diff(phys.numpy())).all()
    # A logical segment ends at its sequence's last non-EOS input token.
    for b in range(2):
        tokens = out["tokens"][b].numpy()
        for lo, hi, n in zip(phys[b, :-1].tolist(), phys[b, 1:].tolist(), np.diff(logical[b].numpy()).tolist()):
            real = np.flatnonzero(tokens[lo:hi] != PAD)
            assert n == (real[-1] + 1 if real.size else 0)


def test_pad_cu_seqlens_has_a_static_shape_from_metadata(shard):
    ds = PackedSFTDataset(shard, pad_to_max_length=True, pad_cu_seqlens=True)
    width = ds.summary.max_samples_per_bin + 2
    shapes = {tuple(ds.collate_fn([ds[i], ds[i + 1]])["cu_seqlens_q"].shape) for i in range(0, 38, 2)}
    assert shapes == {(2, width)}
    out = ds.collate_fn([ds[0]])
    assert out["max_seqlen_q"].shape == (1,)
    assert int(out["max_seqlen_q"][0]) >= int((out["cu_seqlens_q"][0, 1:] - out["cu_seqlens_q"][0, :-1]).max())


def test_batch_keys_and_dtypes(shard):
    ds = PackedSFTDataset(shard)
    out = ds.collate_fn([ds[0], ds[5]])
    assert out["attention_mask"] is None
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert out[key].dtype == torch.int64
    for key in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"):
        assert out[key].dtype == torch.int32
    assert out["tokens"].shape[1] % 16 == 0 and "padding_mask" not in out
    assert out["token_count"] == [ds.source[0].packed_len - len(ds.source[0].seq_start_id),
                                  ds.source[5].packed_len - len(ds.source[5].seq_start_id)]
    assert "cu_seqlens_q_padded" not in out
    dense = PackedSFTDataset(shard, return_cu_seqlen=False).collate_fn([ds[0]])
    assert dense["attention_mask"].shape == (1, 1, dense["tokens"].shape[1], dense["tokens"].shape[1])


def test_collator_refuses_bad_options_and_long_packs(shard):
    with pytest.raises(ShardError, match="pad_to_max_length"):
        PackedSFTDataset(shard, pad_cu_seqlens=True)
    with pytest.raises(ShardError, match="statistics"):
        PackedCollator(64, eos_id=0, pad_to_max_length=True, pad_cu_seqlens=True)
    ds = PackedSFTDataset(shard, max_seq_length=8, pad_to_max_length=True)
    longest = int(np.argmax([p.packed_len - len(p.seq_start_id) for p in ds.source[0:40]]))
    with pytest.raises(ShardError, match="longer than max_seq_length"):
        ds.collate_fn([ds[longest]])


def test_bridge_semantics_is_checked_and_defaults_to_the_installed_bridge():
    from megatron_sft_idx.training.collate import installed_bridge_semantics, resolve_bridge_semantics

    with pytest.raises(ShardError, match="bridge_semantics"):
        PackedCollator(64, eos_id=0, bridge_semantics="0.7")
    assert resolve_bridge_semantics(None) == installed_bridge_semantics()
    assert PackedCollator(64, eos_id=0, bridge_semantics="next").bridge_semantics == "next"
    assert PackedCollator(64, eos_id=0, bridge_semantics="pr5610").bridge_semantics == "pr5610"
    with pytest.raises(ShardError, match="pr5610"):  # the error names every mode
        PackedCollator(64, eos_id=0, bridge_semantics="PR5610")


@pytest.mark.parametrize("version,expected", [("0.6.2", "0.6"), ("0.7.0rc1", "next"), ("0.8.1", "next")])
def test_auto_detection_never_picks_pr5610(monkeypatch, version, expected):
    from importlib import metadata

    from megatron_sft_idx.training.collate import installed_bridge_semantics

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: version if name == "megatron-bridge" else real(name))
    assert installed_bridge_semantics() == expected


def test_pr5610_keeps_a_supervised_terminal_eos_and_says_pad_between_seqs():
    """PR #5610's head: with pad_seq_to_mult > 1 the logical length stops at the last input that is not
    a zero-loss EOS; pad_between_seqs (a bool) says whether any logical boundary is not the physical one."""
    # two sequences, runtime segments of 4: [5 6 7 EOS(loss 1)] and [8 EOS(loss 0) EOS(loss 0) EOS(loss 0)]
    ids = np.array([5, 6, 7, PAD, PAD, 8, PAD, PAD, PAD, PAD])
    loss = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0], dtype=np.uint8)
    item = {"input_ids": ids, "loss_mask": loss, "seq_boundaries": np.array([0, 5, 10])}
    opts = dict(eos_id=PAD, pad_seq_to_mult=4, pad_to_max_length=True)
    nxt = PackedCollator(8, bridge_semantics="next", **opts)([item])
    pr = PackedCollator(8, bridge_semantics="pr5610", **opts)([item])
    assert "pad_between_seqs" not in nxt
    assert nxt["cu_seqlens_q"].tolist() == [[0, 3, 4]] and pr["cu_seqlens_q"].tolist() == [[0, 4, 5]]
    assert pr["cu_seqlens_q_padded"].tolist() == nxt["cu_seqlens_q_padded"].tolist() == [[0, 4, 8]]
    assert pr["padding_mask"][0].tolist() == [False] * 5 + [True] * 3
    assert pr["pad_between_seqs"] is True
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(pr[key], nxt[key]), key
    # only the supervised sequence: logical == physical, so False; padding samples (loss 0) drop the EOS
    alone = {"input_ids": ids[:5], "loss_mask": loss[:5], "seq_boundaries": np.array([0, 5])}
    out = PackedCollator(4, bridge_semantics="pr5610", **opts)([alone])
    assert out["cu_seqlens_q"].tolist() == [[0, 4]] and out["pad_between_seqs"] is False
    padding = dict(alone, loss_mask=np.zeros(5, dtype=np.uint8))
    out = PackedCollator(4, bridge_semantics="pr5610", **opts)([padding])
    assert out["cu_seqlens_q"].tolist() == [[0, 3]] and out["pad_between_seqs"] is True
    # without context parallelism the key is there and False, even over trailing padding
    flat = PackedCollator(16, eos_id=PAD, bridge_semantics="pr5610")([item])
    assert flat["pad_between_seqs"] is False and "cu_seqlens_q_padded" not in flat


def test_next_semantics_keep_the_stored_loss_at_eos_inputs(shard):
    """Bridge main (#5213) trains a stored 1 at an EOS input under answer_only_loss; 0.6 zeroes it;
    answer_only_loss=False zeroes it under both. padding_mask (#5470) marks the padding."""
    ids = np.array([5, PAD, 6, 7, 8, 9])
    loss = np.array([1, 1, 1, 0, 1, 0], dtype=np.uint8)
    item = {"input_ids": ids, "loss_mask": loss, "seq_boundaries": np.array([0, 4, 6])}
    old = PackedCollator(16, eos_id=PAD, bridge_semantics="0.6")([item])
    new = PackedCollator(16, eos_id=PAD, bridge_semantics="next")([item])
    assert old["loss_mask"][0, :4].tolist() == [1, 0, 1, 1]
    assert new["loss_mask"][0, :4].tolist() == [1, 1, 1, 1]
    assert "padding_mask" not in old
    assert new["padding_mask"].dtype == torch.bool and new["padding_mask"][0].tolist() == [False] * 4 + [True] * 12
    full = PackedCollator(16, eos_id=PAD, bridge_semantics="next", answer_only_loss=False)([item])
    assert full["loss_mask"][0, :4].tolist() == [1, 0, 1, 1]


def test_a_shard_converted_with_06_normalisation_warns_under_next(tmp_path):
    from megatron_sft_idx.training.bridge import ConvertedLossWarning

    packs = random_packs(np.random.default_rng(3), 4, pack_size=PACK)
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    write_shard(old, packs, metadata={"source": {"converted_from": {"format": "npy", "path": "/x.npy"}}})
    write_shard(new, packs, metadata={"source": {"converted_from": {"format": "npy", "path": "/x.npy",
                                                                    "loss_mask": "as_written"}}})
    for semantics in ("next", "pr5610"):
        with pytest.warns(ConvertedLossWarning, match=f"bridge_semantics='{semantics}'.*re-convert"):
            PackedSFTDataset(old, eos_id=PAD, bridge_semantics=semantics)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvertedLossWarning)
        PackedSFTDataset(old, eos_id=PAD, bridge_semantics="0.6")
        PackedSFTDataset(new, eos_id=PAD, bridge_semantics="next")
