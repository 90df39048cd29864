"""The per-pack read path, ours vs upstream megatron-core, measured paired and interleaved.

``python -m bench.hotpath --packs 20000 --pack-size 4096``

``bench.compare`` runs each system in its own processes one after the other, so on a
shared machine a load spike lands on one system and not the other. Here the readers
live in one process and take turns: each pass is cut into slices of ``--slice`` packs
of one seeded random order; each system reads a slice in turn, the order rotating every
round. The figures are medians over the rounds (per-slice rates, and per-round ratios
ours ÷ peer), so a load spike moves one round, not the verdict.

Two peers, both the installed megatron-core ``IndexedDataset``:

* ``upstream``: its pretrain format, tokens only -- the design budget's floor ("reading a
  pack's three arrays is at least as fast as upstream reading its tokens alone");
* ``upstream_sft``: the same tokens, loss mask and sequence starts as ours, stored as three
  upstream datasets and read with three ``IndexedDataset`` lookups (``bench/peers/upstream_sft.py``):
  the like-for-like peer when every array is read (same bytes, same consumer work).

Passes (the same consumer work for every reader where the data allows):

* ``fetch``: ``ds[i]``, nothing touched (the reader's own cost);
* ``get``: the reader's ``get(i)`` method;
* ``tokens``: ``ds[i]`` and every token summed (upstream's whole record);
* ``all arrays``: ours and ``upstream_sft`` sum tokens, loss mask and sequence starts,
  ``upstream`` its tokens (so against it ours reads 1.5x the bytes with three numpy
  reductions instead of one);
* ``all arrays, get_many(32)``: ours fetches 32 packs at once, then the same sums;
* ``all arrays, consumer only``: the same sums over records fetched before the clock
  starts: the consumer's share of ``all arrays``, which no reader can make smaller.

Warm: after one unmeasured pass of every reader over every pack (every page cached and
mapped), each pass reads every pack. Cold: before each pass the readers are reopened
(a mapped page cannot be evicted) and every system's files are evicted from the page
cache (``posix_fadvise(DONTNEED)``: targeted, so other jobs on a shared machine keep
their cache; the fraction still cached is checked with ``mincore`` and reported); each
pass then reads packs no earlier pass touched.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

from ._common import RESULTS_DIR, format_table, run_child, write_json
from ._measure import evict, resident_fraction
from .corpus import Corpus

PASSES = ("fetch", "get", "tokens", "all arrays", "all arrays, get_many(32)", "all arrays, consumer only")
SYSTEMS = ("ours", "upstream", "upstream_sft")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__.split("\n\n")[0])
    p.add_argument("--packs", type=int, default=20000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--slice", type=int, default=500, help="packs per turn")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


def _readers(out: str) -> Dict[str, tuple]:
    from . import peers

    return {name: (peers.load(name), peers.load(name).open_reader(f"{out}/{name}")) for name in SYSTEMS}


def _work(mod, reader, name: str) -> Callable[[List[int]], None]:
    """The consumer of one pass, for one system: a function of a slice of pack indices."""
    is_ours = mod.NAME == "ours"
    if name == "fetch":
        return lambda idx: [reader[i] for i in idx]
    if name == "get":
        return lambda idx: [reader.get(i) for i in idx]
    if name == "tokens":
        return lambda idx: [mod.touch_tokens(reader[i]) for i in idx]
    if name == "all arrays, consumer only":
        records = {}

        def consume(idx):
            for i in idx:
                mod.touch(records[i])

        consume.prepare = lambda idx: records.update((i, reader[i]) for i in idx)
        return consume
    if name == "all arrays, get_many(32)" and is_ours:
        def batched(idx):
            for k in range(0, len(idx), 32):
                for pack in reader.get_many(idx[k:k + 32]):
                    mod.touch(pack)
        return batched
    return lambda idx: [mod.touch(reader[i]) for i in idx]


def paired_task(out: str, seed: int, slice_len: int, cold: bool) -> dict:
    """Every pass, the systems taking turns slice by slice (see the module doc)."""
    import gc

    from . import peers

    files = [f for name in SYSTEMS for f in peers.load(name).files(f"{out}/{name}")]
    readers = _readers(out)
    n = len(readers["ours"][1])
    order = np.random.default_rng(seed).permutation(n).tolist()
    per_pass = n // len(PASSES) if cold else n  # cold: every pass reads packs no pass touched
    slice_len = max(1, min(slice_len, per_pass // (8 * len(SYSTEMS))))  # at least eight rounds per pass
    result = {"cold": cold, "slice": slice_len, "passes": {}}
    _same_records(readers, order[:200])
    if not cold:  # warm: every page of every system mapped and cached before any pass
        for mod, reader in readers.values():
            for i in order:
                mod.touch(reader[i])
    work = None
    for p, name in enumerate(PASSES):
        packs = order[p * per_pass:(p + 1) * per_pass] if cold else order
        if cold:  # fresh maps (a mapped page cannot be evicted), then evict every system's files
            del readers, work
            gc.collect()
            evict(files)
            resident = resident_fraction(files)
            readers = _readers(out)
        work = {system: _work(mod, reader, name) for system, (mod, reader) in readers.items()}
        result["passes"][name] = _turns(work, packs, slice_len)
        if cold:
            result["passes"][name]["resident_before"] = resident
    return result


def _same_records(readers: Dict[str, tuple], indices: List[int]) -> None:
    """Ours and ``upstream_sft`` return the same arrays, upstream the same tokens (else stop)."""
    ours_mod, ours = readers["ours"]
    for i in indices:
        want = ours_mod.as_arrays(ours[i])
        for name, (mod, reader) in readers.items():
            got = mod.as_arrays(reader[i])
            if any(g is not None and not np.array_equal(g, w) for g, w in zip(got, want)):
                raise SystemExit(f"{name} pack {i} differs from ours: the systems hold different data")


def _turns(work: Dict[str, Callable], packs: List[int], slice_len: int) -> dict:
    """Slices taken in turn by the systems (rotating who goes first); medians of their
    per-slice rates and of the per-round ratios ours ÷ each peer."""
    clock = time.perf_counter
    systems = list(work)
    rates: Dict[str, List[float]] = {s: [] for s in systems}
    ratios: Dict[str, List[float]] = {s: [] for s in systems if s != "ours"}
    k = len(systems)
    slices = [packs[a:a + slice_len] for a in range(0, len(packs) - slice_len + 1, slice_len)]
    for r in range(0, len(slices) - k + 1, k):
        turn = r // k
        order = systems[turn % k:] + systems[:turn % k]
        rate = {}
        for system, idx in zip(order, slices[r:r + k]):
            prepare = getattr(work[system], "prepare", None)
            if prepare is not None:
                prepare(idx)  # outside the clock
            t0 = clock()
            work[system](idx)
            rate[system] = len(idx) / (clock() - t0)
            rates[system].append(rate[system])
        for peer in ratios:
            ratios[peer].append(rate["ours"] / rate[peer])
    out = {f"{s}_packs_per_s": statistics.median(v) for s, v in rates.items()}
    out.update({f"ratio_vs_{peer}": statistics.median(v) for peer, v in ratios.items()})
    out["ratio_median"] = out["ratio_vs_upstream"]  # earlier results' name
    out["rounds"] = len(ratios["upstream"])
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi_bench_hotpath_"))
    try:
        corpus = Corpus.generate(work / "corpus", args.packs, args.pack_size, args.vocab_size, args.seed)
        for system in SYSTEMS:
            (work / system).mkdir(parents=True, exist_ok=True)
            run_child("bench._measure:write_task", system=system, corpus_dir=str(corpus.dir),
                      out_dir=str(work / system))
        out = {}
        for mode, cold in (("warm", False), ("cold", True)):
            print(f"[bench.hotpath] {mode} ...", file=sys.stderr, flush=True)
            out[mode] = run_child("bench.hotpath:paired_task", out=str(work), seed=args.seed, slice_len=args.slice,
                                  cold=cold)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    for mode in ("warm", "cold"):
        for name, r in out[mode]["passes"].items():
            rows.append([f"{mode}: {name}", r["ours_packs_per_s"], r["upstream_packs_per_s"],
                         r["upstream_sft_packs_per_s"], f"{r['ratio_vs_upstream']:.2f}×",
                         f"{r['ratio_vs_upstream_sft']:.2f}×", r["rounds"]])
    print(format_table(["pass", "ours packs/s", "upstream packs/s", "upstream ×3 packs/s", "ours ÷ upstream",
                        "ours ÷ upstream ×3", "rounds"], rows))
    cached = [r["resident_before"] for r in out["cold"]["passes"].values()]
    print(f"cold: fraction of file pages cached before each pass: max {max(cached):.4f}")
    path = write_json("hotpath", {"params": vars(args), "results": out}, Path(args.results_dir))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
