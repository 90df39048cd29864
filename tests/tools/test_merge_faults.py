"""Fault injection into ``merge-shards``: signals at seeded points, a full disk, a read-only destination.

Signals. ``merge_shards OUT IN...`` runs in children forked from a warmed-up interpreter
(``tests/support/faults.py``); every filesystem step of the merge (creating the staging directory
and files, the kernel copies, index writes, fsyncs, renames, unlinks, removing the staging
directory) is counted, and the child sends itself SIGKILL, SIGTERM or SIGINT just before
step ``k`` -- drawn with a fixed seed over every step, plus the steps either side of the
commit point (the rename of the new ``.idx``). A new output and one replacing an older
merge (``--overwrite``) are both tried. A few real ``tools/merge_shards.py`` processes are
also killed after a seeded random delay. After each case:

* the exit status is the signal's: killed by SIGKILL (a shell shows 137), 143, 130; no traceback;
* before the commit point nothing opens at OUT (a replaced output may still be the old
  one); SIGTERM / SIGINT also leave no file of the output and no temporary; after it, OUT
  is exactly the concatenation of the inputs (and an interrupted tool says it was published);
* a rerun of the same merge succeeds, leaves the concatenation and no temporaries.

Disk faults. OUT on a 256 KiB tmpfs (or, where the sandbox cannot mount, ENOSPC injected into
the kernel copy and the fsync; EROFS into creating the staging directory): exit 1 with one
line naming OUT and the cause, nothing at OUT, no temporaries, the inputs untouched.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from support.faults import EXIT_BY_SIGNAL, ROOT, SIGNALS, Zygote, contents, leftovers, remount_read_only, seeded_cases
from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.tools.merge_cli import main as merge_main
from support.shardgen import random_packs, write_shard

pytestmark = pytest.mark.subprocess

SEED = 9191
CASES_PER_SIGNAL = 4
#: The filesystem steps of a merge, each a point where a signal may arrive.
MERGE_STEPS = ("os.mkdir", "os.open", "os.pwrite", "os.write", "os.fsync", "os.replace", "os.unlink",
               "megatron_sft_idx.tools.merge.copy_range", "shutil.rmtree")
COUNTS = (5, 7, 6)


def make_inputs(root, seed=0, counts=COUNTS, **kw):
    """Input shards under ``root`` and the packs their concatenation holds."""
    rng = np.random.default_rng(seed)
    prefixes, packs = [], []
    for k, n in enumerate(counts):
        part = random_packs(rng, n, **kw)
        prefix = str(root / f"in_{k}")
        write_shard(prefix, part, pack_size=kw.get("pack_size", 64), vocab_size=1000)
        prefixes.append(prefix)
        packs += part
    return prefixes, packs


def is_concatenation(prefix, packs) -> bool:
    ds = MMapIndexedDataset(prefix)
    return len(ds) == len(packs) and all(
        np.array_equal(ds[i].input_ids, a) and np.array_equal(ds[i].loss_mask, b)
        and np.array_equal(ds[i].seq_start_id, c) for i, (a, b, c) in enumerate(packs))


def names(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def opens(prefix):
    """The shard at ``prefix``, or None when nothing opens there (then no ``.idx`` exists)."""
    try:
        return MMapIndexedDataset(prefix)
    except ShardError:
        assert not os.path.exists(prefix + ".idx"), f"{prefix}.idx exists but the shard does not open"
        return None


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    prefixes, _ = make_inputs(root, counts=(2, 2))
    z = Zygote("megatron_sft_idx.tools.merge_cli:main", MERGE_STEPS, warm=[[str(root / "out"), *prefixes]])
    yield z
    z.close()


def setup_case(root, mode: str):
    """(inputs, packs, OUT, argv, old shard's bytes or None) of one merge."""
    prefixes, packs = make_inputs(root)
    out = str(root / "merged" / "all")
    old = None
    if mode == "overwrite":  # an older merge of other inputs sits at OUT
        (root / "old").mkdir()
        others, _ = make_inputs(root / "old", seed=1, counts=(3,))
        assert merge_main([out, *others, "--quiet"]) == 0
        old = contents(out)
    argv = [out, *prefixes, "--quiet"] + ["--overwrite"] * (mode == "overwrite")
    return prefixes, packs, out, argv, old


def check_outcome(result, sig, kill_at, commit, prefixes, packs, out, old, where):
    assert result["code"] == EXIT_BY_SIGNAL[sig], (where, result["code"], result["stderr"])
    assert "Traceback" not in result["stderr"], (where, result["stderr"])
    directory = os.path.dirname(out)
    ds = opens(out)
    if kill_at > commit:  # after the new .idx was renamed into place: the output is complete
        assert ds is not None and is_concatenation(out, packs), where
        if sig != signal.SIGKILL:
            assert "published completely" in result["stderr"], (where, result["stderr"])
    else:
        assert ds is None or (old is not None and contents(out) == old), where
        if sig != signal.SIGKILL:
            assert "nothing was published" in result["stderr"], (where, result["stderr"])
            assert not leftovers(directory), (where, os.listdir(directory))
            if old is None:
                assert not [n for n in names(directory) if n.startswith("all")], (where, names(directory))
    # The same merge again completes it and clears what a killed run left.
    assert merge_main([out, *prefixes, "--quiet", "--overwrite"]) == 0, where
    assert is_concatenation(out, packs), where
    assert not leftovers(directory), (where, os.listdir(directory))


@pytest.mark.parametrize("mode", ["new", "overwrite"])
def test_signal_before_merge_steps(zygote, tmp_path, mode):
    dry = setup_case(tmp_path / "dry", mode)
    steps = zygote.run(dry[3], 0, signal.SIGKILL, tmp_path)["steps"]
    assert is_concatenation(dry[2], dry[1])
    commit = steps.index(["replace", "all.idx"]) + 1  # 1-based step number of the commit point
    assert commit > 20, steps
    cases = seeded_cases(len(steps), [SEED, mode == "overwrite"], CASES_PER_SIGNAL)
    cases += [(sig, k) for sig in SIGNALS for k in (commit, commit + 1)]
    for n, (sig, kill_at) in enumerate(cases):
        root = tmp_path / f"case{n}"
        root.mkdir()
        prefixes, packs, out, argv, old = setup_case(root, mode)
        result = zygote.run(argv, kill_at, sig, root)
        where = f"{mode}, {signal.Signals(sig).name} before step {kill_at} {steps[kill_at - 1]} (commit {commit})"
        check_outcome(result, sig, kill_at, commit, prefixes, packs, out, old, where)


def many_inputs(root, n=150):
    """``n`` input shards (copies of one 20-pack shard) and the packs their concatenation holds."""
    import shutil

    (template,), packs = make_inputs(root, counts=(20,))
    prefixes = [template]
    for k in range(1, n):
        prefixes.append(str(root / f"copy_{k:03d}"))
        for suffix in contents(template):
            shutil.copyfile(template + suffix, prefixes[-1] + suffix)
    return prefixes, packs * n


@pytest.mark.parametrize("sig", SIGNALS)
def test_real_tool_killed_at_a_random_time(tmp_path, sig):
    """The real script, signalled at a seeded delay after its staging directory appeared."""
    prefixes, packs = many_inputs(tmp_path)
    out = str(tmp_path / "merged" / "all")
    os.makedirs(os.path.dirname(out))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "merge_shards.py"), out, *prefixes],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not leftovers(os.path.dirname(out)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(float(np.random.default_rng([SEED, sig]).uniform(0.0, 0.4)))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, EXIT_BY_SIGNAL[sig]), (proc.returncode, err)
    assert "Traceback" not in err, err
    ds = opens(out)
    assert ds is None or is_concatenation(out, packs)
    if proc.returncode == EXIT_BY_SIGNAL[sig] and sig != signal.SIGKILL and ds is None:
        assert "nothing was published" in err and not leftovers(os.path.dirname(out)), err
    assert merge_main([out, *prefixes, "--quiet", "--overwrite"]) == 0
    assert is_concatenation(out, packs) and not leftovers(os.path.dirname(out))


