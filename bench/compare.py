"""One corpus, every format, side by side: ``python -m bench.compare --packs 50000 --pack-size 4096``.

For each system (``bench.peers``) and each repeat, a fresh child process writes the
corpus the way that system's writer does, and another fresh child opens it the way
that system's dataset does and reads it back: a seeded random permutation, then
sequentially, every value of every record touched (summed). The touched sums are
checked against the corpus for every pack read, so a format that returned wrong
data would show ``verified: NO``. Medians over the repeats are printed with a
table of ratios ours ÷ each peer, and written to ``bench/results/compare.json``.

The default ``--packs 5000`` (≈20M tokens at 4096) keeps the whole run under ~5
minutes on 2 shared cores; the legacy ``.npy`` peer needs ~45 bytes of RAM per token
to write and to read, so ``--packs 50000`` wants ~10 GB free. Files are written and
read back at once, so reads hit the page cache for every system alike.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from . import peers
from ._common import (MIB, RESULTS_DIR, ROOT, ChildError, format_table, median_dicts, ratio_cell,
                      run_child, write_json)
from ._measure import verify_digests
from .corpus import Corpus

# (key, label, higher is better, scale for display)
METRICS = (
    ("write_s", "write time (s)", False, 1),
    ("write_tokens_per_s", "write Mtokens/s", True, 1e-6),
    ("write_first_pack_s", "of which first pack (s)", False, 1),
    ("writer_peak_rss_mb", "writer peak RSS (MiB)", False, 1),
    ("writer_peak_delta_mb", "writer RSS above its imports (MiB)", False, 1),
    ("bytes_on_disk", "bytes on disk (MiB)", False, 1 / MIB),
    ("open_s", "open time (ms)", False, 1e3),
    ("rss_after_open_mb", "RSS after open (MiB)", False, 1),
    ("open_rss_delta_mb", "RSS added by open (MiB)", False, 1),
    ("random_packs_per_s", "random packs/s, every array touched", True, 1),
    ("sequential_packs_per_s", "sequential packs/s, every array touched", True, 1),
    ("access_only_packs_per_s", "random fetch-only packs/s (no touch)", True, 1),
    ("tokens_touched_packs_per_s", "random packs/s, tokens touched only", True, 1),
    ("get_packs_per_s", "random get(i) packs/s (the reader's get, fetch only)", True, 1),
    ("batched_touched_packs_per_s", "random packs/s, every array touched, get_many(32)", True, 1),
    ("cold_random_packs_per_s", "cold cache: random packs/s, every array touched", True, 1),
    ("cold_tokens_touched_packs_per_s", "cold cache: random packs/s, tokens touched only", True, 1),
    ("cold_resident_before", "cold cache: fraction of file pages cached before the pass", False, 1),
    ("reader_peak_rss_mb", "reader peak RSS (MiB)", False, 1),
    ("rss_anon_after_reads_mb", "reader anonymous RSS after reads (MiB)", False, 1),
)
DIFF_METRICS = ("open_rss_delta_mb",)
OURS_ONLY = ("write_first_pack_s", "cold_resident_before")  # not compared as ratios
OTHER_BENCHES = ("gate", "collate", "packing", "preprocess")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packs", type=int, default=5000, help="packs in the corpus (default 5000)")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=3, help="runs per system; medians are reported")
    p.add_argument("--systems", default=",".join(peers.SYSTEMS),
                   help=f"comma list of {', '.join(peers.SYSTEMS)} (ours is always included)")
    p.add_argument("--reads", type=int, default=0, help="random reads per run (0 = every pack)")
    p.add_argument("--max-seconds", type=float, default=5.0,
                   help="cap of each read pass; the rate is over the packs read by then")
    p.add_argument("--work-dir", default=None, help="where the corpus and the written files go (temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--run-others", action="store_true",
                   help="also run bench.gate/collate/packing/preprocess when those modules exist")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of tables")
    return p


def _systems(text: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        peers.load(name)  # KeyError for an unknown name before any work starts
    return ["ours"] + [s for s in names if s != "ours"]


def run_system(system: str, corpus: Corpus, digests: np.ndarray, work: Path, args, repeat: int) -> Dict:
    out_dir = work / f"{system}_out"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    try:
        wrote = run_child("bench._measure:write_task", system=system, corpus_dir=str(corpus.dir),
                          out_dir=str(out_dir))
        dig_path = work / f"{system}_digests.npz"
        read = run_child("bench._measure:read_task", system=system, out_dir=str(out_dir),
                         seed=args.seed + repeat, reads=args.reads, max_seconds=args.max_seconds,
                         digests_out=str(dig_path))
        check = verify_digests(digests, str(dig_path))
        # Cold cache: the system's files evicted from the page cache (posix_fadvise), fresh child.
        cold = {}
        for tokens_only in (False, True):
            cold.update(run_child("bench._measure:cold_task", system=system, out_dir=str(out_dir),
                                  seed=args.seed + repeat, reads=args.reads, max_seconds=args.max_seconds,
                                  tokens_only=tokens_only))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    row = {k: v for k, v in wrote.items() if k.startswith(("write", "bytes"))}
    row.update({k: v for k, v in read.items() if k not in ("system", "rss_end_mb", "rss_anon_end_mb",
                                                           "peak_rss_mb", "child_wall_s")})
    row.update({k: v for k, v in cold.items() if k.startswith("cold_")})
    row["verified"] = check["mismatches"] == 0 and check["checked"] > 0
    row["checked_packs"] = check["checked"]
    row["mismatched_packs"] = check["mismatches"]
    return row


def fold_in_others(results_dir: Path, run: bool) -> Dict[str, Dict]:
    """Other helpers' bench JSON (gate GB/s, collate batches/s, packing time, preprocess)."""
    found = {}
    for name in OTHER_BENCHES:
        if run and (ROOT / "bench" / f"{name}.py").exists():
            proc = subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=str(ROOT),
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                found[name] = {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
                continue
        path = results_dir / f"{name}.json"
        if path.exists():
            try:
                found[name] = json.loads(path.read_text())
            except ValueError as exc:
                found[name] = {"error": f"unreadable {path}: {exc}"}
    return found


def _summaries(name: str, doc: Dict) -> List[str]:
    """Headline figures of the other benchmarks' JSON (shapes as their modules write them)."""
    out = []
    if name == "gate":
        for key, res in doc.get("results", {}).items():
            out.append(f"{key} {res['gb_per_s']:.2f} GB/s ({res.get('time_vs_plain_read', 0):.2f}× plain read time)")
    elif name == "collate":
        for r in doc.get("results", []):
            out.append(f"CP {r['pad_seq_to_mult']} {r['options']} batch {r['batch_size']}: "
                       f"{1e3 / r['ours_ms']:.0f} batches/s vs Megatron-Bridge's collate_fn "
                       f"{1e3 / r['bridge_ms']:.0f} ({r['speedup']:.1f}×)")
    elif name == "packing":
        for r in doc.get("runs", []):
            peer = r.get("peer_python_seconds")
            out.append(f"{r['algorithm']} {r['n']:,} seqs: {r['seconds']:.2f} s"
                       + (f" vs Python {peer:.2f} s ({peer / r['seconds']:.0f}×)" if peer else ""))
    elif name == "preprocess":
        for r in doc.get("throughput", []):
            out.append(f"{r.get('workers')} worker(s): {r['tokens_per_s']:,.0f} tokens/s, peak RSS {r['peak_rss_mb']:.0f} MiB")
    return out


def _headline(doc: Dict, name: str = "") -> str:
    """One summary of another benchmark's JSON: known headline figures, else its top-level scalars."""
    if "error" in doc:
        return f"error: {doc['error']}"
    try:
        known = _summaries(name, doc)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        known = []
    if known:
        return "; ".join(known)
    skip = {"benchmark", "command", "timestamp", "machine"}
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in doc.items()
             if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)]
    for key in ("ratios", "summary", "headline"):
        if isinstance(doc.get(key), dict):
            parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in doc[key].items()
                      if isinstance(v, (int, float, str))]
    return ", ".join(parts[:12]) or "(no scalar figures at top level)"


