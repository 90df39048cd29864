"""The promotion gate's speed against a plain read of the same bytes.

``python -m bench.gate [--size-mb 1024]`` builds one shard of about ``--size-mb``
MiB (five files; uint16 tokens, 4096-token packs), brings it into the page cache,
then times, each ``--repeat`` times (medians reported):

- ``plain_read``: reading the five files' bytes sequentially into one reused
  buffer (``readinto``, 16 MiB chunks): the floor any checker that looks at
  every byte has to pay;
- ``check_standard``: ``megatron_sft_idx.gate.check(prefix)``: every pass,
  CRC-32 of the four data files (in a thread beside the numba passes) and the
  read-back sample;
- ``check_fast``: the same without the CRC pass; ``check_deep``: every pack read back.

Both sides read from the page cache, so the ratio is CPU cost, not disk speed.
Writes ``bench/results/gate.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from ._common import format_table, write_json

PACK = 4096
BYTES_PER_TOKEN = 3  # uint16 token + uint8 loss (the indexes add ~0.3%)
READ_CHUNK = 16 << 20


def build_shard(prefix: str, size_mb: int, seed: int = 0) -> int:
    """A valid shard of about ``size_mb`` MiB; returns the pack count."""
    from megatron_sft_idx import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    n_packs = max(1, (size_mb << 20) // (PACK * BYTES_PER_TOKEN))
    pool = [rng.integers(0, 32000, PACK) for _ in range(16)]  # reused: generation is not what we time
    with IndexedDatasetBuilder(prefix, vocab_size=32000, pack_size=PACK) as builder:
        for i in range(n_packs):
            n_seq = 1 + i % 8
            starts = np.arange(n_seq, dtype=np.int64) * (PACK // n_seq)
            loss = np.ones(PACK, np.uint8)
            loss[np.append(starts[1:], PACK) - 1] = 0
            builder.add_packed(pool[i % 16], loss, starts)
    return n_packs


def plain_read(paths) -> float:
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def timed_check(prefix: str, level: str) -> float:
    from megatron_sft_idx.gate import check

    t0 = time.perf_counter()
    report = check(prefix, level=level)
    elapsed = time.perf_counter() - t0
    if not report.passed:
        raise SystemExit(f"the benchmark shard failed the gate:\n{report.format_text()}")
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="shard size in MiB (default 256; 1024 for the 1 GB figure)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per method (median reported)")
    p.add_argument("--dir", default=None, help="where to build the shard (default: a temporary directory)")
    p.add_argument("--deep", action="store_true", help="also time level deep (reads every pack back)")
    args = p.parse_args(argv)
    from megatron_sft_idx.format import ShardPaths

    work = tempfile.mkdtemp(prefix="bench_gate_", dir=args.dir)
    try:
        prefix = os.path.join(work, "shard")
        t0 = time.perf_counter()
        n_packs = build_shard(prefix, args.size_mb)
        build_s = time.perf_counter() - t0
        paths = list(ShardPaths.from_prefix(prefix))
        total = sum(os.path.getsize(x) for x in paths)
        plain_read(paths)                 # page cache warm-up
        timed_check(prefix, "fast")       # numba cache load, first-call costs
        methods = {"plain_read": lambda: plain_read(paths),
                   "check_standard": lambda: timed_check(prefix, "standard"),
                   "check_fast": lambda: timed_check(prefix, "fast")}
        if args.deep:
            methods["check_deep"] = lambda: timed_check(prefix, "deep")
        times = {name: [] for name in methods}
        for _ in range(args.repeat):      # interleaved, so drift hits every method alike
            for name, run in methods.items():
                times[name].append(run())
        med = {name: statistics.median(v) for name, v in times.items()}
        rows, results = [], {}
        for name, seconds in med.items():
            gbps = total / seconds / 1e9
            ratio = seconds / med["plain_read"]
            results[name] = {"seconds": seconds, "gb_per_s": gbps, "time_vs_plain_read": ratio,
                             "all_seconds": times[name]}
            rows.append([name, f"{seconds:.3f}", f"{gbps:.2f}", f"{ratio:.2f}x"])
        print(f"shard: {n_packs:,} packs of {PACK} tokens, {total / 2**20:.0f} MiB in 5 files "
              f"(built in {build_s:.1f} s); page cache warm; median of {args.repeat}")
        print(format_table(["method", "seconds", "GB/s", "time vs plain read"], rows))
        from megatron_sft_idx._crc import CRC_BACKEND

        print(f"CRC-32 backend: {CRC_BACKEND}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        path = write_json("gate", {"crc_backend": CRC_BACKEND, "load_average": os.getloadavg()[0],
                                   "size_bytes": total, "packs": n_packs, "pack_size": PACK,
                                   "repeat": args.repeat, "results": results,
                                   "ratio_standard_vs_read": med["check_standard"] / med["plain_read"]})
        print(f"wrote {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