# --------------------------------------------------------------------------- disk faults


def big_inputs(root):
    """Three shards of ~100 KiB each: together larger than the 256 KiB tmpfs."""
    return make_inputs(root, counts=(12, 12, 12), pack_size=4096, full=True)


def assert_failed_cleanly(code, err, out, prefixes, before, cause, named=None):
    assert code == 1, err
    assert "Traceback" not in err and cause in err and (named or out) in err, err
    assert opens(out) is None
    assert not leftovers(os.path.dirname(out)), os.listdir(os.path.dirname(out))
    assert [contents(p) for p in prefixes] == before, "an input changed"


@pytest.mark.parametrize("fail", ["copy", "fsync"])
def test_full_disk(tmp_path, small_fs, monkeypatch, capsys, fail):
    prefixes, _ = big_inputs(tmp_path)
    before = [contents(p) for p in prefixes]
    if small_fs is not None and fail == "copy":
        out = str(small_fs / "all")
    else:  # no mount here (or the fsync case): the write fails as on a full disk
        from megatron_sft_idx import _atomic
        from megatron_sft_idx.tools import merge

        real_fsync = _atomic.fsync_file

        def copy_enospc(src, dst, count, **kw):
            os.write(dst, b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        def fsync_enospc(path):
            if path.endswith(".bin"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(path)

        if fail == "copy":
            monkeypatch.setattr(merge, "copy_range", copy_enospc)
        else:
            monkeypatch.setattr(_atomic, "fsync_file", fsync_enospc)
        out = str(tmp_path / "merged" / "all")
    code = merge_main([out, *prefixes, "--quiet"])
    assert_failed_cleanly(code, capsys.readouterr().err, out, prefixes, before, "No space left on device")
    if small_fs is not None and fail == "copy":
        assert os.statvfs(small_fs).f_bfree == os.statvfs(small_fs).f_blocks, "the staging files were not removed"


def test_read_only_destination(tmp_path, small_fs, monkeypatch, capsys):
    prefixes, _ = big_inputs(tmp_path)
    before = [contents(p) for p in prefixes]
    if small_fs is not None and remount_read_only(small_fs):
        out = str(small_fs / "all")
    else:  # no mount here: creating the staging directory fails as on a read-only filesystem
        real_mkdir = os.mkdir

        def read_only(path, *args, **kwargs):
            if ".tmp-" in os.fspath(path):
                raise OSError(errno.EROFS, "Read-only file system", path)
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", read_only)
        out = str(tmp_path / "merged" / "all")
        os.makedirs(os.path.dirname(out))
    code = merge_main([out, *prefixes, "--quiet"])
    err = capsys.readouterr().err
    assert_failed_cleanly(code, err, out, prefixes, before, "Read-only file system", named=os.path.dirname(out))
