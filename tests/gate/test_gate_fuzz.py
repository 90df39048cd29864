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

from support.corrupt import mutate, reader_raises_only_shard_errors
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.gate import check
from support.shardgen import random_packs, write_shard

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


def _alarm(signum, frame):
    raise TimeoutError("hang guard: a check took far too long")


@pytest.mark.slow
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
            reader_raises_only_shard_errors(prefix)
            shutil.rmtree(work)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert changed > CASES_PER_TEST // 2
