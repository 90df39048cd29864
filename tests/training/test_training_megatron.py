"""megatron-core integration: SFTIndexedDataset through the real BlendedMegatronDatasetBuilder."""

import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from support.shardgen import random_pack, random_packs, write_shard

from megatron_sft_idx.errors import IncompatibleShardsError, ShardError, ShardSetError
from megatron_sft_idx.reader import MMapIndexedDataset

# megatron-core costs seconds to import: once per module.
mc_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: E402

from megatron_sft_idx.training import megatron as M  # noqa: E402
from megatron_sft_idx.publishing import write_manifest  # noqa: E402

SEQ = 64


def build(config, sizes):
    return mc_builder.BlendedMegatronDatasetBuilder(
        M.SFTIndexedDataset, sizes, lambda: True, config).build()


def make_config(**kw):
    kw.setdefault("random_seed", 1234)
    kw.setdefault("sequence_length", SEQ)
    return M.SFTIndexedDatasetConfig(**kw)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("mshards")
    rng = np.random.default_rng(7)
    out = {}
    for name, n in (("a", 300), ("b", 200)):
        out[name] = str(root / name)
        write_shard(out[name], random_packs(rng, n, pack_size=SEQ))
    return out


@pytest.fixture
def dist(tmp_path):
    """A one-process gloo group: upstream's BlendedDataset cache path calls get_rank()."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- data_path


def test_parse_data_path_forms():
    assert M.parse_data_path("0.7 /d/a 0.3 /d/b") == (["/d/a", "/d/b"], [0.7, 0.3])
    assert M.parse_data_path(["0.7", "/d/a", "0.3", "/d/b"]) == (["/d/a", "/d/b"], [0.7, 0.3])
    assert M.parse_data_path("/d/a /d/b") == (["/d/a", "/d/b"], None)
    assert M.parse_data_path(None) is None
    blends = M.parse_per_split_data_path("1 /t", None, "/x /y")
    assert blends == [(["/t"], [1.0]), None, (["/x", "/y"], None)]


@pytest.mark.parametrize("spec", ["0.7 /d/a /d/b", "0.7 /d/a 0.3", "0 /d/a", "-1 /d/a 2 /d/b", "", "nan /d/a"])
def test_parse_data_path_refuses(spec):
    with pytest.raises(ShardError, match="data_path|weights"):
        M.parse_data_path(spec)


# --------------------------------------------------------------------------- builder


def test_blend_and_split_build_with_real_builder(shards):
    blend = M.parse_data_path(f"0.7 {shards['a']} 0.3 {shards['b']}")
    train, valid, test = build(make_config(blend=blend, split="98,1,1"), [400, 20, 20])
    assert isinstance(train, BlendedDataset) and len(train) == 400
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert abs((ids == 0).mean() - 0.7) < 0.02  # upstream's blending follows the weights
    for ds in (train, valid, test):
        sample = ds[len(ds) - 1]
        assert sample["tokens"].shape == (SEQ,) and sample["cu_seqlens"].shape == (SEQ + 1,)
    # The split is by pack: valid draws only from packs outside train's range.
    mid = train.datasets[0]
    assert mid.indices.max() < 294 and valid.datasets[0].indices.min() >= 294


def test_single_prefix_without_distributed(shards):
    train, valid, test = build(make_config(blend=([shards["a"]], None), split="90,10,0"), [50, 5, None])
    assert isinstance(train, M.SFTIndexedDataset) and len(train) == 50
    assert test is None and len(valid) == 5


def test_cache_is_written_then_reused(shards, tmp_path, dist, monkeypatch):
    cache = tmp_path / "cache"
    config = make_config(blend=M.parse_data_path(f"0.7 {shards['a']} 0.3 {shards['b']}"), split="98,1,1",
                         path_to_cache=str(cache))
    first = build(config, [300, 10, 10])
    files = sorted(os.listdir(cache))
    assert any(f.endswith("SFTIndexedDataset-train-sample_index.npy") for f in files)
    assert any(f.endswith("BlendedDataset-train-dataset_index.npy") for f in files)
    # Second build: every index comes from the cache (computing one would raise).
    monkeypatch.setattr(M.SFTIndexedDataset, "_compute_sample_index",
                        lambda self: (_ for _ in ()).throw(AssertionError("cache miss")))
    second = build(config, [300, 10, 10])
    assert sorted(os.listdir(cache)) == files
    for i in (0, 1, 150, 299):
        for key in ("tokens", "labels", "loss_mask", "cu_seqlens"):
            assert torch.equal(first[0][i][key], second[0][i][key])
    # Cached sample indexes are memory-mapped, and a worker gets the path, not a copy.
    mid = second[0].datasets[0]
    assert isinstance(mid.sample_index, np.memmap)
    clone = pickle.loads(pickle.dumps(mid))
    assert torch.equal(clone[5]["tokens"], mid[5]["tokens"])


def test_per_split_blends(shards):
    config = make_config(blend_per_split=M.parse_per_split_data_path(
        f"0.5 {shards['a']} 0.5 {shards['b']}", shards["b"], None))
    train, valid, test = build(config, [100, 30, 0])
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert isinstance(valid, M.SFTIndexedDataset) and len(valid) == 30 and test is None
    assert valid.dataset_path == shards["b"]


def test_hundreds_of_shards_and_a_manifest(tmp_path):
    rng = np.random.default_rng(3)
    prefixes = []
    for k in range(120):
        prefixes.append(str(tmp_path / f"s{k:03d}"))
        write_shard(prefixes[-1], random_packs(rng, 3, pack_size=SEQ))
    manifest = str(tmp_path / "all.json")
    write_manifest(manifest, prefixes[60:])
    spec = " ".join(f"1 {p}" for p in prefixes[:60]) + f" 60 {manifest}"
    # Many tiny datasets: upstream blending needs more than its default 0.5% surplus.
    config = make_config(blend=M.parse_data_path(spec), split="100,0,0", mid_level_dataset_surplus=0.2)
    train, _, _ = build(config, [500, 0, 0])
    assert len(train.datasets) == 61 and len(train) >= 500  # upstream rounds each share up
    seen = {int(train[i]["dataset_id"]) for i in range(len(train))}
    assert len(seen) == 61


# --------------------------------------------------------------------------- refusals


def test_refuses_pack_size_beyond_sequence_length(shards):
    with pytest.raises(ShardError, match="pack size exceeds") as info:
        build(make_config(blend=([shards["a"]], None), split="1,0,0", sequence_length=32), [10, 0, 0])
    assert info.value.path == shards["a"] and info.value.field == "pack_size"


def test_refuses_pad_multiple_not_fitting_context_parallel(tmp_path):
    rng = np.random.default_rng(0)
    ok, bad = str(tmp_path / "ok"), str(tmp_path / "bad")
    write_shard(ok, random_packs(rng, 20, pack_size=SEQ, pad_mult=8), metadata={"pad_seq_to_mult": 8})
    write_shard(bad, random_packs(rng, 20, pack_size=SEQ, pad_mult=2), metadata={"pad_seq_to_mult": 2})
    train, _, _ = build(make_config(blend=([ok], None), split="1,0,0", context_parallel_size=2),
                        [10, 0, 0])
    starts = train[0]["cu_seqlens"]
    assert (starts % 4 == 0).all()
    with pytest.raises(ShardError, match="padded to multiples of 2") as info:
        build(make_config(blend=([bad], None), split="1,0,0", context_parallel_size=2), [10, 0, 0])
    assert info.value.path == bad and info.value.field == "pad_seq_to_mult"
    with pytest.raises(ShardError, match="padded to multiples of 2"):  # CP=2 with SP=2 needs 8
        build(make_config(blend=([str(tmp_path / "bad")], None), split="1,0,0",
                          context_parallel_size=2, sequence_parallel_size=2), [10, 0, 0])
    with pytest.raises(ShardError, match="sequence_length is not a multiple"):
        build(make_config(blend=([ok], None), split="1,0,0", context_parallel_size=4,
                          sequence_length=68), [10, 0, 0])


# --------------------------------------------------------------------------- sample layout


def check_sample(sample, pack, seq_len):
    """Megatron-LM's packed SFT contract, checked against the stored pack."""
    ids, loss, starts = (np.asarray(pack.input_ids, np.int64), np.asarray(pack.loss_mask),
                         np.asarray(pack.seq_start_id, np.int64))
    n = ids.shape[0]
    tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
    lm, pos, cu = sample["loss_mask"].numpy(), sample["position_ids"].numpy(), sample["cu_seqlens"].numpy()
    assert tokens.shape == labels.shape == lm.shape == pos.shape == (seq_len,)
    assert lm.dtype == np.float32 and cu.dtype == np.int32 and cu.shape == (seq_len + 1,)
    np.testing.assert_array_equal(tokens[:n], ids)
    k = starts.shape[0]
    np.testing.assert_array_equal(cu[:k], starts)
    assert (cu[k:] == seq_len).all()  # fixed length: trailing zero-length segments
    bounds = np.append(starts, seq_len)
    assert int(sample["max_seqlen"]) == np.diff(bounds).max()
    # Loss never on padding, never on a label that belongs to another sequence.
    assert (lm[n - 1:] == 0).all()
    seg = np.searchsorted(bounds, np.arange(seq_len), side="right") - 1
    trained = np.flatnonzero(lm)
    assert (seg[trained] == seg[trained + 1]).all()
    np.testing.assert_array_equal(labels[trained], ids[trained + 1])
    np.testing.assert_array_equal(lm[:n], loss)
    # Positions restart at every sequence start; attention segments are the sequences.
    assert (pos[starts] == 0).all()
    np.testing.assert_array_equal(pos, np.arange(seq_len) - bounds[seg])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad=st.sampled_from([1, 2, 4]))
