"""SIGKILL while a shard is being (re)written never leaves a readable shard with wrong contents.

A forked child rewrites the same prefix over and over with ``overwrite=True``,
alternating two contents A and B whose files have identical sizes (so only the
publish order, not a size check, can keep them apart). The child is killed
either at an exact rename of the publish (every boundary) or at a random time.
Afterwards the prefix either does not open (and has no ``.idx``, so upstream
megatron-core cannot open it either) or opens as exactly A or exactly B; the
next build to the prefix clears the dead writer's temporaries.
"""

import multiprocessing
import os
import signal
import time
import zlib

import numpy as np
import pytest

from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.format import ALL_SUFFIXES, PUBLISH_ORDER
from support.shardgen import random_packs

pytestmark = pytest.mark.subprocess

RENAMES_PER_BUILD = len(PUBLISH_ORDER)


def make_contents(seed):
    """Two pack lists with the same lengths and sequence counts but different values."""
    rng = np.random.default_rng(seed)
    a = random_packs(rng, 40, pack_size=32, vocab=1000)
    b = []
    for ids, loss, starts in a:
        new_loss = rng.integers(0, 2, len(ids)).astype(np.uint8)
        new_loss[np.append(starts[1:], len(ids)) - 1] = 0
        b.append(((ids + 1 + rng.integers(0, 5, len(ids))) % 1000, new_loss, starts))
    return a, b


def build(prefix, packs):
    with IndexedDatasetBuilder(prefix, pack_size=32, vocab_size=1000, overwrite=True) as builder:
        for p in packs:
            builder.add_packed(*p)


def die_before_rename(n):
    """Make this (child) process SIGKILL itself just before its n-th ``os.replace`` call."""
    real_replace = os.replace
    calls = [0]

    def replace(src, dst):
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        real_replace(src, dst)
        time.sleep(0.001)  # widen the window between renames for the random-time kills

    os.replace = replace


def rewrite_forever(prefix, contents, die_before_replace, ready):
    """Child: alternate A and B forever; optionally SIGKILL itself before the n-th rename."""
    die_before_rename(die_before_replace)
    try:
        for i in range(10 ** 9):
            build(prefix, contents[i % 2])
            if i == 0:
                ready.set()
    finally:
        os._exit(3)  # never return into the parent's pytest


def matches(ds, packs):
    return all(np.array_equal(ds[i].input_ids, ids) and np.array_equal(ds[i].loss_mask, loss)
               and np.array_equal(ds[i].seq_start_id, starts) for i, (ids, loss, starts) in enumerate(packs))


def check_prefix(prefix, contents):
    """Returns 'none', 'A' or 'B'; fails on anything else."""
    try:
        ds = MMapIndexedDataset(prefix, check_packs=True)
    except ShardError:
        assert not os.path.exists(prefix + ".idx"), "a prefix with an .idx must open"
        return "none"
    for suffix, digest in ds.metadata.files.items():  # every file belongs to the same build
        with open(prefix + suffix, "rb") as f:
            assert zlib.crc32(f.read()) == digest.crc32, suffix
    for name, packs in zip("AB", contents):
        if matches(ds, packs):
            return name
    raise AssertionError("the shard opened with contents of neither complete build")


def kill_and_check(tmp_path, contents, die_before_replace, delay):
    prefix = str(tmp_path / "s")
    build(prefix, contents[0])
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=rewrite_forever, args=(prefix, contents, die_before_replace, ready))
    child.start()
    try:
        assert ready.wait(30), "child did not finish its first build"
        if delay is not None:
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    outcome = check_prefix(prefix, contents)
    # The next build to the prefix clears what the dead writer left.
    build(prefix, contents[1])
    assert sorted(os.listdir(tmp_path)) == sorted("s" + s for s in ALL_SUFFIXES)
    assert check_prefix(prefix, contents) == "B"
    return outcome


@pytest.fixture(scope="module")
def contents():
    return make_contents(7)


@pytest.mark.parametrize("rename", range(2 * RENAMES_PER_BUILD))
def test_kill_at_every_rename_boundary(tmp_path, contents, rename):
    # The child's first build publishes with renames 0..4 before it signals ready, so kill points
    # start in its second build (B replacing A) and continue into its third (A replacing B).
    outcome = kill_and_check(tmp_path, contents, RENAMES_PER_BUILD + rename, delay=None)
    assert outcome == "none"  # the old .idx is gone before the first rename of a replacement


def test_kill_at_random_times(tmp_path, contents):
    rng = np.random.default_rng(2024)
    outcomes = [kill_and_check(tmp_path, contents, -1, float(rng.uniform(0, 0.12))) for _ in range(12)]
    assert set(outcomes) <= {"none", "A", "B"}


def first_build(prefix, packs, die_before_replace):
    die_before_rename(die_before_replace)
    try:
        with IndexedDatasetBuilder(prefix, pack_size=32, vocab_size=1000) as builder:
            for p in packs:
                builder.add_packed(*p)
    finally:
        os._exit(3)


@pytest.mark.parametrize("rename", range(RENAMES_PER_BUILD))
def test_kill_during_first_build_then_build_without_overwrite(tmp_path, contents, rename):
    """Leftovers of a killed first build are not a shard: the next build needs no overwrite."""
    prefix = str(tmp_path / "s")
    child = multiprocessing.get_context("fork").Process(target=first_build, args=(prefix, contents[0], rename))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert check_prefix(prefix, contents) == "none"
    with IndexedDatasetBuilder(prefix, pack_size=32, vocab_size=1000) as builder:
        for p in contents[1]:
            builder.add_packed(*p)
    assert sorted(os.listdir(tmp_path)) == sorted("s" + s for s in ALL_SUFFIXES)
    assert check_prefix(prefix, contents) == "B"
