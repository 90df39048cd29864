"""Fault injection into ``check_idx --promote``: signals, a full disk, a read-only destination.

Signals. ``check_idx --promote DEST [--link] [--replace] SRC`` runs in a process forked
from a warmed-up interpreter (so a case costs a fraction of a second). Every filesystem
step of the promotion (``os.link``, ``shutil.copyfile``, ``os.fsync``, ``os.unlink``,
``os.replace``) is counted, and the process sends itself SIGKILL, SIGTERM or SIGINT just
before step ``k`` -- ``k`` drawn with a fixed seed over every step, plus the step between
removing the old ``.idx`` and publishing the new one. A few real ``tools/check_idx.py``
processes are also killed after a seeded random delay. After each case:

* SIGTERM / SIGINT end the tool with 143 / 130 and no traceback;
* the destination either has no ``.idx`` (nothing opens there, the reader raises a named
  error) or opens as exactly one generation: the old one (``--replace``) or the new one;
* the new generation is readable at the source or at the destination (never lost);
* running the same promotion again succeeds and leaves no temporaries.

Disk faults. The destination is a size-limited tmpfs mounted for the test, or -- where the
sandbox cannot mount -- the same failures injected into the one copy helper
(``promote.copy_file``) and ``os.fsync``: ENOSPC while copying or syncing, EROFS on a
read-only destination (a read-only tmpfs remount when possible). The promotion fails with
``PROMOTION_FAILED`` (exit 1), the destination holds nothing new that opens and no
temporaries, an old shard being replaced stays intact when the failure precedes the
publication, and the source is untouched.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from support.faults import EXIT_BY_SIGNAL, ROOT, SIGNALS, Zygote, contents, leftovers, remount_read_only, seeded_cases
from support.generations import torn, write_generation
from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.gate import check, promote_report
from megatron_sft_idx.gate.cli import main as check_idx

pytestmark = pytest.mark.subprocess

SEED = 4242
CASES_PER_MODE = 4
OLD, NEW = 1, 2
#: The filesystem steps of a promotion, each a point where a signal may arrive.
PROMOTION_STEPS = ("os.link", "os.replace", "os.unlink", "os.fsync", "shutil.copyfile")

@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    warm = str(tmp_path_factory.mktemp("warm") / "shard")
    write_generation(warm, 0)
    z = Zygote("megatron_sft_idx.gate.cli:main", PROMOTION_STEPS, warm=[["--quiet", warm]])
    yield z
    z.close()


def generation_at(prefix: str):
    """The generation that opens at ``prefix``, or None when nothing opens (a named error)."""
    try:
        ds = MMapIndexedDataset(prefix)
    except ShardError:
        assert not os.path.exists(prefix + ".idx") or not os.path.exists(prefix + ".bin"), \
            f"{prefix}.idx exists but the shard does not open"
        return None
    why = torn(ds)
    assert why is None, why
    return ds.metadata.extra["generation"]


def setup_case(root, mode: str):
    """(source prefix, destination dir, argv) of one promotion; ``--replace`` has an old shard at DEST."""
    src_dir, dest = root / "staging", root / "train"
    src = str(src_dir / "shard")
    write_generation(src, NEW)
    if "replace" in mode:
        write_generation(str(dest / "shard"), OLD)
    argv = ["--quiet", "--promote", str(dest)] + ["--link"] * ("link" in mode) + ["--replace"] * (
        "replace" in mode) + [src]
    return src, str(dest), argv


def check_outcome(src: str, dest: str, mode: str, where: str = "") -> None:
    at_dest = generation_at(os.path.join(dest, "shard"))
    assert at_dest in ((None, OLD, NEW) if "replace" in mode else (None, NEW)), at_dest
    at_src = generation_at(src)
    assert at_src in (None, NEW)
    assert NEW in (at_src, at_dest), "the new generation is readable nowhere"
    # Running the promotion again (when the source is still there) completes it and clears leftovers.
    if at_src == NEW:
        report = promote_report(check(src), dest, link="link" in mode, replace=True)
        assert report.passed, report.format_text(True)
    assert generation_at(os.path.join(dest, "shard")) == NEW
    assert not leftovers(dest), (where, at_src, at_dest, os.getpid(), os.listdir(dest))


MODES = ("move", "link", "replace")


@pytest.mark.parametrize("mode", MODES)
def test_signal_before_promotion_steps(zygote, tmp_path, mode):
    """Seeded points over all steps, each signal, plus the step after the old .idx is removed."""
    steps = zygote.run(setup_case(tmp_path / "dry", mode)[2], 0, signal.SIGKILL, tmp_path)["steps"]
    assert len(steps) >= 10, steps
    cases = seeded_cases(len(steps), [SEED, MODES.index(mode)], CASES_PER_MODE)
    if mode == "replace":  # right after the old .idx is gone: the widest window of a replacement
        unlink = steps.index(["unlink", "shard.idx"]) + 1  # 1-based step number
        cases += [(sig, unlink + 1) for sig in SIGNALS]
    for n, (sig, kill_at) in enumerate(cases):
        root = tmp_path / f"case{n}"
        src, dest, argv = setup_case(root, mode)
        result = zygote.run(argv, kill_at, sig, root)
        where = f"{mode}, {signal.Signals(sig).name} before step {kill_at} {steps[kill_at - 1]}"
        assert result["code"] == EXIT_BY_SIGNAL[sig], (where, result["code"], result["stderr"])
        assert "Traceback" not in result["stderr"], (where, result["stderr"])
        check_outcome(src, dest, mode, where)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_real_tool_killed_at_a_random_time(tmp_path, sig):
    src, dest, argv = setup_case(tmp_path, "replace")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "check_idx.py"), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(float(np.random.default_rng([SEED, sig]).uniform(0.5, 3.0)))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    # Before main() runs (the interpreter still importing) Python's default handling applies:
    # killed by the signal, nothing touched yet. From main() on: the conventional exit code.
    assert proc.returncode in (0, -sig, EXIT_BY_SIGNAL[sig]), (proc.returncode, err)
    if proc.returncode in (0, EXIT_BY_SIGNAL[sig]) and sig != signal.SIGKILL:
        assert "Traceback" not in err, err
    check_outcome(src, dest, "replace")


# --------------------------------------------------------------------------- disk faults


def big_source(root) -> str:
    """A shard of ~600 KiB (larger than the small tmpfs)."""
    prefix = str(root / "staging" / "shard")
    from megatron_sft_idx import IndexedDatasetBuilder
    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16, vocab_size=60000, pack_size=4096) as b:
        for _ in range(80):
            ids = rng.integers(0, 60000, 4096)
            loss = np.zeros(4096, np.uint8)
            b.add_packed(ids, loss, np.array([0]))
    return prefix


def assert_failed_cleanly(report, src, before, dest_prefix, old=None):
    assert not report.passed and "PROMOTION_FAILED" in report.shards[0].codes(), report.format_text(True)
    assert contents(src) == before, "the source changed"
    assert not leftovers(os.path.dirname(dest_prefix)), leftovers(os.path.dirname(dest_prefix))
    if old is None:
        with pytest.raises(ShardError):
            MMapIndexedDataset(dest_prefix)
    else:
        assert contents(dest_prefix) == old, "the old shard was damaged by a failure before publication"


def test_full_disk(tmp_path, small_fs, monkeypatch):
    src = big_source(tmp_path)
    before = contents(src)
    if small_fs is not None:
        dest = small_fs / "train"
    else:  # no mount here: the copy helper fails as a full disk would
        promote_mod = importlib.import_module("megatron_sft_idx.gate.promote")

        def full(a, b):
            with open(b, "wb") as f:
                f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", b)

        def cross_device(a, b):
            raise OSError(errno.EXDEV, "Invalid cross-device link (injected)")

        monkeypatch.setattr(promote_mod.os, "link", cross_device)
        monkeypatch.setattr(promote_mod, "copy_file", full)
        dest = tmp_path / "train"
    report = promote_report(check(src), dest)
    assert_failed_cleanly(report, src, before, str(dest / "shard"))
    assert "No space left on device" in report.format_text(True)


@pytest.mark.parametrize("fail", ["copy", "fsync"])
def test_full_disk_while_replacing_keeps_the_old_shard(tmp_path, monkeypatch, fail):
    """ENOSPC while copying or syncing a temporary (injected: this must run everywhere)."""
    from megatron_sft_idx import _atomic
    promote_mod = importlib.import_module("megatron_sft_idx.gate.promote")

    src = big_source(tmp_path)
    before = contents(src)
    write_generation(str(tmp_path / "train" / "shard"), OLD)
    old = contents(str(tmp_path / "train" / "shard"))
    real_copy, real_fsync = promote_mod.copy_file, _atomic.fsync_file

    def copy_enospc(a, b):
        if a.endswith(".idx"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_copy(a, b)

    def fsync_enospc(path):
        if path.endswith(".idx") or ".bin.tmp-" in path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_fsync(path)

    if fail == "copy":
        monkeypatch.setattr(promote_mod, "copy_file", copy_enospc)
    else:
        monkeypatch.setattr(_atomic, "fsync_file", fsync_enospc)
    report = promote_report(check(src), tmp_path / "train", replace=True)
    assert_failed_cleanly(report, src, before, str(tmp_path / "train" / "shard"), old=old)


def test_read_only_destination(tmp_path, small_fs, monkeypatch):
    src = big_source(tmp_path)
    before = contents(src)
    if small_fs is not None and remount_read_only(small_fs):
        dest = small_fs  # the read-only filesystem itself
    else:  # no mount here: creating files at the destination fails as on a read-only filesystem
        promote_mod = importlib.import_module("megatron_sft_idx.gate.promote")

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system (injected)")

        monkeypatch.setattr(promote_mod.os, "link", read_only)
        monkeypatch.setattr(promote_mod, "copy_file", read_only)
        dest = tmp_path / "train"
    code = check_idx(["--quiet", "--promote", str(dest), src])
    assert code == 1
    report = promote_report(check(src), dest)
    assert_failed_cleanly(report, src, before, str(dest / "shard"))
    assert "Read-only file system" in report.format_text(True)
