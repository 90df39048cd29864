"""Process and disk faults during preprocessing (issue 9, items 7-9), on real processes and files.

* Signals: Ctrl-C (SIGINT to the process group) and SIGTERM (to the driver, or to the group)
  during ``--workers 2`` end the run within seconds with 130 / 143, leave no worker behind and
  publish nothing; SIGKILL of the driver takes its workers down too. Then ``--resume`` finishes
  with the bytes of an uninterrupted run, and a run without it clears the leftovers.
* Random seeded kill points (SIGKILL / SIGTERM / SIGINT at a random moment) then ``--resume``:
  byte-identical output every time.
* A kill after the last publish (before completion is recorded, or while the work directory
  is being removed): ``--resume`` claims the outputs as its own and finishes, exit 0.
* A publish killed half-way: no manifest exists (a reader of the set sees no set, never a mix),
  every prefix present is one complete shard, and ``--resume`` completes the set.
* Disk faults: a full disk and a read-only filesystem (a size-limited tmpfs when this machine
  lets us mount one; an RLIMIT_FSIZE write failure otherwise), an output prefix whose parent
  cannot be created: exit 1, one line naming the path, no traceback, nothing published.

Timeouts below are hang guards, never performance thresholds.
"""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_sft_idx.errors import ShardSetError
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.open import open_packed

from support.faults import run_leftovers

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
TOOL = os.path.join(ROOT, "tools", "preprocess_sft.py")
FLAGS = ["--pack-size", "1024", "--split", "90,10", "--max-packs-per-shard", "20", "--workers", "2",
         "--partition-bytes", "60K", "--batch-size", "32", "--quiet"]