def _diff_cell(ours, peer) -> str:
    if ours is None or peer is None:
        return "—"
    return f"{ours - peer:+.3g} MiB"


def tables(medians: Dict[str, Dict], systems: List[str]) -> str:
    header = ["metric"] + systems
    rows = [[label] + [None if medians[s].get(k) is None else medians[s][k] * scale for s in systems]
            for k, label, _, scale in METRICS]
    rows.append(["data verified"] + [medians[s]["verified"] for s in systems])
    out = ["Medians per system", format_table(header, rows), ""]
    peer_names = [s for s in systems if s != "ours"]
    ratio_rows = []
    for k, label, higher, _ in METRICS:
        hint = "higher better" if higher else "lower better"
        if k in OURS_ONLY:
            continue
        if k in DIFF_METRICS:  # ours is ~0 here: a ratio says nothing, the difference does
            ratio_rows.append([f"{label}: ours − peer"] + [_diff_cell(medians["ours"].get(k), medians[p].get(k))
                                                           for p in peer_names])
            continue
        ratio_rows.append([f"{label} [{hint}]"] + [ratio_cell(medians["ours"].get(k), medians[p].get(k), higher)
                                                   for p in peer_names])
    out += ["Ratios ours ÷ peer (✓ ours better by >5%, ✗ worse, ≈ within 5%)",
            format_table(["metric"] + peer_names, ratio_rows)]
    return "\n".join(out)


