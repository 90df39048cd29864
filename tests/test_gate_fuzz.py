"""Fuzz: random byte mutations of valid shards.

For every mutated shard, ``check()`` must return (never raise, never hang),
must fail the shard whenever a byte changed (the CRCs make that true at level
``standard``), and the reader must raise only the project's ShardError.
Seeded, so every failure reproduces.
"""

from __future__ import annotations

import shutil
import signal

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.gate import check
from shardgen import random_packs, write_shard

CASES_PER_TEST = 50
SHAPES = {
    "uint16": dict(pack_size=64, vocab_size=1000),
    "int32": dict(pack_size=64, vocab_size=70000, dtype=np.int32),
    "pad4": dict(pack_size=64, vocab_size=1000, metadata={"pad_seq_to_mult": 4}),
}
#: A hang guard, not a speed threshold: one case takes milliseconds.
HANG_GUARD_SECONDS = 120


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for name, kw in SHAPES.items():
        directory = tmp_path_factory.mktemp(f"base_{name}")
        rng = np.random.default_rng(len(name))
        pad = kw.get("metadata", {}).get("pad_seq_to_mult", 1)
        vocab = kw["vocab_size"]
        packs = random_packs(rng, 30, vocab=vocab, pad_mult=pad)
        prefix = str(directory / "s")
        write_shard(prefix, packs, **kw)
        out[name] = prefix
    return out


def mutate(rng, prefix):
    """Apply one random mutation to one random file; return a description (or None if no-op)."""
    suffix = ALL_SUFFIXES[int(rng.integers(len(ALL_SUFFIXES)))]
    path = prefix + suffix
    data = bytearray(open(path, "rb").read())
    before = bytes(data)
    kind = int(rng.integers(6))
    size = len(data)
    if kind == 0 and size:                          # flip one byte
        data[int(rng.integers(size))] ^= 0xFF
    elif kind == 1 and size:                        # set a few random bytes
        for _ in range(int(rng.integers(1, 5))):
            data[int(rng.integers(size))] = int(rng.integers(256))
    elif kind == 2:                                 # truncate anywhere
        del data[int(rng.integers(size + 1)):]
    elif kind == 3:                                 # extend with random bytes
        data += bytes(rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8))
    elif kind == 4 and size:                        # zero a range
        a = int(rng.integers(size))
        b = min(size, a + int(rng.integers(1, 64)))
        data[a:b] = bytes(b - a)
    elif kind == 5 and size > 1:                    # a single bit
        data[int(rng.integers(size))] ^= 1 << int(rng.integers(8))
    if bytes(data) == before:
        return None
    with open(path, "wb") as f:
        f.write(data)
    return f"{suffix} kind {kind}"


def _reader(prefix):
    try:
        ds = MMapIndexedDataset(prefix, check_packs=True)
        for i in range(len(ds)):
            ds[i].seq_boundaries
    except ShardError:
        pass


def _alarm(signum, frame):
    raise TimeoutError("hang guard: a check took far too long")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("block", [0, 1])
def test_fuzz(bases, tmp_path, shape, block):
    rng = np.random.default_rng(1000 * block + len(shape))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_GUARD_SECONDS)
    changed = 0
    try:
        for case in range(CASES_PER_TEST):
            work = tmp_path / f"c{case}"
            work.mkdir()
            prefix = str(work / "s")
            for suffix in ALL_SUFFIXES:
                shutil.copyfile(bases[shape] + suffix, prefix + suffix)
            what = mutate(rng, prefix)
            for level in ("standard", "fast"):
                report = check(prefix, level=level)  # must not raise
                assert report.shards[0].findings is not None
                if level == "standard" and what is not None:
                    assert not report.passed, f"case {case} ({what}) passed:\n{report.format_text(True)}"
                    assert "GATE_INTERNAL_ERROR" not in report.shards[0].codes(), report.format_text(True)
                    assert "READER_CRASHED" not in report.shards[0].codes(), report.format_text(True)
            changed += what is not None
            _reader(prefix)
            shutil.rmtree(work)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert changed > CASES_PER_TEST // 2
