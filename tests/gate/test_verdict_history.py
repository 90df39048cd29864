"""A gate verdict is a function of the bytes alone, never of what the process ran before.

A corpus of shards -- pristine ones of three shapes, targeted corruptions at the integer
and nesting limits (header counts of 2^56 and 2^64 - 1, metadata integers beyond int64,
4000-digit numbers, ``1e999``, nesting 65 and 300 deep), sealed pack-invariant breaks and
seeded random mutations -- is checked

* in this long-lived process, in two random orders, after numba's dispatchers were primed
  with other integer types (what made a kernel specialised by an earlier call overflow on
  a later huge count), and
* fresh: each shard in a new process that has imported the gate but never run a kernel
  (forked from a pristine interpreter, so no numba specialisation exists yet),

and every shard's findings (code, severity, file, pack, offset, message) must be identical
everywhere. No verdict may be an internal error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from support.corrupt import hostile_corpus
from megatron_sft_idx import _kernels
from megatron_sft_idx.gate import check
from support.shardgen import random_packs, write_shard

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 20240917

#: Runs in a new interpreter: import the gate, then fork one child per shard so each check
#: runs in a process where none of the project's kernels has been called (numba compiles or
#: loads a specialisation per call type). An unrelated function warms numba's compiler up
#: once, so that each child costs a fraction of a second instead of seconds.
FRESH_RUNNER = r"""
import json, os, sys
import numba, numpy
from megatron_sft_idx.gate import check

numba.njit(lambda a: a.sum())(numpy.ones(2))

def verdict(prefix):
    shard = check(prefix).shards[0]
    return [shard.passed, [[f.code, f.severity, f.file, f.pack, f.offset, f.message] for f in shard.findings]]

out = {}
for prefix in json.loads(sys.stdin.read()):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            data = json.dumps(verdict(prefix)).encode()
        except BaseException as exc:
            data = json.dumps(["crash", repr(exc)]).encode()
        with os.fdopen(write, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out[prefix] = json.loads(f.read())
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


def verdict(prefix):
    shard = check(prefix).shards[0]
    return [shard.passed, [[f.code, f.severity, f.file, f.pack, f.offset, f.message] for f in shard.findings]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    bases = {}
    for name, kw in {"u16": dict(vocab_size=1000), "i32": dict(vocab_size=70000, dtype=np.int32),
                     "pad4": dict(vocab_size=1000, metadata={"pad_seq_to_mult": 4})}.items():
        rng = np.random.default_rng(len(name))
        pad = kw.get("metadata", {}).get("pad_seq_to_mult", 1)
        prefix = str(root / f"base-{name}")
        write_shard(prefix, random_packs(rng, 16, vocab=kw["vocab_size"], pad_mult=pad), **kw)
        bases[name] = prefix
    cases = root / "cases"
    cases.mkdir()
    return hostile_corpus(cases, bases, SEED, mutations_per_base=2, targeted={"u16", "i32"})


def prime_dispatchers():
    """Compile kernel specialisations for other integer types, as earlier callers could have."""
    offsets = np.arange(4, dtype=np.int64)
    for total in (np.int32(3), np.uint64(3), np.int16(3)):
        _kernels._offset_chain(offsets, total, total, total)
    lengths = np.ones(3, np.int32)
    for itemsize, limit in ((np.int32(2), np.int32(6)), (np.uint64(2), np.uint64(6))):
        _kernels._pointer_chain(lengths, np.array([0, 2, 4]), itemsize, limit, itemsize)
    ids, loss, starts = np.array([1, 2], np.uint16), np.array([1, 0], np.uint8), np.array([0], np.int32)
    for scalar in (np.int32, np.uint64):
        _kernels._check_pack(ids, loss, starts, scalar(8), scalar(65535), scalar(10), scalar(1), scalar(0))


def test_verdicts_are_the_same_fresh_and_in_a_long_lived_process(corpus):
    prefixes = [p for _, p in corpus]
    names = {p: n for n, p in corpus}
    prime_dispatchers()
    rng = np.random.default_rng(SEED)
    long_lived = [{}, {}]
    for run in long_lived:
        for i in rng.permutation(len(prefixes)):
            run[prefixes[i]] = verdict(prefixes[i])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", FRESH_RUNNER], input=json.dumps(prefixes), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout)
    for prefix in prefixes:
        assert fresh[prefix][0] != "crash", (names[prefix], fresh[prefix])
        assert long_lived[0][prefix] == long_lived[1][prefix] == fresh[prefix], names[prefix]
        codes = {f[0] for f in fresh[prefix][1]}
        assert "GATE_INTERNAL_ERROR" not in codes and "READER_CRASHED" not in codes, (names[prefix], codes)
        pristine = names[prefix].endswith("/pristine") or names[prefix].endswith("/nested-64")
        assert fresh[prefix][0] == pristine or names[prefix].split("/")[1].startswith("mutation"), names[prefix]


def test_kernels_take_every_integer_type_the_same_way():
    """The public kernels normalise scalars: a value gives one answer whatever its Python/numpy type."""
    offsets = np.array([0, 2, 5, 9], dtype=np.int64)
    answers = {int(_kernels.first_offset_mismatch(offsets, t(9))) for t in (int, np.int16, np.int32, np.uint64)}
    assert answers == {-1}
    with pytest.raises(OverflowError):  # beyond int64: refused, never wrapped or typed as uint64
        _kernels.first_offset_mismatch(offsets, 2 ** 64 - 1)
