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

``--against DIR`` also checks the same shard with the gate of another checkout (e.g. the
code before a change): this tree's gate and DIR's each run in a long-lived worker process,
taking turns within every repeat, and the table adds their times, the ratio this ÷ DIR
(median of the per-round ratios) and each one's peak RSS growth during a check (``VmHWM``
reset before each check: mapped pages of the shard count).
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


_WORKER = r"""
import json, sys, time
from megatron_sft_idx.gate import check
prefix = sys.argv[1]
check(prefix, level="fast")  # numba cache load, first-call costs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

for level in sys.stdin:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    t0 = time.perf_counter()
    report = check(prefix, level=level.strip())
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "passed": report.passed, "peak_growth_mb": status("VmHWM") - base}),
          flush=True)
"""


class _GateWorker:
    """One checkout's gate in its own process (its directory first on the path)."""

    def __init__(self, tree: str, prefix: str) -> None:
        import subprocess

        env = dict(os.environ, PYTHONPATH=tree)
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, prefix], cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def check(self, level: str) -> dict:
        import json

        self.proc.stdin.write(level + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if not out["passed"]:
            raise SystemExit("the benchmark shard failed a gate")
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare_trees(prefix: str, other: str, repeat: int) -> dict:
    """This tree's gate against ``other``'s, interleaved in two worker processes."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workers = {"this": _GateWorker(here, prefix), "other": _GateWorker(os.path.abspath(other), prefix)}
    runs = {(w, level): [] for w in workers for level in ("standard", "fast")}
    try:
        for r in range(repeat):
            for level in ("standard", "fast"):
                for w in (("this", "other") if r % 2 == 0 else ("other", "this")):
                    runs[(w, level)].append(workers[w].check(level))
    finally:
        for w in workers.values():
            w.close()
    out = {"other": os.path.abspath(other)}
    for level in ("standard", "fast"):
        this, other_runs = runs[("this", level)], runs[("other", level)]
        out[level] = {
            "this_seconds": statistics.median(x["seconds"] for x in this),
            "other_seconds": statistics.median(x["seconds"] for x in other_runs),
            "time_ratio": statistics.median(a["seconds"] / b["seconds"] for a, b in zip(this, other_runs)),
            "this_peak_growth_mb": max(x["peak_growth_mb"] for x in this),
            "other_peak_growth_mb": max(x["peak_growth_mb"] for x in other_runs)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="shard size in MiB (default 256; 1024 for the 1 GB figure)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per method (median reported)")
    p.add_argument("--dir", default=None, help="where to build the shard (default: a temporary directory)")
    p.add_argument("--deep", action="store_true", help="also time level deep (reads every pack back)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="also time another checkout's gate on the same shard, interleaved (see the module doc)")
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
        against = compare_trees(prefix, args.against, args.repeat) if args.against else None
        if against:
            print(f"against {against['other']} (two worker processes taking turns; median of {args.repeat}):")
            print(format_table(
                ["level", "this s", "other s", "this ÷ other (time)", "this peak RSS growth MiB",
                 "other peak RSS growth MiB"],
                [[level, f"{r['this_seconds']:.3f}", f"{r['other_seconds']:.3f}", f"{r['time_ratio']:.2f}x",
                  f"{r['this_peak_growth_mb']:.0f}", f"{r['other_peak_growth_mb']:.0f}"]
                 for level, r in ((lv, against[lv]) for lv in ("standard", "fast"))]))
        path = write_json("gate", {"against": against, "crc_backend": CRC_BACKEND, "load_average": os.getloadavg()[0],
                                   "size_bytes": total, "packs": n_packs, "pack_size": PACK,
                                   "repeat": args.repeat, "results": results,
                                   "ratio_standard_vs_read": med["check_standard"] / med["plain_read"]})
        print(f"wrote {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