ENV = dict(os.environ, PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3,200 conversations (the bundled example x8) and the output of one uninterrupted run;
    a 600-conversation file and its output, for the disk faults."""
    d = tmp_path_factory.mktemp("faults")
    data = open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8").read()
    (d / "in.jsonl").write_text(data * 8)
    t = time.monotonic()
    proc = subprocess.run(cmd(d / "ref" / "ds", d / "in.jsonl"), env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (d / "ref_seconds").write_text(str(time.monotonic() - t))
    (d / "small.jsonl").write_text("".join(data.splitlines(keepends=True)[:300]) * 2)
    proc = subprocess.run(cmd(d / "small_ref" / "ds", d / "small.jsonl"), env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return d


def cmd(prefix, inputs, *extra):
    return [sys.executable, TOOL, "--input", str(inputs), "--tokenizer", TOKENIZER, "--output-prefix", str(prefix),
            *FLAGS, *extra]


def outputs(directory):
    """{name: bytes} of the published files (shards and manifests) in ``directory``."""
    if not os.path.isdir(directory):
        return {}
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, n)) and not n.startswith(".")}


def descendants(pid):
    """Pids of every live descendant of ``pid`` (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Runs the tool with every tokenize worker held after its first partition (its part is in the
# store, its receipt not yet sent) until the file named by MSI_TEST_RELEASE exists: the run cannot
# finish before the test has signalled it, however loaded the machine. The signal ends the hold.
_HELD = r"""
import os, runpy, sys, time
from megatron_sft_idx.preprocess.tokenize import TokenizeStep
real, driver, release = TokenizeStep.run, os.getpid(), os.environ["MSI_TEST_RELEASE"]
def held(self, unit):
    receipt = real(self, unit)
    while os.getpid() != driver and not os.path.exists(release):
        time.sleep(0.01)
    return receipt
TokenizeStep.run = held
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def clean_signals():
    """In the child before exec: the signal state a shell gives a foreground command (default
    dispositions, nothing blocked), whatever the test process inherited or earlier tests left."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def start(prefix, inputs, *extra, held=False):
    """The tool in a session of its own; ``held``: its workers wait after their first partition
    (until ``<prefix>.release`` exists, which these tests never create: the signal ends them)."""
    argv, env = cmd(prefix, inputs, *extra), ENV
    if held:
        argv = [sys.executable, "-c", _HELD, *argv[1:]]
        env = dict(ENV, MSI_TEST_RELEASE=str(prefix) + ".release")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=clean_signals)


def wait_for_workers(proc, prefix, count=2, deadline=120):
    """Block until the run has ``count`` worker processes and has written part of its store."""
    parts = os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.preprocess", "store", "parts")
    end = time.monotonic() + deadline
    while time.monotonic() < end and proc.poll() is None:
        workers = descendants(proc.pid)
        if len(workers) >= count and os.path.isdir(parts) and os.listdir(parts):
            return workers
        time.sleep(0.02)
    raise AssertionError("the run finished (or never started its workers) before it could be interrupted")


def finish(proc, timeout=30):
    try:
        out, err = proc.communicate(timeout=timeout)  # exit within seconds: a hang fails here
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the run did not exit within the time limit after the signal")
    return proc.returncode, err


@pytest.mark.parametrize("how,code", [("group_sigint", 130), ("main_sigterm", 143), ("group_sigterm", 143)])
def test_signal_during_workers_exits_fast_with_no_orphans_and_nothing_published(corpus, tmp_path, how, code):
    prefix = tmp_path / "out" / "ds"
    proc = start(prefix, corpus / "in.jsonl", held=True)
    workers = wait_for_workers(proc, str(prefix))
    sig = signal.SIGINT if "sigint" in how else signal.SIGTERM
    if how.startswith("group"):
        os.killpg(proc.pid, sig)    # a terminal's Ctrl-C, or a scheduler signalling the job
    else:
        os.kill(proc.pid, sig)      # a scheduler signalling the main process only
    rc, err = finish(proc)
    assert rc == code and "interrupted; nothing was published" in err and "Traceback" not in err, (rc, err[-3000:])
    time.sleep(0.5)
    assert [w for w in workers if alive(w)] == []
    assert outputs(tmp_path / "out") == {}
    assert os.path.isdir(tmp_path / "out" / ".ds.preprocess")  # kept for --resume
    if how != "group_sigint":
        return  # (resuming is the same whatever the signal; once is enough here)
    done = subprocess.run(cmd(prefix, corpus / "in.jsonl", "--resume"), env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert outputs(tmp_path / "out") == outputs(corpus / "ref")
    assert run_leftovers(tmp_path / "out") == []


def test_sigkill_of_the_driver_takes_its_workers_down_and_the_next_run_clears_up(corpus, tmp_path):
    prefix = tmp_path / "out" / "ds"
    proc = start(prefix, corpus / "in.jsonl", held=True)
    workers = wait_for_workers(proc, str(prefix))
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(w) for w in workers):
        time.sleep(0.05)
    assert [w for w in workers if alive(w)] == []
    assert outputs(tmp_path / "out") == {}
    again = subprocess.run(cmd(prefix, corpus / "in.jsonl"), env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr  # no --resume: starts over, clearing the leftovers
    assert outputs(tmp_path / "out") == outputs(corpus / "ref")
    assert run_leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("seed", range(3))
def test_kill_at_a_random_point_then_resume_gives_identical_bytes(corpus, tmp_path, seed):
    rng = random.Random(seed)
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
    prefix = tmp_path / "out" / "ds"
    t0 = time.monotonic()
    proc = start(prefix, corpus / "in.jsonl")
    time.sleep(rng.uniform(0.05, 1.0) * float((corpus / "ref_seconds").read_text()))  # start-up .. publish
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    rc, _ = finish(proc)
    if rc == 0:  # it finished first: nothing to resume
        assert outputs(tmp_path / "out") == outputs(corpus / "ref")
        return
    killed_after = time.monotonic() - t0
    resumed = subprocess.run(cmd(prefix, corpus / "in.jsonl", "--resume", "--json"), env=ENV, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, (sig, killed_after, resumed.stderr)
    assert outputs(tmp_path / "out") == outputs(corpus / "ref"), (sig, killed_after)
    json.loads(resumed.stdout)["resumed_units"]  # reported


KILL_IN_PUBLISH = r"""
import os, signal, sys
from megatron_sft_idx import publishing
from megatron_sft_idx.preprocess.cli import main
moved, original = [0], publishing.commit_staged
def move_then_die(staged, final, *rest, **options):
    original(staged, final, *rest, **options)
    moved[0] += 1
    if moved[0] == int(os.environ["DIE_AFTER"]):
        os.kill(os.getpid(), int(os.environ["SIG"]))
publishing.commit_staged = move_then_die
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_publish_killed_half_way_is_all_or_nothing_for_a_reader_of_the_set(corpus, tmp_path, sig):
    prefix = tmp_path / "out" / "ds"
    first = subprocess.run(cmd(prefix, corpus / "in.jsonl", "--seed", "7"), env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    old = outputs(tmp_path / "out")
    assert "ds_train.json" in old and "ds_valid.json" in old
    args = cmd(prefix, corpus / "in.jsonl", "--overwrite")[2:]  # a new generation over the old one
    proc = subprocess.run([sys.executable, "-c", KILL_IN_PUBLISH, *args], env=dict(ENV, DIE_AFTER="2", SIG=str(sig)),
                          capture_output=True, text=True, timeout=600)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 143 and "interrupted while publishing; no manifest was written" in proc.stderr
    mid = outputs(tmp_path / "out")
    assert not [n for n in mid if n.endswith(".json")]  # no set is visible while it is mixed
    for name in mid:
        if name.endswith(".idx") and not name.endswith(".seq.idx"):
            MMapIndexedDataset(str(tmp_path / "out" / name[:-4]))  # every visible prefix is a whole shard
    for spec in (tmp_path / "out", tmp_path / "out" / "ds_train_*"):  # nor by directory or glob (issue 21)
        with pytest.raises(ShardSetError, match=r"\(train\): 2 of its \d+ shards .* is incomplete"):
            open_packed(str(spec))
    done = subprocess.run(cmd(prefix, corpus / "in.jsonl", "--overwrite", "--resume", "--json"), env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    # the second shard was moved, then the signal came before its receipt: redone (moves are idempotent)
    assert json.loads(done.stdout)["resumed_units"]["publish"] == 1
    assert outputs(tmp_path / "out") == outputs(corpus / "ref")
    whole = open_packed(str(tmp_path / "out" / "ds_train_*"))
    assert len(whole) == len(open_packed(str(tmp_path / "out" / "ds_train.json")))


KILL_AT_COMMIT = r"""
import os, shutil, signal, sys
from megatron_sft_idx.preprocess import receipts, workdir
from megatron_sft_idx.preprocess.cli import main
where = os.environ["WHERE"]
write, keep, retire = receipts.ReceiptBook.write, workdir.keep_only_record, workdir.WorkDir.retire
def write_then_die(self, unit, body, *args, **kwargs):
    if self.step == "done" and where == "before_done":
        os.kill(os.getpid(), signal.SIGKILL)   # every output is published, completion not recorded
    return write(self, unit, body, *args, **kwargs)
def keep_half_then_die(path):
    if where == "in_cleanup":                  # completion recorded, the work directory half reduced to it
        for name in os.listdir(path):
            if name != "receipts" and os.path.isdir(os.path.join(path, name)):
                shutil.rmtree(os.path.join(path, name))
                break
        os.kill(os.getpid(), signal.SIGKILL)
    keep(path)
def retire_then_die(self):
    retire(self)
    if where == "after_cleanup":               # all done, the process not yet exited
        os.kill(os.getpid(), signal.SIGKILL)
receipts.ReceiptBook.write = write_then_die
workdir.keep_only_record = keep_half_then_die
workdir.WorkDir.retire = retire_then_die
sys.exit(main(sys.argv[1:]))
"""


def mtimes(directory):
    return {n: os.stat(os.path.join(directory, n)).st_mtime_ns for n in outputs(directory)}


@pytest.mark.parametrize("where", ["before_done", "in_cleanup", "after_cleanup", "finished"])
def test_a_kill_after_the_last_publish_then_resume_finishes_without_redoing_or_refusing(corpus, tmp_path, where):
    """The outputs are all under final names when the kill lands (or the run finished): ``--resume``
    recognises them as this run's own (never "output already exists"); once the run recorded its
    completion, it is a no-op that touches no output, however often it is repeated."""
    prefix = tmp_path / "out" / "ds"
    args = cmd(prefix, corpus / "in.jsonl")[2:]
    proc = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, *args], env=dict(ENV, WHERE=where),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == (0 if where == "finished" else -signal.SIGKILL), proc.stderr
    assert outputs(tmp_path / "out") == outputs(corpus / "ref")  # published before the kill
    before = mtimes(tmp_path / "out")
    for attempt in range(2):   # a preemption wrapper reruns with --resume, whatever happened
        done = subprocess.run(cmd(prefix, corpus / "in.jsonl", "--resume", "--json"), env=ENV, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        resumed = json.loads(done.stdout)["resumed_units"]
        if where == "before_done" and attempt == 0:
            assert resumed["publish"] == len([n for n in outputs(corpus / "ref") if n.endswith(".seq.idx")])
            assert resumed["materialize"] == resumed["publish"]   # published shards are verified, not rewritten
            before = mtimes(tmp_path / "out")                     # (the manifests were written again)
        else:
            assert resumed == {"done": 1}             # nothing redone: the recorded summary is reported
            assert mtimes(tmp_path / "out") == before
        assert outputs(tmp_path / "out") == outputs(corpus / "ref")
        assert run_leftovers(tmp_path / "out") == []


def test_resume_of_a_finished_run_whose_outputs_changed_publishes_them_again(corpus, tmp_path):
    """A finished run's record pins every output's size and CRC-32: an output edited in place
    (same size) or deleted since is no longer "done", and ``--resume`` publishes the run again."""
    prefix = tmp_path / "out" / "ds"
    assert subprocess.run(cmd(prefix, corpus / "small.jsonl"), env=ENV, capture_output=True, timeout=600).returncode == 0
    shard = sorted(n for n in outputs(tmp_path / "out") if n.endswith(".loss.bin"))[0]
    data = bytearray((tmp_path / "out" / shard).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "out" / shard).write_bytes(bytes(data))
    os.unlink(tmp_path / "out" / sorted(outputs(tmp_path / "out"))[-1])
    done = subprocess.run(cmd(prefix, corpus / "small.jsonl", "--resume", "--json"), env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resumed_units"] != {"done": 1}
    assert outputs(tmp_path / "out") == outputs(corpus / "small_ref")


SLOW_PROOF = r"""
import os, signal, sys, threading, time
from megatron_sft_idx.preprocess import driver
from megatron_sft_idx.preprocess.cli import main
def endless(path, stop=None):       # an input too large to hash before the signal: only ``stop`` ends it
    time.sleep(0.5)                 # (the main thread is waiting for the hashes by now)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)   # Ctrl-C, given by the kernel to this thread
    while stop is None or not stop.is_set():
        time.sleep(0.01)
driver.sha256_file = endless
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_a_finished_run_proves_its_inputs_ends_the_tool(corpus, tmp_path):
    """--resume of a finished run hashes its inputs in threads: an interrupt stops them within a
    block, and the tool exits 130 (the subprocess timeout is a hang guard). The SIGINT lands on
    another thread than the main one, as the kernel may deliver a terminal's Ctrl-C: the main
    thread, waiting for the hashes, must still wake to run its handler (it slept through it once,
    under load, until the 120 s guard)."""
    prefix = tmp_path / "out" / "ds"
    assert subprocess.run(cmd(prefix, corpus / "small.jsonl"), env=ENV, capture_output=True, timeout=600).returncode == 0
    proc = subprocess.run([sys.executable, "-c", SLOW_PROOF, *cmd(prefix, corpus / "small.jsonl", "--resume")[2:]],
                          env=ENV, capture_output=True, text=True, timeout=120, preexec_fn=clean_signals)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert outputs(tmp_path / "out") == outputs(corpus / "small_ref")


#: The filesystem steps of a run's last phase (publish, record, cleanup), each a point where a kill may land.
TAIL_STEPS = ("os.replace", "os.unlink", "shutil.rmtree", "os.rename")
TAIL_FLAGS = ["--pack-size", "1024", "--split", "80,20", "--max-packs-per-shard", "6", "--workers", "1", "--quiet"]


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    """A warmed zygote running preprocess-sft, a 120-conversation input and its clean outputs."""
    from support.faults import Zygote

    d = tmp_path_factory.mktemp("tail")
    data = open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8").readlines()[:120]
    (d / "in.jsonl").write_text("".join(data))
    argv = lambda out: ["--input", str(d / "in.jsonl"), "--tokenizer", TOKENIZER, "--output-prefix", str(out),
                        *TAIL_FLAGS]
    z = Zygote("megatron_sft_idx.preprocess.cli:main", TAIL_STEPS, warm=[argv(d / "warm" / "ds")])
    yield d, argv, z
    z.close()


def test_a_preemption_wrapper_that_always_resumes_always_succeeds(tail, tmp_path):
    """SIGKILL at every filesystem step of the run's last phase (publishing the shards and the
    manifests, recording completion, reducing the work directory to the record), then
    ``--resume``, as a wrapper around a preemptible job does: exit 0 every time, never "pass
    --overwrite", and the bytes of an uninterrupted run."""
    import signal as sig

    d, argv, z = tail
    first = z.run(argv(tmp_path / "clean" / "ds"), 0, sig.SIGKILL, tmp_path)
    assert first["code"] == 0, first["stderr"]
    ref = outputs(tmp_path / "clean")
    steps = first["steps"]
    start = _first_publish(steps)
    assert len(steps) - start >= 10
    for k in range(start + 1, len(steps) + 2):
        out = tmp_path / f"k{k}"
        killed = z.run(argv(out / "ds"), k, sig.SIGKILL, tmp_path)
        assert killed["code"] == (-sig.SIGKILL if k <= len(steps) else 0), (k, killed["stderr"])
        resumed = z.run(argv(out / "ds") + ["--resume"], 0, sig.SIGKILL, tmp_path)
        assert resumed["code"] == 0, (k, steps[k - 1] if k <= len(steps) else None, resumed["stderr"])
        assert outputs(out) == ref, k
        assert run_leftovers(out) == [], k


def _first_publish(steps) -> int:
    """Index of the publish's first step: removing the set's manifests (nothing else touches them)."""
    for i, (name, where) in enumerate(steps):
        if name == "unlink" and where == "ds_train.json":
            return i
    raise AssertionError(f"no publish step among {steps[-30:]}")


# ---------------------------------------------------------------- disk faults


@contextlib.contextmanager
def tmpfs(path, size):
    """A size-limited tmpfs at ``path``, or None where this machine does not let us mount one
    (or ``SFT_TEST_NO_MOUNT=1`` asks for the fallback)."""
    os.makedirs(path, exist_ok=True)
    if os.environ.get("SFT_TEST_NO_MOUNT") == "1":
        yield None
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        yield None
        return
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


FSIZE_LIMITED = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from megatron_sft_idx.preprocess.cli import main
sys.exit(main(sys.argv[2:]))
"""


def assert_clean_failure(proc, *expected):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr and all(e in lines[0] for e in expected), lines


@pytest.mark.parametrize("size", ["96k", "300k", "700k", "1200k"])
def test_a_full_disk_is_a_named_error_and_resume_finishes_after_space_is_freed(corpus, tmp_path, size):
    small = corpus / "small.jsonl"
    with tmpfs(tmp_path / "disk", size) as disk:
        if disk is None:  # no mount here: a file-size limit makes the writes fail instead
            disk = str(tmp_path / "disk")
            limit = {"96k": 4_000, "300k": 12_000, "700k": 30_000, "1200k": 400_000}[size]
            proc = subprocess.run([sys.executable, "-c", FSIZE_LIMITED, str(limit),
                                   *cmd(os.path.join(disk, "ds"), small)[2:]],
                                  env=ENV, capture_output=True, text=True, timeout=600)
            expected, free = "cannot write: a file exceeds the size limit", None
        else:
            proc = subprocess.run(cmd(os.path.join(disk, "ds"), small), env=ENV, capture_output=True, text=True,
                                  timeout=600)
            expected = "cannot write: no space left on the device"
            free = ["mount", "-o", "remount,size=64m", disk]
        if proc.returncode == 0:  # it fitted: the full output is there
            assert outputs(disk) == outputs(corpus / "small_ref")
            return
        assert_clean_failure(proc, expected, disk, "--resume")
        assert outputs(disk) == {}
        if free:
            subprocess.run(free, check=True)
        done = subprocess.run(cmd(os.path.join(disk, "ds"), small, "--resume"), env=ENV, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert outputs(disk) == outputs(corpus / "small_ref")


def test_a_read_only_filesystem_is_a_named_error(corpus, tmp_path):
    small = tmp_path / "in.jsonl"
    small.write_text("".join(open(corpus / "in.jsonl", encoding="utf-8").readlines()[:200]))
    with tmpfs(tmp_path / "ro", "4m") as disk:
        if disk is None:
            if os.geteuid() == 0:
                pytest.skip("cannot mount a tmpfs, and permissions do not bind root: no read-only place to test")
            disk = str(tmp_path / "ro")
            os.chmod(disk, 0o555)
            expected = "permission denied"
        else:
            os.makedirs(os.path.join(disk, "sub"))
            subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
            expected = "the filesystem is read-only"
        for prefix in (os.path.join(disk, "ds"), os.path.join(disk, "sub", "ds"), os.path.join(disk, "new", "ds")):
            proc = subprocess.run(cmd(prefix, small), env=ENV, capture_output=True, text=True, timeout=600)
            assert_clean_failure(proc, f"cannot write: {expected}", disk)
        store = subprocess.run(cmd(tmp_path / "ok" / "ds", small, "--store", os.path.join(disk, "store")), env=ENV,
                               capture_output=True, text=True, timeout=600)
        assert_clean_failure(store, f"cannot write: {expected}")
        assert outputs(tmp_path / "ok") == {}


def test_an_output_whose_parent_cannot_be_created_is_a_named_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    small = tmp_path / "in.jsonl"
    small.write_text(open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8").readline())
    for prefix, why in ((tmp_path / "file" / "ds", "a file is in the way of a directory"),
                        (tmp_path / "file" / "deeper" / "ds", "a parent of this path is not a directory")):
        proc = subprocess.run(cmd(prefix, small), env=ENV, capture_output=True, text=True, timeout=600)
        assert_clean_failure(proc, f"cannot write: {why}", str(tmp_path / "file"))
    assert sorted(os.listdir(tmp_path)) == ["file", "in.jsonl"]
    shutil.rmtree(tmp_path / "file", ignore_errors=True)
