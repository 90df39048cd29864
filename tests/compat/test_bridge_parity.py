"""Our Bridge adapter against the installed Megatron-Bridge 0.6.2, on data Bridge wrote itself.

For every artifact (prompt-template / chat, with and without CP padding) Bridge's own
readers (``GPTSFTPackedDataset`` over its ``.npy``, ``GPTSFTPackedParquetDataset`` over its
Parquet, built by Bridge's ``build_gpt_sft_split``) and their ``collate_fn`` are the
reference; ours (:class:`PackedSFTDataset`) reads (a) a shard converted from the same packs,
(b) Bridge's ``.npy``, (c) Bridge's Parquet. Batches must be identical on every key Bridge
returns — values, dtypes, shapes — and ours returns no other key.
"""

import numpy as np
import pytest
import torch

from bridge_data import PACK_SIZE, bridge_tokenizer, write_bridge_artifacts  

from megatron_sft_idx import MMapIndexedDataset  
from megatron_sft_idx.errors import ShardError  
from megatron_sft_idx.training.bridge import PackedSFTDataset  
from megatron_sft_idx.tools.convert import ConvertOptions, convert

OPTION_SETS = [dict(pad_to_max_length=False, pad_cu_seqlens=False),
               dict(pad_to_max_length=True, pad_cu_seqlens=False),
               dict(pad_to_max_length=True, pad_cu_seqlens=True)]


@pytest.fixture(scope="session")
def tokenizer():
    return bridge_tokenizer()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("bridge_written")
    arts = write_bridge_artifacts(out, tokenizer)
    shards = {}
    for a in arts:
        prefix = str(out / f"{a.kind}_cp{a.pad_seq_to_mult}_shard")
        convert(a.npy, prefix, options=ConvertOptions(pad_seq_to_mult=a.pad_seq_to_mult,
                                                    eos_id=tokenizer.eos_id))
        shards[(a.kind, a.pad_seq_to_mult)] = prefix
    return arts, shards


def bridge_dataset(path, art, tokenizer, opts, max_num_samples=None):
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split

    return build_gpt_sft_split(
        path, tokenizer=tokenizer, seq_length=PACK_SIZE, memmap_workers=1, seed=1234,
        packed_sequence_size=PACK_SIZE, pack_metadata_path=art.metadata,
        pad_cu_seqlens=opts["pad_cu_seqlens"], pad_seq_to_mult=art.pad_seq_to_mult,
        dataset_kwargs={"pad_to_max_length": opts["pad_to_max_length"], "max_num_samples": max_num_samples,
                        "answer_only_loss": opts.get("answer_only_loss", True)})


def ours(path, art, tokenizer, opts, max_num_samples=None, **extra):
    return PackedSFTDataset(path, max_seq_length=PACK_SIZE, eos_id=tokenizer.eos_id,
                            max_num_samples=max_num_samples, pad_seq_to_mult=art.pad_seq_to_mult, **opts, **extra)


def assert_same_batch(ref, got, where):
    assert set(got) == set(ref), f"{where}: keys {sorted(got)} != Bridge's {sorted(ref)}"
    for key, want in ref.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(have, torch.Tensor), (where, key)
            assert (have.dtype, tuple(have.shape)) == (want.dtype, tuple(want.shape)), (where, key)
            assert torch.equal(have, want), f"{where}: {key} differs\nBridge {want}\nours   {have}"
        else:
            assert have == want, (where, key, have, want)


def index_batches(n, rng, sizes=(1, 3), rounds=6):
    """Random index orders, including negative (padding-sample) indices."""
    for size in sizes:
        for _ in range(rounds):
            idx = rng.choice(np.arange(-n, n), size=min(size, 2 * n), replace=False)
            yield [int(i) for i in idx]


