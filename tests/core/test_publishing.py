"""The one commit rule (megatron_sft_idx.publishing), on real files: the order in which a shard's
files change, what a failure at every step leaves, a staged shard's commit resumed after an
interruption at every point, a set's manifests around its shards, one refusal for every door.
(Object-storage destinations: tests/storage/test_remote.py, test_preprocess_remote.py, test_remote_hostile_writes.py.)"""

import json
import os
import zlib

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset, publishing
from megatron_sft_idx.errors import IncompleteDestinationError, IncompleteShardError, ShardError, ShardExistsError, ShardNotFoundError
from megatron_sft_idx.format import ALL_SUFFIXES, IDX_SUFFIX, PUBLISH_ORDER
from megatron_sft_idx.manifest import OrderRecord, load_manifest
from megatron_sft_idx.publishing import StagedSet, StagedShard
from megatron_sft_idx.storage.destination import LocalDestination


def shard_bytes(prefix):
    return {s: open(prefix + s, "rb").read() for s in ALL_SUFFIXES if os.path.exists(prefix + s)}


def packs_of(prefix):
    return [tuple(np.array(a) for a in p) for p in MMapIndexedDataset(prefix)]


def same_packs(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


@pytest.fixture
def two(tmp_path, rng):
    """An old shard at the final prefix and a new one staged beside it (same filesystem)."""
    final, staged = str(tmp_path / "out" / "s"), str(tmp_path / "out" / ".staged" / "s")
    write_shard(final, random_packs(rng, 4))
    write_shard(staged, random_packs(rng, 7))
    return final, staged, packs_of(final), packs_of(staged)


class Recorder(LocalDestination):
    """The local destination, recording every change it makes at the final names, in order;
    ``fail_at`` makes the put of that suffix raise."""

    def __init__(self, fail_at=None):
        self.log, self.fail_at = [], fail_at

    def remove(self, paths):
        paths = list(paths)
        self.log += [("remove", os.path.basename(p)) for p in paths]
        super().remove(paths)

    def put(self, source, final):
        if self.fail_at and final.endswith(self.fail_at) and not (self.fail_at == IDX_SUFFIX
                                                                  and final.endswith(".seq.idx")):
            raise OSError(28, "No space left on device", final)
        self.log.append(("put", os.path.basename(final)))
        super().put(source, final)


def test_a_shard_is_committed_idx_removed_first_and_put_last(two):
    final, staged, _, new = two
    dest = Recorder()
    publishing.commit_shard({s: staged + s for s in PUBLISH_ORDER}, final, dest, rollback=False)
    assert dest.log[0] == ("remove", "s.idx")
    assert dest.log[-1] == ("put", "s.idx")
    assert [e for e in dest.log if e[0] == "put"] == [("put", "s" + s) for s in PUBLISH_ORDER]
    assert same_packs(packs_of(final), new)


@pytest.mark.parametrize("fail_at", PUBLISH_ORDER)
def test_a_failed_step_leaves_nothing_that_opens_and_rolls_temporaries_back(two, fail_at):
    final, staged, _, _ = two
    with pytest.raises(OSError):
        publishing.commit_shard({s: staged + s for s in PUBLISH_ORDER}, final, Recorder(fail_at))
    assert not os.path.exists(final + IDX_SUFFIX)
    with pytest.raises((ShardNotFoundError, IncompleteShardError)):
        MMapIndexedDataset(final)
    put_before = PUBLISH_ORDER[:PUBLISH_ORDER.index(fail_at)]
    for s in put_before:  # rolled back: no new companion is left under the final name
        assert not os.path.exists(final + s) or os.path.exists(staged + s)


@pytest.mark.parametrize("moved", range(len(PUBLISH_ORDER) + 1))
def test_a_staged_commit_interrupted_after_any_file_is_finished_by_a_rerun(two, moved):
    final, staged, _, new = two
    os.unlink(final + IDX_SUFFIX)  # an interrupted commit removed the old index first
    for s in PUBLISH_ORDER[:moved]:  # ... then moved these before it was killed
        os.replace(staged + s, final + s)
    publishing.commit_staged(staged, final)
    assert same_packs(packs_of(final), new)
    assert not any(os.path.exists(staged + s) for s in PUBLISH_ORDER)
    publishing.commit_staged(staged, final)  # a second rerun: nothing to do, nothing refused
    assert same_packs(packs_of(final), new)


def test_a_staged_file_that_vanished_unpublished_is_refused(two):
    final, staged, old, _ = two
    os.unlink(staged + ".loss.bin")
    os.unlink(final + ".loss.bin")
    with pytest.raises(ShardError, match="vanished"):
        publishing.commit_staged(staged, final)


def test_old_files_the_new_shard_lacks_are_removed(tmp_path, rng):
    final = str(tmp_path / "s")
    write_shard(final, random_packs(rng, 3))
    pretrain = str(tmp_path / "p" / "s")
    os.makedirs(os.path.dirname(pretrain))
    for s in (".bin", IDX_SUFFIX):
        with open(final + s, "rb") as src, open(pretrain + s, "wb") as dst:
            dst.write(src.read())
    publishing.commit_shard({".bin": pretrain + ".bin", IDX_SUFFIX: pretrain + IDX_SUFFIX}, final)
    assert sorted(os.listdir(tmp_path)) == ["p", "s.bin", "s.idx"]


def test_one_refusal_for_every_door(tmp_path, rng):
    prefix = str(tmp_path / "s")
    write_shard(prefix, random_packs(rng, 2))
    with pytest.raises(ShardExistsError, match=r"output already exists \(1 file\(s\), e.g. .*s.idx\)") as info:
        write_shard(prefix, random_packs(rng, 2))
    assert info.value.path == prefix + IDX_SUFFIX and "overwrite=True" in str(info.value)
    staged = str(tmp_path / "st" / "s")
    write_shard(staged, random_packs(rng, 2))
    with pytest.raises(ShardExistsError, match=r"output already exists \(5 file\(s\)") as info:
        publishing.publish_shard(staged, prefix)
    assert "replace=True" in str(info.value)
    publishing.refuse_existing([])  # nothing found: nothing refused


def test_a_moved_shards_source_goes_idx_first(tmp_path, rng, monkeypatch):
    prefix = str(tmp_path / "s")
    write_shard(prefix, random_packs(rng, 2))
    removed = []
    real = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p: removed.append(os.path.basename(p)) or real(p))
    publishing.remove_shard(prefix)
    assert removed[0] == "s.idx" and sorted(removed) == sorted("s" + s for s in ALL_SUFFIXES)


