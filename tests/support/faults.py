"""Fault injection shared by the suites that kill tools and fill disks (promotion, merge).

Signals at chosen steps. :class:`Zygote` is a warmed-up interpreter that forks one child per
case. The child wraps the filesystem steps it is told to count (``"os.replace"``,
``"megatron_sft_idx.tools.merge.copy_range"``, ...), sends itself SIGKILL, SIGTERM or SIGINT
just before step ``k`` (0: never), and runs the tool's ``main(argv)``; the zygote reports its
exit status (``-signal`` when killed), the steps it counted and its stderr. A case costs a
fork, not an interpreter start and a numba cache load, so a suite can afford dozens.

Disk faults. :func:`tmpfs` mounts a size-limited (optionally read-only) tmpfs for a test
where the sandbox allows mounting, and yields None where it does not; the suites then inject
the same failure (ENOSPC, EROFS) into the one helper that writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import uuid
from typing import Dict, Iterator, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Exit status of a tool that received the signal: killed (``-9``; a shell shows 137), 143, 130.
EXIT_BY_SIGNAL = {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: 143, signal.SIGINT: 130}
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)

_ZYGOTE = r"""
import contextlib, importlib, io, json, os, sys, threading
spec = json.loads(sys.argv[1])

def resolve(dotted):
    module, _, name = dotted.rpartition(".")
    return importlib.import_module(module), name

module, _, function = spec["main"].partition(":")
main = getattr(importlib.import_module(module), function)
for argv in spec["warm"]:  # load the kernels once, here, not in every child
    with contextlib.redirect_stdout(io.StringIO()):  # stdout carries the results
        if main(argv) != 0:
            sys.exit(f"warm-up {argv} failed")

def instrument(kill_at, sig, log_path):
    log = open(log_path, "w", buffering=1)
    count = [0]
    lock = threading.Lock()   # steps may run on several threads at once (fsyncs of a shard's files)
    def wrap(owner, name):
        real = getattr(owner, name)
        def step(*args, **kwargs):
            where = args[-1] if args and isinstance(args[-1], (str, bytes, os.PathLike)) else ""
            with lock:
                count[0] += 1
                log.write(json.dumps([name, os.path.basename(str(where))]) + "\n")
                now = count[0] == kill_at
            if now:
                os.kill(os.getpid(), sig)
            return real(*args, **kwargs)
        setattr(owner, name, step)
    for dotted in spec["steps"]:
        wrap(*resolve(dotted))

for line in sys.stdin:
    case = json.loads(line)
    pid = os.fork()
    if pid == 0:
        err = os.open(case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        out = os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
        instrument(case["kill_at"], case["sig"], case["counter"])
        os._exit(main(case["argv"]))
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    steps = [json.loads(l) for l in open(case["counter"])] if os.path.exists(case["counter"]) else []
    print(json.dumps({"code": code, "steps": steps}), flush=True)
"""


class Zygote:
    """A warmed-up interpreter forking one instrumented run of ``main`` per case.

    Args:
        main: ``"module:function"``, a tool's ``main(argv) -> int``.
        steps: dotted names of the functions counted as steps (module attribute last).
        warm: argv lists run once in the zygote before any case (each must exit 0).
    """

    def __init__(self, main: str, steps: Sequence[str], warm: Sequence[Sequence[str]] = ()) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        spec = json.dumps({"main": main, "steps": list(steps), "warm": [list(a) for a in warm]})
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, spec], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, argv: Sequence[str], kill_at: int, sig: int, work: pathlib.Path) -> Dict:
        """One case: ``{"code", "steps": [[name, file], ...], "stderr"}``."""
        case = {"argv": list(argv), "kill_at": kill_at, "sig": int(sig), "stderr": str(work / "stderr"),
                "counter": str(work / f"steps-{uuid.uuid4().hex}")}
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self.proc.wait(timeout=30)}) before case {case}")
        result = json.loads(line)
        result["stderr"] = pathlib.Path(case["stderr"]).read_text()
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


def seeded_cases(n_steps: int, seed: Sequence[int], per_signal: int) -> List[tuple]:
    """``(signal, step)`` pairs: ``per_signal`` steps drawn with a fixed seed for each signal."""
    import numpy as np

    rng = np.random.default_rng(list(seed))
    return [(sig, int(k)) for sig in SIGNALS for k in rng.integers(1, n_steps + 1, per_signal)]


# --------------------------------------------------------------------------- disks


def _mount(path, options: str) -> bool:
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def remount_read_only(path) -> bool:
    """Make a mounted tmpfs read-only; False where the sandbox refuses."""
    return subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: pathlib.Path, size: str = "256k") -> Iterator[Optional[pathlib.Path]]:
    """A tmpfs of ``size`` mounted at ``path`` (created), or None where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = _mount(path, f"size={size},mode=755")
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


# --------------------------------------------------------------------------- outcomes


def contents(prefix: str) -> Dict[str, bytes]:
    """Every existing file of a shard, by suffix."""
    from megatron_sft_idx.format import ALL_SUFFIXES

    return {s: pathlib.Path(prefix + s).read_bytes() for s in ALL_SUFFIXES if os.path.exists(prefix + s)}


def leftovers(directory) -> List[str]:
    """Temporaries (files or staging directories) a writer left in ``directory``."""
    return [n for n in os.listdir(directory) if ".tmp-" in n] if os.path.isdir(directory) else []


def run_leftovers(directory) -> List[str]:
    """Hidden entries and temporaries a preprocessing run left in ``directory``, beside the
    record a finished run keeps (``.NAME.preprocess/receipts/done/000000.json`` and nothing else)."""
    out = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        full = os.path.join(directory, name)
        if name.startswith(".") and name.endswith(".preprocess") and _only_record(full):
            continue
        if name.startswith(".") or ".tmp-" in name or ".work-" in name:
            out.append(name)
    return out


def _only_record(path) -> bool:
    found = [os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names]
    return found == [os.path.join("receipts", "done", "000000.json")]
