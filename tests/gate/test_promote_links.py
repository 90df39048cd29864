"""Promotion of shards made of links publishes regular files holding the checked content.

Symbolic links are resolved: the destination receives a hard link to (or a copy of) the
link's target, never the link itself; a move removes the source links and leaves their
targets alone. A link that dangles -- at check time or since -- or that points at a
directory is refused, as is a target replaced after the check. Hard links (a file shared
with another shard) promote with ``--link`` as links to the same inode and never disturb
the other shard.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.gate import check, promote_report
from megatron_sft_idx.gate.cli import main as check_idx
from support.shardgen import random_packs, write_shard


def make(directory, name="s", seed=0):
    prefix = os.path.join(str(directory), name)
    write_shard(prefix, random_packs(np.random.default_rng(seed), 8), vocab_size=1000)
    return prefix


def contents(prefix):
    return {s: pathlib.Path(prefix + s).read_bytes() for s in ALL_SUFFIXES}


def linked_shard(tmp_path, relative=True):
    """A shard at tmp_path/staging/s whose five files are symbolic links into tmp_path/store."""
    real = make(tmp_path / "store", "real")
    (tmp_path / "staging").mkdir()
    src = str(tmp_path / "staging" / "s")
    for suffix in ALL_SUFFIXES:
        target = os.path.relpath(real + suffix, tmp_path / "staging") if relative else real + suffix
        os.symlink(target, src + suffix)
    return src, real


def assert_regular_copy_of(dest_prefix, want):
    for suffix in ALL_SUFFIXES:
        st = os.lstat(dest_prefix + suffix)
        assert stat.S_ISREG(st.st_mode), f"{suffix} is not a regular file at the destination"
    assert contents(dest_prefix) == want
    assert check(dest_prefix).passed


@pytest.mark.parametrize("relative", [True, False])
def test_symlinked_shard_is_moved_as_regular_files(tmp_path, relative):
    src, real = linked_shard(tmp_path, relative)
    want = contents(real)
    report = promote_report(check(src), tmp_path / "train")
    assert report.passed, report.format_text(True)
    dest = str(tmp_path / "train" / "s")
    assert_regular_copy_of(dest, want)
    assert not any(os.path.lexists(src + s) for s in ALL_SUFFIXES), "the source links stay after a move"
    assert contents(real) == want and check(real).passed, "a move must not touch the links' targets"


def test_symlinked_shard_with_link_shares_the_targets_inodes(tmp_path):
    src, real = linked_shard(tmp_path)
    report = promote_report(check(src), tmp_path / "train", link=True)
    assert report.passed, report.format_text(True)
    dest = str(tmp_path / "train" / "s")
    assert_regular_copy_of(dest, contents(real))
    for suffix in ALL_SUFFIXES:
        assert os.path.samefile(real + suffix, dest + suffix) == (suffix != ".idx")
        assert os.path.islink(src + suffix)


def test_dangling_link_is_never_promoted(tmp_path):
    src, real = linked_shard(tmp_path)
    os.remove(real + ".loss.bin")
    report = promote_report(check(src), tmp_path / "train")
    assert "FILE_MISSING" in report.shards[0].codes() and "NOT_PROMOTED" in report.shards[0].codes()
    assert not os.path.exists(tmp_path / "train") or os.listdir(tmp_path / "train") == []


def test_link_dangling_after_the_check_is_refused(tmp_path):
    src, real = linked_shard(tmp_path)
    report = check(src)
    os.remove(real + ".seq.bin")
    promote_report(report, tmp_path / "train")
    assert "PROMOTION_REFUSED" in report.shards[0].codes() and not report.passed
    assert not [n for n in os.listdir(tmp_path / "train") if not n.startswith(".")]
    assert all(os.path.islink(src + s) for s in ALL_SUFFIXES)


def test_target_replaced_after_the_check_is_refused(tmp_path):
    src, real = linked_shard(tmp_path)
    report = check(src)
    other = make(tmp_path / "other", "real", seed=9)  # same name, other content, new inodes
    shutil.copyfile(other + ".bin", real + ".bin.new")
    os.replace(real + ".bin.new", real + ".bin")
    promote_report(report, tmp_path / "train")
    assert "PROMOTION_REFUSED" in report.shards[0].codes()
    assert not os.path.exists(tmp_path / "train" / "s.idx")


def test_link_to_a_directory_is_unreadable(tmp_path, capsys):
    src, real = linked_shard(tmp_path)
    os.remove(src + ".seq.bin")
    os.symlink(str(tmp_path / "store"), src + ".seq.bin")
    report = promote_report(check(src), tmp_path / "train")
    assert "FILE_UNREADABLE" in report.shards[0].codes() and not report.passed
    assert check_idx(["--quiet", "--promote", str(tmp_path / "train"), src]) == 2
    assert not os.path.exists(tmp_path / "train") or os.listdir(tmp_path / "train") == []


def test_link_to_another_shards_file(tmp_path):
    """A companion linked in from another shard fails the check; a byte-identical one promotes
    as a regular file and the other shard keeps its own."""
    a, b = make(tmp_path / "a", seed=1), make(tmp_path / "b", seed=2)
    os.remove(a + ".loss.bin")
    os.symlink(b + ".loss.bin", a + ".loss.bin")
    assert not promote_report(check(a), tmp_path / "train").passed
    os.remove(a + ".loss.bin")
    twin = make(tmp_path / "twin", seed=1)  # the same packs: its .loss.bin equals a's
    os.symlink(twin + ".loss.bin", a + ".loss.bin")
    report = promote_report(check(a), tmp_path / "train")
    assert report.passed, report.format_text(True)
    assert_regular_copy_of(str(tmp_path / "train" / "s"), contents(twin))
    assert check(twin).passed and check(b).passed


@pytest.mark.parametrize("link", [True, False])
def test_hard_links_shared_with_another_shard(tmp_path, link):
    other = make(tmp_path / "other", "s", seed=3)
    (tmp_path / "staging").mkdir()
    src = str(tmp_path / "staging" / "s")
    for suffix in ALL_SUFFIXES:
        os.link(other + suffix, src + suffix)
    want = contents(other)
    report = promote_report(check(src), tmp_path / "train", link=link)
    assert report.passed, report.format_text(True)
    dest = str(tmp_path / "train" / "s")
    assert_regular_copy_of(dest, want)
    for suffix in ALL_SUFFIXES:
        assert os.path.samefile(other + suffix, dest + suffix) == (suffix != ".idx")
        assert os.path.exists(src + suffix) == link
    assert contents(other) == want and check(other).passed


def test_replacing_a_destination_made_of_links_leaves_their_targets(tmp_path):
    old, old_real = linked_shard(tmp_path)  # tmp_path/staging/s -> store/real.*
    shutil.move(str(tmp_path / "staging"), str(tmp_path / "train"))
    os.makedirs(tmp_path / "staging")
    src = make(tmp_path / "staging", seed=5)
    want, old_want = contents(src), contents(old_real)
    # The relative links moved with their directory: make them absolute to keep them valid.
    for suffix in ALL_SUFFIXES:
        os.remove(tmp_path / "train" / ("s" + suffix))
        os.symlink(old_real + suffix, tmp_path / "train" / ("s" + suffix))
    report = promote_report(check(src), tmp_path / "train", replace=True)
    assert report.passed, report.format_text(True)
    assert_regular_copy_of(str(tmp_path / "train" / "s"), want)
    assert contents(old_real) == old_want, "replacing links must not write through them"
    assert MMapIndexedDataset(old_real)[0] is not None
