"""Scale mode: open time, RSS after open and random reads from 10k to 1M+ packs, per system.

``python -m bench.scale`` (sizes 10k, 30k, 100k at ``--pack-size 256``) or
``python -m bench.scale --max`` (adds 300k and 1M) or ``--sizes 10000,3000000``.
Small packs keep the data on disk small while the pack count — what an index,
an open and a lookup scale with — grows. Flat is the goal: a format whose open
reads the whole dataset (the legacy ``.npy``) grows linearly; it is skipped above
``--legacy-max-packs`` (its RAM is ~45 bytes per token).

Each (system, size) is one child that writes, and one fresh child that opens and
does ``--reads`` random reads (a seeded permutation, every value touched, checked
against the corpus). Results go to ``bench/results/scale.json`` and a PNG plot
``bench/results/scale.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from . import peers
from ._common import (RESULTS_DIR, ChildError, format_table, median_dicts, ratio_cell, run_child,
                      write_json)
from ._measure import verify_digests
from .corpus import Corpus

DEFAULT_SIZES = (10_000, 30_000, 100_000)
MAX_SIZES = (10_000, 30_000, 100_000, 300_000, 1_000_000)
PLOTTED = (("open_s", "open time (s)", "log"), ("rss_after_open_mb", "RSS after open (MiB)", "log"),
           ("open_rss_delta_mb", "RSS added by open (MiB)", "symlog"),
           ("random_packs_per_s", "random packs/s (all values touched)", "log"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="comma list of pack counts (default 10000,30000,100000)")
    p.add_argument("--max", action="store_true", help="sizes up to 1M packs (several minutes)")
    p.add_argument("--pack-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--systems", default=",".join(peers.SYSTEMS))
    p.add_argument("--reads", type=int, default=20000, help="random reads per point (capped by --max-seconds)")
    p.add_argument("--max-seconds", type=float, default=3.0, help="cap of the random pass")
    p.add_argument("--repeats", type=int, default=1, help="read children per point; medians")
    p.add_argument("--legacy-max-packs", type=int, default=100_000,
                   help="largest size the legacy .npy peer runs at (it loads everything)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--no-plot", action="store_true")
    return p


def measure_point(system: str, corpus: Corpus, n: int, digests, work: Path, args) -> Dict:
    out_dir = work / f"{system}_{n}"
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        wrote = run_child("bench._measure:write_task", system=system, corpus_dir=str(corpus.dir),
                          out_dir=str(out_dir), corpus_packs=n)
        reads = []
        for r in range(args.repeats):
            dig = work / f"{system}_{n}_digests.npz"
            read = run_child("bench._measure:read_task", system=system, out_dir=str(out_dir), seed=args.seed + r,
                             reads=args.reads, max_seconds=args.max_seconds, sequential=False,
                             access_only=False, digests_out=str(dig))
            read.update(verify_digests(digests, str(dig)))
            reads.append(read)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    row = median_dicts(reads)
    row.update(packs=n, write_s=wrote["write_s"], bytes_on_disk=wrote["bytes_on_disk"],
               verified=all(r["mismatches"] == 0 and r["checked"] > 0 for r in reads))
    return row


def plot(points: Dict[str, List[Dict]], path: Path, pack_size: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4.5 * len(PLOTTED), 4))
    for ax, (key, title, yscale) in zip(axes, PLOTTED):
        for system, rows in points.items():
            xs = [r["packs"] for r in rows if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            ax.plot(xs, ys, marker="o", label=system)
        ax.set_xscale("log")
        if yscale == "symlog":  # zero is a real value here (nothing added by open)
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale(yscale)
        ax.set_xlabel("packs in the shard")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Scale: pack_size {pack_size}; flat is the goal (throughput: higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",")}) if args.sizes else list(
            MAX_SIZES if args.max else DEFAULT_SIZES)
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        for s in systems:
            peers.load(s)
    except (ValueError, KeyError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not sizes or sizes[0] <= 0:
        print("error: sizes must be positive", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi_bench_scale_"))
    t_start = time.perf_counter()
    points: Dict[str, List[Dict]] = {s: [] for s in systems}
    try:
        corpus = Corpus.generate(work / "corpus", sizes[-1], args.pack_size, args.vocab_size, args.seed)
        digests = corpus.digests()
        for n in sizes:
            for system in systems:
                if system == "legacy_npy" and n > args.legacy_max_packs:
                    continue
                print(f"[{n} packs] {system} ...", file=sys.stderr, flush=True)
                points[system].append(measure_point(system, corpus, n, digests, work, args))
    except ChildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    results_dir = Path(args.results_dir)
    payload = {"params": {"sizes": sizes, "pack_size": args.pack_size, "reads": args.reads,
                          "repeats": args.repeats, "seed": args.seed}, "points": points,
               "growth_largest_over_smallest": _growth(points), "total_s": time.perf_counter() - t_start}
    path = write_json("scale", payload, results_dir)
    if not args.no_plot:
        plot(points, results_dir / "scale.png", args.pack_size)
    header = ["system", "packs", "open (ms)", "RSS after open (MiB)", "random packs/s", "verified"]
    rows = [[s, r["packs"], r["open_s"] * 1e3, r["rss_after_open_mb"], r["random_packs_per_s"], r["verified"]]
            for s, rs in points.items() for r in rs]
    print(format_table(header, rows))
    print("\nGrowth from the smallest to the largest size (largest ÷ smallest; 1.0 is flat)")
    g = payload["growth_largest_over_smallest"]
    print(format_table(["system", "sizes", "open time", "RSS after open", "random packs/s"],
                       [[s, v["sizes"], v["open_s"], v["rss_after_open_mb"], v["random_packs_per_s"]]
                        for s, v in g.items()]))
    ratios = _ratios(points)
    payload["ratios_ours_over_peer"] = ratios
    write_json("scale", payload, results_dir)
    if ratios:
        print("\nRatios ours ÷ peer at each peer's largest size (✓ ours better by >5%)")
        print(format_table(["peer", "packs", "open time", "RSS after open", "random packs/s"],
                           [[p, r["packs"], r["open_s"], r["rss_after_open_mb"], r["random_packs_per_s"]]
                            for p, r in ratios.items()]))
    print(f"\nJSON: {path}" + ("" if args.no_plot else f"\nplot: {results_dir / 'scale.png'}"))
    return 0 if all(r["verified"] for rs in points.values() for r in rs) else 1


def _ratios(points: Dict[str, List[Dict]]) -> Dict[str, Dict]:
    """ours ÷ peer at the largest size both ran, as display cells (open and RSS: lower is better)."""
    ours = {r["packs"]: r for r in points.get("ours", [])}
    out = {}
    for peer, rows in points.items():
        common = [r for r in rows if r["packs"] in ours]
        if peer == "ours" or not common:
            continue
        r = common[-1]
        o = ours[r["packs"]]
        out[peer] = {"packs": r["packs"], "open_s": ratio_cell(o["open_s"], r["open_s"], False),
                     "rss_after_open_mb": ratio_cell(o["rss_after_open_mb"], r["rss_after_open_mb"], False),
                     "random_packs_per_s": ratio_cell(o["random_packs_per_s"], r["random_packs_per_s"], True)}
    return out


def _growth(points: Dict[str, List[Dict]]) -> Dict[str, Dict]:
    out = {}
    for system, rows in points.items():
        if len(rows) < 2:
            continue
        a, b = rows[0], rows[-1]
        out[system] = {"sizes": f"{a['packs']}→{b['packs']}",
                       **{k: (b[k] / a[k] if a.get(k) and b.get(k) is not None else None)
                          for k in ("open_s", "rss_after_open_mb", "random_packs_per_s")}}
    return out


if __name__ == "__main__":
    sys.exit(main())