def test_layout_property(seed, pad):
    rng = np.random.default_rng(seed)
    ids, loss, starts = random_pack(rng, pack_size=SEQ, pad_mult=pad, max_seqs=8)
    from megatron_sft_idx.reader import Pack

    pack = Pack(ids, loss.astype(np.uint8), starts.astype(np.int32))
    check_sample(M._layout_pack(pack, SEQ, 0, None), pack, SEQ)


def test_dataset_samples_match_packs(shards):
    train, _, _ = build(make_config(blend=([shards["a"]], None), split="1,0,0", shuffle=False),
                        [600, 0, 0])
    shard = MMapIndexedDataset(shards["a"])
    assert len(train) == 600
    for i in (0, 17, 299, 300, 599):
        check_sample(train[i], shard[i % 300], SEQ)
    padded = train[None]
    assert float(padded["loss_mask"].sum()) == 0.0


def test_epochs_are_permutations_and_deterministic(shards):
    config = make_config(blend=([shards["b"]], None), split="1,0,0")
    a = build(config, [450, 0, 0])[0]
    b = build(config, [450, 0, 0])[0]
    index = np.asarray(a.sample_index)
    np.testing.assert_array_equal(index, b.sample_index)
    assert sorted(index[:200]) == list(range(200)) and sorted(index[200:400]) == list(range(200))
    assert not np.array_equal(index[:200], np.arange(200))


