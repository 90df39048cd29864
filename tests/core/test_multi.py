"""Many shards as one dataset: list/glob/directory/manifest, lazy opens, DataLoader workers."""

import builtins
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError, SizeMismatchError
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.training.bridge import PackedSFTDataset
from megatron_sft_idx.training.manifest_cli import main as manifest_main
from megatron_sft_idx.multi import MultiShardDataset, read_manifest
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.publishing import write_manifest

COUNTS = [7, 1, 12, 5, 9, 3]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    rng = np.random.default_rng(21)
    for k, n in enumerate(COUNTS):
        write_shard(str(root / f"part_{k:02d}"), random_packs(rng, n, pack_size=32), pack_size=32)
    return root


def prefixes(root):
    return [str(root / f"part_{k:02d}") for k in range(len(COUNTS))]


def expected_packs(root):
    return [pack for p in prefixes(root) for pack in MMapIndexedDataset(p)[0:len(MMapIndexedDataset(p))]]


def same_pack(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["list", "glob", "dir", "manifest"])
def test_global_order_is_shard_order(shard_dir, tmp_path, kind):
    if kind == "manifest":
        spec = str(tmp_path / "m.json")
        write_manifest(spec, str(shard_dir))
    else:
        spec = {"list": prefixes(shard_dir), "glob": str(shard_dir / "part_*"), "dir": str(shard_dir)}[kind]
    ds = open_packed(spec)
    assert isinstance(ds, MultiShardDataset) and len(ds) == sum(COUNTS) and ds.num_shards == 6
    expect = expected_packs(shard_dir)
    for i in range(len(ds)):
        assert same_pack(ds[i], expect[i])
    assert same_pack(ds[-1], expect[-1])
    assert ds.shard_of(7) == (1, 0) and ds.shard_of(8) == (2, 0) and ds.shard_of(36) == (5, 2)
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds.summary.pack_count == sum(COUNTS)


def test_manifest_opens_with_one_read_and_shards_lazily(shard_dir, tmp_path, monkeypatch):
    manifest = str(tmp_path / "all.json")
    write_manifest(manifest, str(shard_dir))
    opened = []
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        opened.append(str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    ds = MultiShardDataset.open(manifest)
    assert len(ds) == sum(COUNTS) and ds.open_shards == []
    assert [os.path.basename(f) for f in opened if not f.endswith(".py")] == ["all.json"]
    ds[8]  # a pack of shard 2: only shard 2 is opened
    assert ds.open_shards == [2]
    assert all("part_02" in f or f == manifest for f in opened if not f.endswith(".py"))


def test_manifest_needs_no_shard_index_until_a_pack_is_read(shard_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    rng = np.random.default_rng(1)
    for k in range(40):
        write_shard(str(copy / f"s{k:02d}"), random_packs(rng, 2, pack_size=32), pack_size=32)
    manifest = str(copy / "m.json")
    assert manifest_main([manifest, str(copy), "--json"]) == 0
    for name in os.listdir(copy):  # the manifest is all an open needs
        if name.endswith(".idx") and not name.endswith(".seq.idx"):
            os.remove(copy / name)
    ds = open_packed(manifest)
    assert len(ds) == 80 and ds.summary.max_samples_per_bin >= 1
    with pytest.raises(ShardError, match="missing"):
        ds[5]


def test_stale_manifest_is_refused_at_shard_open(tmp_path):
    rng = np.random.default_rng(2)
    a = str(tmp_path / "a")
    write_shard(a, random_packs(rng, 4, pack_size=32), pack_size=32)
    manifest = str(tmp_path / "m.json")
    write_manifest(manifest, [a])
    write_shard(a, random_packs(rng, 6, pack_size=32), pack_size=32, overwrite=True)
    ds = open_packed(manifest)
    with pytest.raises(SizeMismatchError, match="stale manifest"):
        ds[0]


def test_manifest_format_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "megatron_sft_idx.manifest", "version": 9, "shards": []}))
    with pytest.raises(ShardError, match="unsupported manifest version"):
        read_manifest(str(bad))
    bad.write_text(json.dumps({"format": "megatron_sft_idx.manifest", "version": 1,
                               "shards": [{"prefix": "x", "packs": -1}]}))
    with pytest.raises(ShardError, match="malformed"):
        read_manifest(str(bad))


@pytest.mark.subprocess
def test_write_manifest_cli(shard_dir, tmp_path, capsys):
    out = str(tmp_path / "m.json")
    assert manifest_main([out, str(shard_dir / "part_0*"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"manifest": out, "shards": 6, "packs": sum(COUNTS)}
    manifest = json.load(open(out))
    assert not os.path.isabs(manifest["shards"][0]["prefix"])
    assert manifest_main([str(tmp_path / "n.json"), str(tmp_path / "nothing*")]) == 2
    assert manifest_main([str(tmp_path / "n.txt"), str(shard_dir)]) == 2
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                          "write_manifest.py")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "manifest" in done.stdout


def test_pickles_small_without_open_files(shard_dir):
    ds = MultiShardDataset.open(prefixes(shard_dir))
    ds[30]
    blob = pickle.dumps(ds)
    assert len(blob) < 4096
    clone = pickle.loads(blob)
    assert clone.open_shards == [] and same_pack(clone[30], ds[30])


def test_a_set_pickles_its_tokenizer_record_once(tmp_path):
    rng = np.random.default_rng(8)
    tokenizer = {"name": "t", "files_sha256": "1" * 64, "files": [f"f{k:04d}.json" for k in range(200)]}
    for i in range(40):
        write_shard(str(tmp_path / f"ds_{i:06d}"), random_packs(rng, 2, pack_size=32), pack_size=32,
                    metadata={"tokenizer": tokenizer, "set": {"id": "s" * 32, "index": i, "count": 40}})
    write_manifest(str(tmp_path / "ds.json"), str(tmp_path))
    for ds in (MultiShardDataset.open(str(tmp_path)), open_packed(str(tmp_path / "ds.json"))):
        blob = pickle.dumps(ds)
        assert len(pickle.dumps(tokenizer)) > 2500 and len(blob) < 40 * 1000, len(blob)
        assert pickle.loads(blob).identities == ds.identities


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_read_every_pack_exactly_once(tmp_path):
    rng = np.random.default_rng(4)
    uid = 1000
    for k, n in enumerate(COUNTS):
        packs = random_packs(rng, n, pack_size=32, pad_mult=2)  # first sequence >= 2 tokens
        for ids, _, _ in packs:
            ids[0] = uid  # tags the pack: row b of a batch starts with its pack's tag
            uid += 1
        write_shard(str(tmp_path / f"w{k}"), packs, pack_size=32)
    ds = PackedSFTDataset(MultiShardDataset.open(str(tmp_path)), pad_to_max_length=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=ds.collate_fn, num_workers=4,
                                         persistent_workers=True)
    expect = [ds.collate_fn([ds[i] for i in range(s, min(s + 4, len(ds)))]) for s in range(0, len(ds), 4)]
    for _ in range(2):  # persistent workers serve a second epoch too
        got = list(loader)
        assert len(got) == len(expect)
        for a, b in zip(got, expect):
            for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens_q"):
                assert torch.equal(a[key], b[key])
        tags = torch.cat([b["tokens"][:, 0] for b in got]).tolist()
        assert sorted(tags) == list(range(1000, 1000 + sum(COUNTS)))  # every pack exactly once
