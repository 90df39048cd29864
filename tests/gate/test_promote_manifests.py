"""``check-idx --promote`` with the manifests and sets a real preprocess run writes (issue 22 item 3).

A run's directory holds a 3-shard train set with its manifest and a 1-shard valid set with its
own. Promotion moves (or links, or uploads) every shard and writes each manifest at the
destination, listing the promoted shards; part of a set is never checked as whole nor
promoted; a manifest is never stranded; a manifest entry with no shard is named as such by
every reader door.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from megatron_sft_idx import open_packed
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.gate.cli import main as check_idx
from megatron_sft_idx.publishing import write_manifest
from support.shardgen import random_packs, write_shard
from support.stages import files_of, preprocess, visible

TRAIN = [f"ds_train_{i:06d}" for i in range(3)]
VALID = ["ds_valid_000000"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A preprocess run: train (3 shards, ds_train.json) and valid (1 shard, ds_valid.json)."""
    out = str(tmp_path_factory.mktemp("run"))
    summary = preprocess(out, pack_size=512, split=[90, 10], max_packs_per_shard=60)
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".idx") and not n.endswith(".seq.idx")] == \
        [n + ".idx" for n in TRAIN + VALID], (names, summary)
    return out


@pytest.fixture
def run(run_dir, tmp_path):
    """A fresh copy of the run's directory."""
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    return copy


def packs_of(spec):
    ds = open_packed(spec)
    return [tuple(np.asarray(a).tobytes() for a in ds[i]) for i in range(len(ds))]



def listed(manifest):
    with open(manifest) as f:
        return [e["prefix"] for e in json.load(f)["shards"]]


def test_promote_a_run_moves_its_manifests_rewritten_for_the_destination(run, tmp_path, capsys):
    before = {m: packs_of(os.path.join(run, m)) for m in ("ds_train.json", "ds_valid.json")}
    dest = str(tmp_path / "train_storage")
    assert check_idx([run, "--promote", dest]) == 0
    out = capsys.readouterr().out
    assert f"manifest {os.path.join(run, 'ds_train.json')} -> {os.path.join(dest, 'ds_train.json')}" in out
    assert visible(run) == []  # shards and manifests moved; nothing stranded at the source
    assert listed(os.path.join(dest, "ds_train.json")) == TRAIN  # relative to the manifest
    assert listed(os.path.join(dest, "ds_valid.json")) == VALID
    for m, packs in before.items():
        assert packs_of(os.path.join(dest, m)) == packs
    assert check_idx([os.path.join(dest, "ds_train.json"), "-q"]) == 0


def test_promote_with_link_leaves_the_source_and_writes_the_manifest_at_the_destination(run, tmp_path):
    source = files_of(run)
    dest = str(tmp_path / "linked")
    assert check_idx([os.path.join(run, "ds_train.json"), "--promote", dest, "--link", "-q"]) == 0
    assert files_of(run) == source
    assert sorted(os.listdir(dest)) == sorted(["ds_train.json"] + [n + s for n in TRAIN for s in ALL_SUFFIXES])
    assert packs_of(os.path.join(dest, "ds_train.json")) == packs_of(os.path.join(run, "ds_train.json"))


def test_promote_to_object_storage_uploads_the_manifest_after_its_shards(run, bucket, s3, capsys):
    packs = packs_of(os.path.join(run, "ds_train.json"))
    dest = f"s3://{bucket}/promoted/"
    s3.requests.clear()
    assert check_idx([os.path.join(run, "ds_train.json"), "--promote", dest]) == 0
    assert f"-> s3://{bucket}/promoted/ds_train.json" in capsys.readouterr().out
    puts = [key for method, key, _, _ in s3.requests if method == "PUT"]
    assert puts[-1].endswith("promoted/ds_train.json")  # the set's commit point, after every shard
    assert sum(k.endswith(".idx") and not k.endswith(".seq.idx") for k in puts) == 3
    assert packs_of(dest + "ds_train.json") == packs
    assert visible(run) == sorted(["ds_valid.json"] + [VALID[0] + s for s in ALL_SUFFIXES])


def test_part_of_a_set_is_neither_passed_as_a_directory_nor_promoted(run, tmp_path, capsys):
    for suffix in ALL_SUFFIXES:
        os.remove(os.path.join(run, TRAIN[1] + suffix))
    os.remove(os.path.join(run, "ds_train.json"))
    assert check_idx([run]) == 1
    out = capsys.readouterr().out
    assert "SET_INCOMPLETE" in out and "2 of its 3 shards" in out and "shard 1 of the set is missing" in out
    assert f"PASS  {os.path.join(run, VALID[0])}" in out  # the whole valid set still passes
    # named one by one, a shard is checked alone ...
    assert check_idx([os.path.join(run, TRAIN[0]), "-q"]) == 0
    # ... but never promoted without the rest of its set
    dest = str(tmp_path / "dest")
    assert check_idx([os.path.join(run, TRAIN[0]), os.path.join(run, TRAIN[2]), "--promote", dest]) == 1
    out = capsys.readouterr().out
    assert "SET_INCOMPLETE" in out and "shard 1 of the set is missing" in out
    assert not os.path.exists(dest) or os.listdir(dest) == []
    assert all(os.path.exists(os.path.join(run, n + ".idx")) for n in (TRAIN[0], TRAIN[2]))


