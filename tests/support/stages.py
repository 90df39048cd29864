"""The local engine's helpers of tests/preprocess/test_stages.py, shared with the Ray engine's and
the set readers' tests: a default preprocess-sft run on the bundled examples, and a directory's
files as bytes (outputs of differently-run pipelines are compared byte for byte). And a
preprocess-sft driver that kills itself at a chosen point of its stages (:func:`killed_driver`,
run by :func:`run_killed`), for the tests that ``--resume`` what it left."""

import os
import shutil
import subprocess
import sys

from megatron_sft_idx.preprocess import Config, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CHAT = [os.path.join(EXAMPLES, "conversations.jsonl"), os.path.join(EXAMPLES, "conversations_sharegpt.jsonl")]


def files_of(directory):
    """{name: bytes} of every regular file directly in ``directory`` (hidden work dirs excluded)."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, n))}


def preprocess(out_dir, **kw):
    kw.setdefault("tokenizer", TOKENIZER)
    kw.setdefault("pack_size", 1024)
    return run(Config(inputs=kw.pop("inputs", CHAT), output_prefix=os.path.join(out_dir, "ds"), progress=False, **kw))


def copy_runs(runs, tmp_path):
    """Each run directory of ``runs`` copied under ``tmp_path`` (a test may move or damage its copy)."""
    copies = []
    for src in runs:
        copy = str(tmp_path / os.path.basename(src))
        shutil.copytree(src, copy)
        copies.append(copy)
    return copies


def visible(directory):
    """The names in ``directory`` but the run's hidden record (``.ds.preprocess``), which stays."""
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def kill_after_receipt(step, n):
    """Kill point of :func:`killed_driver`: SIGKILL once the ``n``-th unit of ``step`` handed in its receipt."""
    return f"""
from megatron_sft_idx.preprocess.engines.mirrored import MirroredEngine
real = MirroredEngine.map
def map(self, step, units, on_done, on_progress=None):
    seen = [0]
    def done(receipt):
        on_done(receipt)
        if step.name == {step!r}:
            seen[0] += 1
            if seen[0] == {n!r}:
                os.kill(os.getpid(), signal.SIGKILL)   # no cleanup at all: the locks and the work stay
    return real(self, step, units, done, on_progress)
MirroredEngine.map = map
"""


def kill_after_step(step):
    """Kill point of :func:`killed_driver`: SIGKILL once every unit of ``step`` is done, before the next step."""
    return f"""
from megatron_sft_idx.preprocess.engines.mirrored import MirroredEngine
real = MirroredEngine.map
def map(self, step, units, on_done, on_progress=None):
    real(self, step, units, on_done, on_progress)
    if step.name == {step!r}:
        os.kill(os.getpid(), signal.SIGKILL)
MirroredEngine.map = map
"""


def kill_at_call(method, n, sig="SIGKILL"):
    """Kill point of :func:`killed_driver`: signal ``sig`` just before the ``n``-th call of ``ObjectStore.<method>``."""
    return f"""
from megatron_sft_idx.storage import objects
real, seen = objects.ObjectStore.{method}, [0]
def {method}(self, *args):
    seen[0] += 1
    if seen[0] == {n!r}:
        os.kill(os.getpid(), signal.{sig})   # SIGKILL: no cleanup at all (a lost node)
    return real(self, *args)
objects.ObjectStore.{method} = {method}
"""


def killed_driver(args, kill, ray_address=None, ray_env=None):
    """Source of a ``python -c`` preprocess-sft ``args`` dying at ``kill``; first joined to ``ray_address`` if given."""
    # (``ray_env``: the workers' environment of the job, as a user's job would set it)
    join = "" if ray_address is None else (
        f"import ray\nray.init(address={ray_address!r}, runtime_env={{'env_vars': {ray_env!r}}})\n")
    return (f"import os, signal, sys\n{kill}{join}"
            f"from megatron_sft_idx.preprocess.cli import main\nsys.exit(main({list(args)!r}))\n")


def run_killed(script, timeout=300):
    """The CompletedProcess (text, captured) of ``python -c script`` with this checkout first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