def test_exact_resume_after_consumed_samples(shards, tmp_path):
    """Samples after consumed_samples=k are the same in a continuous and a restarted run."""
    blend = M.parse_data_path(f"0.7 {shards['a']} 0.3 {shards['b']}")
    config = make_config(blend=blend, split="98,1,1")
    k, m = 137, 40
    continuous = build(config, [300, 10, 10])[0]
    seen = [continuous[i] for i in range(k + m)]  # the run consumes k, then keeps going
    restarted = build(make_config(blend=blend, split="98,1,1"), [300, 10, 10])[0]
    sampler = torch.utils.data.SequentialSampler(range(k, k + m))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(restarted, range(k, k + m)),
                                         batch_size=8, sampler=sampler, num_workers=2)
    resumed = [row for batch in loader for row in _unbatch(batch)]
    assert len(resumed) == m
    for before, after in zip(seen[k:], resumed):
        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"):
            assert torch.equal(before[key], after[key]), key


def _unbatch(batch):
    n = batch["tokens"].shape[0]
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def test_config_from_megatron_args(shards, tmp_path):
    args = SimpleNamespace(data_path=["0.7", shards["a"], "0.3", shards["b"]], split="98,1,1",
                           seq_length=SEQ, seed=5, data_cache_path=None, num_dataset_builder_threads=2,
                           context_parallel_size=1, sequence_parallel=True, tensor_model_parallel_size=2)
    config = M.config_from_args(args)
    assert config.blend == ([shards["a"], shards["b"]], [0.7, 0.3]) and config.split == "98,1,1"
    assert config.sequence_parallel_size == 2 and M.padding_divisor(config) == 2
    args.sequence_parallel = False  # upstream's rule: SP alone also needs padded sequences
    train, valid, test = M.build_train_valid_test_datasets(args, [100, 10, 10], lambda: True)
    assert len(train) == 100
    per_split = SimpleNamespace(data_path=None, train_data_path=[shards["a"]], valid_data_path=[shards["b"]],
                                test_data_path=None, seq_length=SEQ)
    config = M.config_from_args(per_split)
    assert config.blend is None and config.blend_per_split[0] == ([shards["a"]], None)
    assert M.train_valid_test_datasets_provider.is_distributed