@pytest.mark.parametrize("opts", OPTION_SETS, ids=["dyn", "max", "max+cu"])
@pytest.mark.parametrize("kind,mult", [("prompt", 1), ("prompt", 4), ("chat", 1), ("chat", 4)])
def test_batches_identical_to_bridges_own_readers(artifacts, tokenizer, kind, mult, opts):
    arts, shards = artifacts
    art = next(a for a in arts if (a.kind, a.pad_seq_to_mult) == (kind, mult))
    rng = np.random.default_rng(hash((kind, mult, tuple(opts.values()))) % 2**32)
    for bridge_path in (art.npy, art.parquet):
        ref_ds = bridge_dataset(bridge_path, art, tokenizer, opts)
        candidates = {"shard": ours(shards[(kind, mult)], art, tokenizer, opts),
                      "npy": ours(art.npy, art, tokenizer, opts),
                      "parquet": ours(art.parquet, art, tokenizer, opts)}
        for name, ds in candidates.items():
            assert len(ds) == len(ref_ds)
            for batch in index_batches(len(ref_ds), rng):
                ref = ref_ds.collate_fn([ref_ds[i] for i in batch])
                got = ds.collate_fn([ds[i] for i in batch])
                assert_same_batch(ref, got, f"{name} vs Bridge({bridge_path}) batch {batch}")


def test_packing_statistics_equal_bridges_metadata_file(artifacts, tokenizer):
    """Bridge's pad_cu_seqlens reads max_samples_per_bin, dataset_max_seqlen and min_packed_seqlen
    from the metadata JSON its packer wrote; ours derive them from the shard (format 1.1
    min_packed_runtime_len) or the data, and must be the same numbers."""
    from megatron_sft_idx.training.bridge import bridge_metadata_stats, bridge_stats
    from megatron_sft_idx.open import open_packed

    arts, shards = artifacts
    for art in arts:
        want = bridge_metadata_stats(art.metadata)
        for src in (MMapIndexedDataset(shards[(art.kind, art.pad_seq_to_mult)]),
                    open_packed(art.npy, pad_seq_to_mult=art.pad_seq_to_mult),
                    open_packed(art.parquet, pad_seq_to_mult=art.pad_seq_to_mult)):
            assert bridge_stats(src) == want, (art, src)


def test_pack_metadata_written_with_parquet_is_in_bridges_units(artifacts, tmp_path):
    """``convert-packed --to parquet --pack-metadata`` writes the record Bridge's packer wrote for
    the same packs (runtime units: Bridge bins on length - 1), so Bridge's pad_cu_seqlens batches
    over the converted file are the ones it gives over its own."""
    import json

    from megatron_sft_idx.training.bridge import bridge_metadata_stats

    arts, shards = artifacts
    for art in arts:
        meta = tmp_path / f"{art.kind}_{art.pad_seq_to_mult}.meta.json"
        convert(shards[(art.kind, art.pad_seq_to_mult)], str(tmp_path / f"{art.kind}_{art.pad_seq_to_mult}.parquet"),
                options=ConvertOptions(pack_metadata=str(meta)))
        assert bridge_metadata_stats(str(meta)) == bridge_metadata_stats(art.metadata), art
        ours, theirs = json.loads(meta.read_text())[0], json.loads(open(art.metadata).read())[0]
        assert ours["packing_factor"] == theirs["packing_factor"], (ours, theirs)


def test_samples_mapping_and_padding_samples_match(artifacts, tokenizer):
    arts, shards = artifacts
    art = next(a for a in arts if (a.kind, a.pad_seq_to_mult) == ("chat", 4))
    opts = OPTION_SETS[2]
    ref_ds = bridge_dataset(art.npy, art, tokenizer, opts, max_num_samples=70)
    ds = ours(shards[("chat", 4)], art, tokenizer, opts, max_num_samples=70)
    np.testing.assert_array_equal(ds.samples_mapping, ref_ds.samples_mapping)
    rng = np.random.default_rng(7)
    for batch in index_batches(70, rng, sizes=(1, 4), rounds=8):
        assert_same_batch(ref_ds.collate_fn([ref_ds[i] for i in batch]), ds.collate_fn([ds[i] for i in batch]),
                          f"mapped batch {batch}")


@pytest.mark.parametrize("extra", [dict(answer_only_loss=False), dict(return_cu_seqlen=False)],
                         ids=["all-loss", "dense-mask"])
