"""Readers never see files of two generations while a shard is replaced under them.

One process replaces the shard at ``dest/shard`` again and again -- ``check_idx --promote
--replace`` (its ``main()`` and the library calls behind it) as a move and as ``--link``, and
the builder's own ``overwrite=True`` -- with
generations whose five files have identical sizes but whose every pack says which
generation it belongs to (``tests/support/generations.py``). Meanwhile

* plain processes open the prefix, sometimes wait a little before the first read (the
  reader maps files lazily), and read every pack; one of them through the native reader
  (``csrc/``, which follows the same protocol);
* a DataLoader with two workers reads through the dataset the parent opened before the
  replacements began (inherited by the forked workers) and through fresh unpickled
  copies (what a spawned worker or a new epoch does).

Every open either reads one generation exactly or raises a ShardError (a named error):
torn reads must be zero, and most opens must succeed.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import shutil
import time

import numpy as np
import pytest

from support.generations import torn, torn_native, write_generation
from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.gate import check, promote_report
from megatron_sft_idx.gate.cli import main as check_idx
from megatron_sft_idx.native import NativeShard

pytestmark = pytest.mark.subprocess

RUN_SECONDS = float(os.environ.get("TORN_READ_SECONDS", 8))
GENERATIONS = 4
_fork = multiprocessing.get_context("fork")


def replace_forever(dest: str, sources, stop_at: float, done) -> None:
    """Replace ``dest/shard`` until ``stop_at``: promotion by move and by link (library and command
    line), and the builder's overwrite."""
    staging = os.path.join(os.path.dirname(dest), "staging")
    k = 0
    while time.monotonic() < stop_at:
        g = k % GENERATIONS
        way = k % 4
        if way == 0:  # --promote --replace --link: the source stays
            report = promote_report(check(sources[g]), dest, link=True, replace=True)
        elif way == 3:  # the command line itself: check_idx --promote DEST --replace --link SRC
            if check_idx(["--quiet", "--promote", dest, "--replace", "--link", sources[g]]) != 0:
                raise AssertionError("check_idx --promote --replace failed")
            report = None
        elif way == 1:  # --promote --replace (a move) of a fresh copy
            os.makedirs(staging, exist_ok=True)
            prefix = os.path.join(staging, "shard")
            for suffix in ALL_SUFFIXES:
                shutil.copyfile(sources[g] + suffix, prefix + suffix)
            report = promote_report(check(prefix), dest, replace=True)
        else:  # the builder writing over the published shard
            write_generation(os.path.join(dest, "shard"), 100 + k, overwrite=True)
            report = None
        if report is not None and not report.passed:
            raise AssertionError(report.format_text(True))
        k += 1
    done.value = k


def read_forever(prefix: str, stop_at: float, seed: int, results, native_lib=None) -> None:
    rng = np.random.default_rng(seed)
    counts = collections.Counter()
    while time.monotonic() < stop_at:
        try:
            if native_lib is not None:
                with NativeShard(prefix, lib_path=native_lib) as shard:
                    why = torn_native(shard)
            else:
                ds = MMapIndexedDataset(prefix)
                if rng.random() < 0.5:
                    time.sleep(float(rng.random()) * 0.002)  # the reader maps lazily: widen the window
                why = torn(ds)
        except ShardError as exc:
            counts[type(exc).__name__] += 1
            continue
        counts["ok"] += 1
        if why:
            counts["torn"] += 1
            counts[f"example: {why}"] = 1
    results.put(dict(counts))


class Reads:
    """A map-style dataset whose items are consistency checks of the shard."""

    def __init__(self, prefix: str) -> None:
        self.ds = MMapIndexedDataset(prefix)  # opened by the parent, before the replacements

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, k: int) -> str:
        try:
            ds = self.ds if k % 2 else pickle.loads(pickle.dumps(self.ds))  # inherited, or reopened
            why = torn(ds)
        except ShardError as exc:
            return type(exc).__name__
        return f"torn: {why}" if why else ("ok-inherited" if k % 2 else "ok")


def dataloader_reads(prefix: str, stop_at: float) -> collections.Counter:
    from torch.utils.data import DataLoader  # imported by the test before the clock starts

    counts = collections.Counter()
    loader = DataLoader(Reads(prefix), batch_size=None, num_workers=2, collate_fn=lambda x: x,
                        multiprocessing_context="fork")
    for outcome in loader:
        counts["torn" if outcome.startswith("torn") else outcome] += 1
        if outcome.startswith("torn"):
            counts[outcome] = 1
        if time.monotonic() >= stop_at:
            break
    return counts


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("generations")
    out = []
    for g in range(GENERATIONS):
        prefix = str(root / f"g{g}" / "shard")
        write_generation(prefix, g)
        out.append(prefix)
    return out


def test_no_torn_reads_during_repeated_replacement(tmp_path, sources, native_lib):
    dest = str(tmp_path / "train")
    report = promote_report(check(sources[0]), dest, link=True)
    assert report.passed, report.format_text(True)
    prefix = os.path.join(dest, "shard")
    assert torn(MMapIndexedDataset(prefix)) is None

    import torch.utils.data  # noqa: F401  (seconds to import: not inside the timed run)

    start = time.monotonic()
    stop_at = start + RUN_SECONDS
    results, done = _fork.Queue(), _fork.Value("q", 0)
    replacer = _fork.Process(target=replace_forever, args=(dest, sources, stop_at, done))
    readers = [_fork.Process(target=read_forever, args=(prefix, stop_at, seed, results, lib))
               for seed, lib in ((0, None), (1, None), (2, native_lib))]
    loader_counts = collections.Counter()
    try:
        replacer.start()
        for r in readers:
            r.start()
        loader_counts = dataloader_reads(prefix, stop_at)
        per_reader = [results.get(timeout=60 + RUN_SECONDS) for _ in readers]
    finally:
        for p in [replacer, *readers]:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert replacer.exitcode == 0, "the replacer failed (see its traceback above)"
    totals = collections.Counter(loader_counts)
    for counts in per_reader:
        totals.update(counts)
    replacements = done.value
    print(f"{replacements} replacements, reads: {dict(totals)}")
    assert totals["torn"] == 0, dict(totals)
    assert replacements >= 10, replacements
    opened = totals["ok"] + totals["ok-inherited"]
    assert opened > 10 * sum(v for k, v in totals.items() if k.endswith("Error")), dict(totals)
    assert totals["ok-inherited"] > 0 and totals["ok"] > 0