def test_a_set_is_published_manifests_around_its_shards(tmp_path, rng):
    out, stage = tmp_path / "out", tmp_path / "stage"
    finals = [str(out / f"ds_{k:06d}") for k in range(3)]
    old = [str(out / f"ds_{k:06d}") for k in range(4)]  # an earlier generation had one more shard
    for p in old:
        write_shard(p, random_packs(rng, 2))
    (out / "ds.json").write_text("{}")
    for k, f in enumerate(finals):
        write_shard(str(stage / os.path.basename(f)), random_packs(rng, 3 + k),
                    metadata={"set": {"id": "x" * 32, "index": k, "count": 3}})
    staged = StagedSet(tuple(StagedShard(str(stage / os.path.basename(f)), f) for f in finals),
                       ((str(out / "ds.json"), tuple(finals)),))
    replaced = sorted(str(out / n) for n in os.listdir(out))
    seen = []
    publishing.publish_set(staged, replaced, on_commit=lambda i, files: seen.append((i, files)))
    assert [i for i, _ in seen] == [0, 1, 2] and seen[0][1] == [finals[0] + s for s in PUBLISH_ORDER]
    assert sorted(os.listdir(out)) == sorted([f"ds_{k:06d}{s}" for k in range(3) for s in ALL_SUFFIXES] + ["ds.json"])
    m = load_manifest(str(out / "ds.json"))
    assert m.prefixes == finals and m.counts == [3, 4, 5]
    doc = json.loads((out / "ds.json").read_bytes())
    assert [e["prefix"] for e in doc["shards"]] == [os.path.basename(f) for f in finals]  # relative


def test_a_set_interrupted_after_its_first_shard_resumes_without_committing_it_again(tmp_path, rng, monkeypatch):
    out, stage = tmp_path / "out", tmp_path / "stage"
    finals = [str(out / f"ds_{k:06d}") for k in range(2)]
    for k, f in enumerate(finals):
        write_shard(str(stage / os.path.basename(f)), random_packs(rng, 2),
                    metadata={"set": {"id": "y" * 32, "index": k, "count": 2}})
    staged = StagedSet(tuple(StagedShard(str(stage / os.path.basename(f)), f) for f in finals),
                       ((str(out / "ds.json"), tuple(finals)),))
    os.makedirs(out)
    real, calls = publishing.commit_staged, []

    def die_after_first(a, b, *rest):
        real(a, b, *rest)
        calls.append(b)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(publishing, "commit_staged", die_after_first)
    with pytest.raises(KeyboardInterrupt):
        publishing.publish_set(staged, [])
    assert not (out / "ds.json").exists()  # no manifest: a reader of the set sees no set
    publishing.publish_set(staged, [], done=[0])
    assert calls == [finals[0], finals[1]] and len(load_manifest(str(out / "ds.json")).prefixes) == 2