def test_a_set_with_a_failing_member_is_not_promoted(run, tmp_path, capsys):
    with open(os.path.join(run, TRAIN[2] + ".loss.bin"), "r+b") as f:
        f.seek(3)
        f.write(b"\x07")  # a loss value outside {0, 1}
    dest = str(tmp_path / "dest")
    assert check_idx([os.path.join(run, "ds_train.json"), "--promote", dest]) == 1
    out = capsys.readouterr().out
    assert out.count("PROMOTION_REFUSED") == 2 and "a set is promoted whole or not at all" in out
    assert all(os.path.exists(os.path.join(run, n + ".idx")) for n in TRAIN)
    assert not os.path.exists(dest) or not any(n.endswith(".idx") for n in os.listdir(dest))
    assert os.path.exists(os.path.join(run, "ds_train.json"))


def test_a_manifest_is_never_stranded(tmp_path, capsys):
    """Shards of no set, listed by a manifest: promoting one of them would strand it."""
    src = tmp_path / "src"
    for i, name in enumerate(("a", "b")):
        write_shard(str(src / name), random_packs(np.random.default_rng(i), 6), vocab_size=1000)
    write_manifest(str(src / "both.json"), [str(src / "a"), str(src / "b")])
    dest = str(tmp_path / "dest")
    assert check_idx([str(src / "a"), "--promote", dest]) == 1
    out = capsys.readouterr().out
    assert "PROMOTION_REFUSED" in out and "both.json also lists b, not promoted with it" in out
    assert os.path.exists(str(src / "a.idx")) and not os.path.exists(os.path.join(dest, "a.idx"))
    # a manifest of that name at the destination is not replaced without --replace
    os.makedirs(dest, exist_ok=True)
    open(os.path.join(dest, "both.json"), "w").write("{}")
    assert check_idx([str(src / "both.json"), "--promote", dest]) == 1
    assert "a manifest exists at" in capsys.readouterr().out
    assert check_idx([str(src / "both.json"), "--promote", dest, "--replace", "-q"]) == 0
    assert listed(os.path.join(dest, "both.json")) == ["a", "b"] and os.listdir(src) == []


def test_link_to_a_url_is_a_usage_error(run, capsys):
    assert check_idx([run, "--promote", "s3://bucket/dir/", "--link"]) == 2
    err = capsys.readouterr().err
    assert err == ("check-idx: error: --link needs a local destination (hard links cannot point into object "
                   "storage); drop --link to upload\n")


def _tool(name):
    from megatron_sft_idx._console import run as run_tool

    return lambda argv: run_tool(name, argv)


DOORS = {
    "open_packed": lambda m: open_packed(m)[len(open_packed(m)) - 1],
    "check-idx": lambda m: _tool("check-idx")([m]),
    "inspect-idx": lambda m: _tool("inspect-idx")([m]),
    "inspect-idx --sql": lambda m: _tool("inspect-idx")([m, "--sql", "SELECT count(*) FROM packs"]),
    "merge-shards": lambda m: _tool("merge-shards")([os.path.join(os.path.dirname(m), "merged"), m]),
    "write-sft-manifest": lambda m: _tool("write-sft-manifest")([os.path.join(os.path.dirname(m), "w.json"), m]),
    "plan-batches": lambda m: _tool("plan-batches")([m, "--dp", "2", "--global-batch-size", "4"]),
    "convert-packed": lambda m: _tool("convert-packed")([m, os.path.join(os.path.dirname(m), "x.parquet")]),
}


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("what", ["idx only", "whole shard"])
def test_a_manifest_entry_with_no_shard_is_named_by_every_door(run, capsys, door, what):
    missing = os.path.join(run, TRAIN[2])
    for suffix in (".idx",) if what == "idx only" else ALL_SUFFIXES:
        os.remove(missing + suffix)
    manifest = os.path.join(run, "ds_train.json")
    expected = f"manifest {manifest} lists {missing}: no shard at this prefix (.idx missing"
    try:
        status = DOORS[door](manifest)
    except Exception as exc:  # the API door raises
        assert door == "open_packed" and expected in str(exc) and "shards[2].prefix" in str(exc)
        return
    err = capsys.readouterr().err
    assert status == 2 and expected in err and "Traceback" not in err, err
