"""What runs inside a benchmark child process: one system's write, or one system's reads.

Both functions are called through :func:`bench._common.run_child`, so the process
(and its peak RSS) belongs to one system and one phase. Every import a system needs
happens before the clock or the RSS baseline starts, so ``open_s`` is the dataset
constructor alone and the ``*_delta_mb`` figures are what the system allocated.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import numpy as np

from . import peers
from ._common import proc_status, rss_mb
from .corpus import Corpus


def bytes_on_disk(paths) -> int:
    return int(sum(os.path.getsize(p) for p in paths))


def write_task(system: str, corpus_dir: str, out_dir: str, corpus_packs: Optional[int] = None) -> dict:
    """Write the corpus (its first ``corpus_packs`` packs) with ``system``'s writer;
    time, throughput, size, RSS above the baseline."""
    mod = peers.load(system)
    corpus = Corpus(corpus_dir, corpus_packs)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if hasattr(mod, "prepare_writer"):  # imports only: the first-pack cost stays in write_s
        mod.prepare_writer()
    base = rss_mb()
    result = mod.write(corpus, out_dir)
    peak = proc_status()["VmHWM"]
    write_s = result["write_s"]
    extra = {k: v for k, v in result.items() if k != "write_s"}  # e.g. ours' first-pack time
    return {**extra, "system": system, "write_s": write_s, "write_tokens_per_s": corpus.n_tokens / write_s,
            "bytes_on_disk": bytes_on_disk(mod.files(out_dir)), "writer_base_rss_mb": base,
            "writer_peak_rss_mb": peak, "writer_peak_delta_mb": peak - base}


def _timed_pass(reader, touch, order: np.ndarray, out: np.ndarray, max_seconds: float) -> tuple:
    """Read ``order`` (stopping after ``max_seconds``); touched digests go to ``out``. (count, seconds)."""
    clock = time.perf_counter
    t0 = clock()
    k = 0
    for i in order.tolist():
        out[k] = touch(reader[i])
        k += 1
        if not k & 31 and clock() - t0 > max_seconds:
            break
    return k, clock() - t0


def _access_pass(reader, order: np.ndarray, max_seconds: float) -> tuple:
    """Fetch records without touching their values (what the reader itself costs)."""
    clock = time.perf_counter
    t0 = clock()
    k = 0
    for i in order.tolist():
        reader[i]
        k += 1
        if not k & 31 and clock() - t0 > max_seconds:
            break
    return k, clock() - t0


BATCH = 32


def _get_pass(mod, reader, order: np.ndarray, max_seconds: float) -> Optional[float]:
    """packs/s of the system's own ``get(i)`` (fetch only), when it has one."""
    if not hasattr(mod, "get"):
        return None
    get, clock = mod.get, time.perf_counter
    t0, k = clock(), 0
    for i in order.tolist():
        get(reader, i)
        k += 1
        if not k & 31 and clock() - t0 > max_seconds:
            break
    return k / (clock() - t0)


def _batched_pass(mod, reader, order: np.ndarray, max_seconds: float) -> Optional[float]:
    """packs/s fetching ``BATCH`` packs at a time with ``get_many`` and touching every array."""
    if not hasattr(mod, "get_many"):
        return None
    touch, clock = mod.touch, time.perf_counter
    t0, k = clock(), 0
    while k < order.size and clock() - t0 <= max_seconds:
        batch = order[k:k + BATCH]
        for rec in mod.get_many(reader, batch):
            touch(rec)
        k += batch.size
    return k / (clock() - t0)


def resident_fraction(paths) -> Optional[float]:
    """Fraction of the files' pages in the page cache (``mincore``), or None where unavailable."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                if libc.mincore(addr, size, vec) != 0:
                    return None
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in bytes(vec))
        total += pages
    return resident / total if total else None


def evict(paths) -> None:
    """Drop the files' pages from the page cache (``posix_fadvise(DONTNEED)``): targeted at
    these files, so concurrent jobs on the machine keep their own cached data."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_task(system: str, out_dir: str, seed: int = 0, reads: int = 0, max_seconds: float = 10.0,
              tokens_only: bool = False) -> dict:
    """Evict the system's files from the page cache, then open and read in random order
    (every array touched, or tokens only): reads that go to the disk."""
    mod = peers.load(system)
    files = mod.files(out_dir)
    evict(files)
    before = resident_fraction(files)
    t0 = time.perf_counter()
    reader = mod.open_reader(out_dir)
    open_s = time.perf_counter() - t0
    order = np.random.default_rng(seed + 7).permutation(len(reader))
    if reads:
        order = order[:reads]
    touch = (lambda rec: (0, mod.touch_tokens(rec), 0, 0)) if tokens_only else mod.touch
    out = np.zeros((order.size, 4), dtype=np.int64)
    n, secs = _timed_pass(reader, touch, order, out, max_seconds)
    key = "cold_tokens_touched_packs_per_s" if tokens_only else "cold_random_packs_per_s"
    return {"system": system, key: n / secs if secs else None, "cold_open_s": open_s,
            "cold_resident_before": before}


