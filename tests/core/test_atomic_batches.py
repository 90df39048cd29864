"""The file primitives that keep a unit's commit to about one sync's wait (issue 45): several files
synced at once, small files published beside a shard's own commit, stale temporaries found with
one listing of their directory, and no directory sync before a shard that replaces nothing."""

import os
import subprocess
import sys
import threading

import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import _atomic, publishing


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_fsync_files_syncs_every_file_at_once_and_raises_the_failure_after_all_ended(tmp_path, monkeypatch):
    paths = [str(tmp_path / f"f{k}") for k in range(4)]
    for p in paths:
        open(p, "wb").write(b"x")
    started, synced, waited_out, release = [], [], [], threading.Event()
    real = os.fsync

    def fsync(fd):
        started.append(fd)
        if len(started) < len(paths):   # every sync waits until all four have started: one after
            if not release.wait(10):    # another would wait here in vain
                waited_out.append(fd)
        else:
            release.set()
        real(fd)
        synced.append(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _atomic.fsync_files(paths)
    assert len(synced) == len(paths) and not waited_out
    started.clear(), synced.clear(), release.clear()
    with pytest.raises(FileNotFoundError):
        _atomic.fsync_files(paths[:2] + [str(tmp_path / "missing")] + paths[2:])
    assert len(synced) == len(paths)   # the others were synced before the error was raised


def test_write_files_atomically_publishes_after_alongside_and_nothing_when_it_fails(tmp_path):
    files = {str(tmp_path / "a.rows"): b"rows", str(tmp_path / "sub" / "b.skips"): b"skips"}
    os.makedirs(tmp_path / "sub")
    seen = []
    _atomic.write_files_atomically(files, alongside=lambda: seen.append(sorted(os.listdir(tmp_path))))
    (names,) = seen   # while the shard commits, only the temporaries exist
    assert "a.rows" not in names and [n for n in names if n.startswith("a.rows.tmp-")]
    assert all(open(p, "rb").read() == data for p, data in files.items())
    assert not [n for d in (tmp_path, tmp_path / "sub") for n in os.listdir(d) if ".tmp-" in n]

    def fail():
        raise RuntimeError("the shard's commit failed")

    again = {str(tmp_path / "a.rows"): b"new rows", str(tmp_path / "c.rows"): b"c"}
    with pytest.raises(RuntimeError, match="commit failed"):
        _atomic.write_files_atomically(again, alongside=fail)
    assert open(tmp_path / "a.rows", "rb").read() == b"rows" and not (tmp_path / "c.rows").exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_stale_temporaries_of_several_files_are_found_in_one_listing(tmp_path, monkeypatch):
    dead = _dead_pid()
    finals = [str(tmp_path / f"part_000001{s}") for s in (".bin", ".idx", ".rows")]
    stale = [f"{f}.tmp-{dead}-0000beef" for f in finals]
    neighbours = [str(tmp_path / f"part_000002.bin.tmp-{dead}-0000beef"), str(tmp_path / "part_000001.bin")]
    mine = f"{finals[0]}.tmp-{os.getpid()}-cafecafe"   # this process's own leftover is stale too
    for p in stale + neighbours + [mine]:
        open(p, "wb").close()
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d=".": listed.append(d) or real(d))
    removed = _atomic.clear_stale_temporaries(finals + [str(tmp_path / "absent" / "x.bin")])
    assert sorted(removed) == sorted(stale + [mine]) and len(listed) == 2   # the directory, the absent one
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in neighbours)


@pytest.mark.parametrize("replacing", [False, True])
def test_a_shard_that_replaces_nothing_syncs_its_directory_once(tmp_path, monkeypatch, replacing):
    prefix = str(tmp_path / "s")
    packs = random_packs(__import__("numpy").random.default_rng(3), 3)
    if replacing:
        write_shard(prefix, packs)
    synced = []
    monkeypatch.setattr(_atomic, "fsync_dir", lambda path: synced.append(path))
    write_shard(prefix, packs, overwrite=True) if replacing else write_shard(prefix, packs)
    # the new files are synced before any rename either way; the directory before the renames only
    # when an old file's removal must be durable first
    assert len(synced) == (2 if replacing else 1)
    assert publishing.existing_shard(prefix, committed=True)