def test_accepts_megatron_lm_gpt_dataset_config(shards):
    """Megatron-LM passes its GPTDatasetConfig; the dataset reads what it needs from it."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    tokenizer = SimpleNamespace(vocab_size=1000, eod=2, pad=1, unique_identifiers={"name": "stub"})
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, blend=([shards["a"]], None), split="1,0,0",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, context_parallel_size=1)
    train, _, _ = build(config, [20, 0, 0])
    sample = train[0]
    pack = MMapIndexedDataset(shards["a"])[int(train.sample_index[0])]
    if pack.packed_len < SEQ:
        assert int(sample["tokens"][-1]) == 1  # padding uses the tokenizer's pad id
    check_sample(sample, pack, SEQ)


# --------------------------------------------------------------------------- blends that must agree (issue 21)

LLAMA = {"name": "meta-llama/Llama-3.1-8B-Instruct", "files_sha256": "a" * 64, "chat_template_sha256": "c" * 64}
DEEPSEEK = {"name": "deepseek-ai/DeepSeek-V3", "files_sha256": "d" * 64, "chat_template_sha256": "e" * 64}
BLEND_MIXES = {  # field -> (metadata of the first shard, of the second, vocab sizes, words of the refusal)
    "tokenizer": ({"tokenizer": LLAMA}, {"tokenizer": DEEPSEEK}, (128256, 129280),
                  "different tokenizers: 'meta-llama/Llama-3.1-8B-Instruct'"),
    "chat_template": ({"tokenizer": LLAMA}, {"tokenizer": dict(LLAMA, chat_template_sha256="f" * 64)},
                      (128256, 128256), "with different chat templates"),
    "vocab_size": ({}, {}, (32000, 128256), "different vocabularies: 32,000 and 128,256"),
    "pad_seq_to_mult": ({"pad_seq_to_mult": 2}, {"pad_seq_to_mult": 4}, (1000, 1000),
                        "padded to different multiples: 2 and 4"),
    "pad_layout": ({"pad_seq_to_mult": 4, "pad_layout": "stored"}, {"pad_seq_to_mult": 4, "pad_layout": "runtime"},
                   (1000, 1000), "'stored' layout and in Megatron-Bridge's 'runtime' layout"),
}


def _mixed_pair(tmp_path, field):
    left, right, vocabs, _ = BLEND_MIXES[field]
    rng = np.random.default_rng(5)
    out = []
    for name, meta, vocab in (("a", left, vocabs[0]), ("b", right, vocabs[1])):
        mult = meta.get("pad_seq_to_mult", 1)
        if meta.get("pad_layout") == "runtime":  # stored lengths of 4k + 1
            packs = [(np.arange(5), np.array([1, 1, 1, 1, 0]), np.array([0]))] * 20
        else:
            packs = random_packs(rng, 20, pack_size=SEQ, pad_mult=mult)
        write_shard(str(tmp_path / name), packs, pack_size=SEQ, vocab_size=vocab, metadata=meta)
        out.append(str(tmp_path / name))
    return out


@pytest.mark.parametrize("field", sorted(BLEND_MIXES))
def test_blends_of_disagreeing_shards_are_refused_by_the_real_builder(tmp_path, field):
    a, b = _mixed_pair(tmp_path, field)
    words = BLEND_MIXES[field][3]
    for config in (make_config(blend=M.parse_data_path(f"0.7 {a} 0.3 {b}"), split="90,10,0"),
                   make_config(blend=M.parse_data_path(f"{a} {b}"), split="90,10,0"),
                   make_config(blend_per_split=M.parse_per_split_data_path(a, b, None))):
        with pytest.raises(IncompatibleShardsError) as info:
            build(config, [40, 4, 0])
        err = info.value
        assert err.field == field and words in str(err) and a in str(err) and b in str(err), str(err)
    for path in (a, b):  # each alone builds
        train, _, _ = build(make_config(blend=([path], None), split="90,10,0"), [10, 2, None])
        assert len(train) == 10


def test_a_blend_entry_holding_two_generations_is_refused(tmp_path, shards):
    d = tmp_path / "set"
    rng = np.random.default_rng(6)
    for i, set_id in enumerate(["n" * 32, "n" * 32, "o" * 32]):
        write_shard(str(d / f"ds_{i:06d}"), random_packs(rng, 10, pack_size=SEQ), pack_size=SEQ,
                    metadata={"set": {"id": set_id, "index": i, "count": 3, "name": "train"}})
    config = make_config(blend=M.parse_data_path(f"0.5 {shards['a']} 0.5 {d}"), split="90,10,0")
    with pytest.raises(ShardSetError, match=r"set nnnnnnnnnnnn \(train\): 2 of its 3 shards .*set oooooooooooo "
                                            r"\(train\): 1 of its 3 shards"):
        build(config, [40, 4, 0])


def test_a_blend_that_agrees_is_checked_once_per_build(tmp_path, shards, monkeypatch):
    opened = []
    real = M.open_packed
    monkeypatch.setattr(M, "open_packed", lambda path, **kw: opened.append(path) or real(path, **kw))
    config = make_config(blend=M.parse_data_path(f"0.7 {shards['a']} 0.3 {shards['b']}"), split="98,1,1")
    build(config, [100, 5, 5])
    # the blend check reads each entry once (not once per entry), then the build opens each once
    assert opened.count(shards["a"]) == opened.count(shards["b"]) == 2