def test_other_collate_options_match(artifacts, tokenizer, extra):
    arts, shards = artifacts
    art = next(a for a in arts if (a.kind, a.pad_seq_to_mult) == ("prompt", 4))
    opts = dict(OPTION_SETS[1], **{k: v for k, v in extra.items() if k == "answer_only_loss"})
    ref_ds = bridge_dataset(art.npy, art, tokenizer, opts)
    if "return_cu_seqlen" in extra:
        ref_ds.return_cu_seqlen = False  # Bridge's builder does not expose it; set as the attribute it reads
    ds = ours(shards[("prompt", 4)], art, tokenizer, OPTION_SETS[1], **extra)
    for batch in index_batches(len(ref_ds), np.random.default_rng(3), sizes=(2,), rounds=4):
        assert_same_batch(ref_ds.collate_fn([ref_ds[i] for i in batch]), ds.collate_fn([ds[i] for i in batch]),
                          f"{extra} batch {batch}")


def test_bridge_packs_exceed_the_nominal_pack_size_and_still_open(artifacts):
    arts, shards = artifacts
    longest = max(MMapIndexedDataset(p).metadata.stats.max_packed_seqlen for p in shards.values())
    assert longest > PACK_SIZE  # Bridge bins on length - 1: a stored pack holds up to one extra token per sequence
    for p in shards.values():
        assert MMapIndexedDataset(p).metadata.pad_layout == "runtime"


def test_converted_shards_pass_the_gate_and_keep_the_stored_mask(artifacts, tokenizer):
    from megatron.bridge.utils.safe_pickle import safe_load_npy

    from megatron_sft_idx.gate import check

    arts, shards = artifacts
    report = check(list(shards.values()), level="deep")
    assert report.passed, report.format_text()
    for art in arts:
        with open(art.npy, "rb") as f:
            packs = safe_load_npy(f.read())
        shard = MMapIndexedDataset(shards[(art.kind, art.pad_seq_to_mult)])
        for i, pack in enumerate(packs):
            ids = np.asarray(pack["input_ids"])
            stored = np.asarray(pack["loss_mask"], dtype=np.int64)
            bounds = list(pack["seq_start_id"]) + [len(ids)]
            read = np.zeros(len(ids), bool)  # the positions Bridge's collate reads and may train
            for b, e in zip(bounds[:-1], bounds[1:]):
                read[b:e - 1] = True
            ours_loss = shard[i].loss_mask.astype(np.int64)
            np.testing.assert_array_equal(shard[i].input_ids, ids)
            # the stored mask bit for bit on every position a consumer reads (EOS inputs included:
            # Bridge main trains them, 0.6's collate zeroes them), 0 on each sequence's unread last one
            np.testing.assert_array_equal(ours_loss[read], stored[read])
            assert not ours_loss[~read].any()


def test_stored_layout_cp_shard_is_refused_for_bridge(tmp_path, tokenizer):
    from support.shardgen import write_shard

    prefix = str(tmp_path / "mlm")
    write_shard(prefix, [(np.arange(1, 9), np.array([0, 1, 1, 0, 0, 1, 1, 0]), np.array([0, 4]))],
                metadata={"pad_seq_to_mult": 4, "pad_layout": "stored"})
    with pytest.raises(ShardError, match="'stored' layout"):
        PackedSFTDataset(prefix, eos_id=tokenizer.eos_id)
    PackedSFTDataset(prefix, eos_id=tokenizer.eos_id, pad_seq_to_mult=1)  # no CP: served


def test_pad_cu_seqlens_without_max_length_is_refused_by_both(artifacts, tokenizer):
    arts, _ = artifacts
    art = arts[0]
    with pytest.raises(AssertionError):
        bridge_dataset(art.npy, art, tokenizer, dict(pad_to_max_length=False, pad_cu_seqlens=True))
    with pytest.raises(ShardError, match="pad_to_max_length"):
        ours(art.npy, art, tokenizer, dict(pad_to_max_length=False, pad_cu_seqlens=True))