class Lossy(Recorder):
    """A destination whose write of one file fails (``fail``: the Nth such write raises) or is
    silently lost (``lose``: the call returns, nothing is written): what read-back is for."""

    def __init__(self, lose=None, fail=None):
        super().__init__()
        self.lose, self.fail = lose, fail

    def write_bytes(self, path, data):
        if self.fail and path.endswith(self.fail):
            raise OSError(28, "No space left on device", path)
        if self.lose and path.endswith(self.lose):
            return
        self.log.append(("put", os.path.basename(path)))
        super().write_bytes(path, data)


def staged_set(tmp_path, rng, n=3, order=True):
    out, stage = tmp_path / "out", tmp_path / "stage"
    os.makedirs(out, exist_ok=True)
    finals = [str(out / f"ds_{k:06d}") for k in range(n)]
    for k, f in enumerate(finals):
        write_shard(str(stage / os.path.basename(f)), random_packs(rng, 2 + k),
                    metadata={"set": {"id": "z" * 32, "index": k, "count": n}})
    data = b"order bytes"
    record = OrderRecord(file="ds.order", size=len(data), crc32=zlib.crc32(data), seed=0, epochs=1, first_epoch=0,
                         topology={}, cost_model={}, exchange_window=1)
    orders = (publishing.StagedOrder(str(out / "ds.order"), data, str(out / "ds.json"), record),) if order else ()
    return StagedSet(tuple(StagedShard(str(stage / os.path.basename(f)), f) for f in finals),
                     ((str(out / "ds.json"), tuple(finals)),), orders), out


def test_one_set_commit_withdraws_the_manifest_then_shards_then_order_then_manifest(tmp_path, rng):
    staged, out = staged_set(tmp_path, rng)
    (out / "ds.json").write_text("{}")
    dest = Lossy()
    outcome = publishing.publish_set(staged, [], destination=dest)
    assert outcome.whole and set(outcome.written) == {str(out / "ds.order"), str(out / "ds.json")}
    assert dest.log[0] == ("remove", "ds.json")
    puts = [name for op, name in dest.log if op == "put"]
    assert puts[-2:] == ["ds.order", "ds.json"] and puts[-3] == "ds_000002.idx", puts
    assert json.loads((out / "ds.json").read_bytes())["order"] == staged.orders[0].record.to_dict()


def test_read_back_finds_a_write_the_destination_lost(tmp_path, rng):
    staged, out = staged_set(tmp_path, rng)
    outcome = publishing.publish_set(staged, [], destination=Lossy(lose="ds.order"))
    assert outcome.problems == [(str(out / "ds.order"), "missing")]
    with pytest.raises(IncompleteDestinationError, match="not whole after publishing: missing"):
        outcome.raise_if_incomplete()


def test_a_failed_write_is_raised_or_with_lenient_recorded_and_what_comes_after_it_not_written(tmp_path, rng):
    staged, out = staged_set(tmp_path, rng)
    with pytest.raises(OSError, match="No space"):
        publishing.publish_set(staged, [], destination=Lossy(fail="ds.order"))
    assert not (out / "ds.json").exists()   # the manifest that records the order was not written
    shards = [(s.staged, s.final) for s in staged.shards]
    files = [publishing.SetFile(str(out / "ds.order"), lambda: b"o", "pack order", (0, 1, 2)),
             publishing.SetFile(str(out / "ds.json"), lambda: b"{}", "manifest", (0, 1, 2),
                                after=(str(out / "ds.order"),), commit_point=True)]
    outcome = publishing.commit_set(Lossy(fail="ds.order"), shards, files=files, lenient=True)
    paths = [p for p, _ in outcome.problems]
    assert paths == [str(out / "ds.order"), str(out / "ds.json")], outcome.problems
    assert "No space" in outcome.problems[0][1] and "ds.order was not written" in outcome.problems[1][1]
    assert not (out / "ds.json").exists()


def test_read_back_finds_a_shard_file_that_differs_and_an_old_file_left(tmp_path, rng):
    staged, out = staged_set(tmp_path, rng, n=1, order=False)
    stale = out / "old.order"
    stale.write_bytes(b"x")

    class Keeps(Lossy):   # "removes" nothing, and the shard's .seq.idx is corrupted on the way
        def remove(self, paths):
            self.log += [("remove", os.path.basename(p)) for p in paths]

        def put(self, source, final):
            super().put(source, final)
            if final.endswith(".seq.idx"):
                with open(final, "r+b") as f:
                    f.seek(70)
                    b = f.read(1)
                    f.seek(70)
                    f.write(bytes([b[0] ^ 1]))

    outcome = publishing.publish_set(StagedSet(staged.shards, ()), [str(stale)], destination=Keeps())
    found = dict(outcome.problems)
    assert found[str(stale)].startswith("an old file")
    assert "header differs" in found[staged.shards[0].final + ".seq.idx"]