def run_all(args, systems: List[str], work: Path):
    """Generate the corpus, then write and read it with every system ``args.repeats`` times.

    Returns ``(corpus, seconds to generate it, {system: [row per repeat]})``.
    """
    t0 = time.perf_counter()
    corpus = Corpus.generate(work / "corpus", args.packs, args.pack_size, args.vocab_size, args.seed)
    gen_s = time.perf_counter() - t0
    digests = corpus.digests()
    runs: Dict[str, List[Dict]] = {s: [] for s in systems}
    for repeat in range(args.repeats):
        # Rotate the order each repeat so no system always runs first (cold) or last.
        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        for system in order:
            if not args.json:
                print(f"[repeat {repeat + 1}/{args.repeats}] {system} ...", file=sys.stderr, flush=True)
            runs[system].append(run_system(system, corpus, digests, work, args, repeat))
    return corpus, gen_s, runs


def _ratios(medians: Dict[str, Dict], systems: List[str]) -> Dict[str, Dict]:
    ours = medians["ours"]
    return {p: {k: (None if k in DIFF_METRICS or ours.get(k) is None or not medians[p].get(k)
                    or medians[p][k] <= 0 else ours[k] / medians[p][k]) for k, *_ in METRICS}
            for p in systems if p != "ours"}


def _print_report(payload: Dict, args, path: Path) -> None:
    c = payload["corpus"]
    print(f"\ncorpus: {args.packs} packs × pack_size {args.pack_size}, {c['n_tokens']:,} tokens, "
          f"{c['n_sequences']:,} sequences ({c['seqs_per_pack']} per pack, fill {c['pack_fill']:.1%}); "
          f"{args.repeats} repeats, medians\n")
    print(tables(payload["medians"], payload["systems"]))
    for name, doc in payload["others"].items():
        print(f"\n{name}: {_headline(doc, name)}")
    print(f"\nJSON: {path}  (total {payload['total_s']:.0f} s)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        systems = _systems(args.systems)
    except (KeyError, ImportError) as exc:  # unknown name, or a peer's package is not installed
        print(f"error: {exc.args[0] if isinstance(exc, KeyError) else exc}; choose --systems", file=sys.stderr)
        return 2
    if args.packs <= 0 or args.pack_size <= 1 or args.repeats <= 0:
        print("error: --packs, --repeats must be positive and --pack-size > 1", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi_bench_compare_"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        corpus, gen_s, runs = run_all(args, systems, work)
    except ChildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    medians = {s: median_dicts(r) for s, r in runs.items()}
    payload = {"params": {"packs": args.packs, "pack_size": args.pack_size, "vocab_size": args.vocab_size,
                          "seed": args.seed, "repeats": args.repeats, "reads": args.reads,
                          "max_seconds": args.max_seconds},
               "corpus": {k: v for k, v in corpus.meta.items() if k != "params"},
               "corpus_generate_s": gen_s, "systems": systems,
               "labels": {s: peers.load(s).LABEL for s in systems},
               "medians": medians, "runs": runs, "ratios_ours_over_peer": _ratios(medians, systems),
               "others": fold_in_others(Path(args.results_dir), args.run_others),
               "total_s": time.perf_counter() - t_start}
    path = write_json("compare", payload, Path(args.results_dir))
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        _print_report(payload, args, path)
    bad = [s for s in systems if not medians[s]["verified"]]
    if bad:
        print(f"error: data read back differs from the corpus for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