def read_task(system: str, out_dir: str, seed: int = 0, reads: int = 0, max_seconds: float = 10.0,
              sequential: bool = True, access_only: bool = True, digests_out: str = "") -> dict:
    """Open the written data the way ``system``'s dataset does and read it back.

    Args:
        reads: random reads (a seeded permutation of all packs, first ``reads`` of it);
            0 means every pack.
        access_only: a third pass over the random order that fetches records without
            touching them (the reader's own cost; lazy views read nothing).
        max_seconds: cap of each pass; the rate is over the packs actually read.
        digests_out: when given, ``.npz`` of the packs read and their touched
            digests, for the caller's correctness check.
    """
    mod = peers.load(system)
    before = proc_status()
    t0 = time.perf_counter()
    reader = mod.open_reader(out_dir)
    open_s = time.perf_counter() - t0
    after = proc_status()
    n = len(reader)
    order = np.random.default_rng(seed).permutation(n)
    if reads:
        order = order[:reads]
    rand_out = np.zeros((order.size, 4), dtype=np.int64)
    rand_n, rand_s = _timed_pass(reader, mod.touch, order, rand_out, max_seconds)
    result = {"system": system, "packs": n, "open_s": open_s,
              "rss_before_open_mb": before["VmRSS"], "rss_after_open_mb": after["VmRSS"],
              "open_rss_delta_mb": after["VmRSS"] - before["VmRSS"],
              "random_reads": rand_n, "random_packs_per_s": rand_n / rand_s if rand_s else None}
    seq_order = np.arange(n)
    seq_out = np.zeros((n, 4), dtype=np.int64) if sequential else None
    if sequential:
        seq_n, seq_s = _timed_pass(reader, mod.touch, seq_order, seq_out, max_seconds)
        result.update(sequential_reads=seq_n, sequential_packs_per_s=seq_n / seq_s if seq_s else None)
    if access_only:
        acc_n, acc_s = _access_pass(reader, order, max_seconds)
        result["access_only_packs_per_s"] = acc_n / acc_s if acc_s else None
        # Upstream's work exactly: fetch a record, read every token (not the SFT arrays).
        tok_out = np.zeros((order.size, 4), dtype=np.int64)
        tok_n, tok_s = _timed_pass(reader, lambda rec: (0, mod.touch_tokens(rec), 0, 0), order, tok_out,
                                   max_seconds)
        result["tokens_touched_packs_per_s"] = tok_n / tok_s if tok_s else None
        result["get_packs_per_s"] = _get_pass(mod, reader, order, max_seconds)
        result["batched_touched_packs_per_s"] = _batched_pass(mod, reader, order, max_seconds)
    end = proc_status()
    result.update(reader_peak_rss_mb=end["VmHWM"], reader_peak_delta_mb=end["VmHWM"] - before["VmRSS"],
                  rss_anon_after_reads_mb=end.get("RssAnon"))
    if digests_out:
        idx = [order[:rand_n]]
        dig = [rand_out[:rand_n]]
        if sequential:
            idx.append(seq_order[:seq_n])
            dig.append(seq_out[:seq_n])
        np.savez(digests_out, index=np.concatenate(idx), digest=np.concatenate(dig),
                 columns=np.array(mod.TOUCHES))
    return result


def verify_digests(corpus_digests: np.ndarray, path: str) -> dict:
    """Compare a child's touched digests with the corpus: ``{"checked", "mismatches"}``."""
    with np.load(path) as z:
        index, digest, cols = z["index"], z["digest"], z["columns"]
    bad = np.any(corpus_digests[index][:, cols] != digest[:, cols], axis=1)
    return {"checked": int(index.size), "mismatches": int(bad.sum())}
