"""Writer memory: peak RSS and Python-heap peak for 100k vs 1M packs, and the RFC's memory test.

``python -m bench.builder_rss`` runs, each in a fresh child process:

1. **Scaling** (issue 2): each writer builds 100k and then 1M small packs (``--pack-tokens``
   tokens, 4 sequences, cycled from a seeded pool so producing them allocates
   nothing). Reported: peak RSS above the baseline taken after imports and warm-up
   (``VmHWM`` reset through ``/proc/self/clear_refs``), the ``tracemalloc`` peak of the
   Python heap (a separate child: tracing slows allocation), and the growth per pack
   ``(peak(1M) - peak(100k)) / 900k`` in bytes — flat (a few bytes per pack) is the goal.
2. **RFC memory test** (seed 000, "test_memmap_writer_memory_efficiency"): 10,000 packs
   of 2,000 random tokens (pack size 2048, ``seq_start_id = [0, 500, 1000, 1500]``)
   under ``tracemalloc``: the writer's Python-heap peak must stay far below the data
   size (10,000 × 2,000 × (4 + 1) bytes ≈ 100 MB as int32 tokens + uint8 mask).

Writers: ours, upstream megatron-core (tokens only), Option A padded memmap, packed
Parquet (streaming, row groups of 500), and in the RFC test also the legacy ``.npy``
(which holds everything as Python lists: the RFC's ~4 GB at 50k packs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Dict, List

import numpy as np

from ._common import (MIB, RESULTS_DIR, ChildError, format_table, proc_status, ratio_cell, reset_peak_rss,
                      run_child, write_json)

SCALING_SYSTEMS = ("ours", "upstream", "option_a", "parquet")
RFC_SYSTEMS = ("ours", "option_a", "parquet", "legacy_npy")
RFC_PACKS, RFC_PACK_SIZE, RFC_TOKENS, RFC_VOCAB = 10_000, 2048, 2000, 50_000
_POOL = 64


class _PoolCorpus:
    """Duck-typed corpus: ``packs`` packs cycled from a small seeded pool (4 sequences each)."""

    def __init__(self, packs: int, pack_tokens: int, vocab_size: int = 32000, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        starts = (np.arange(4) * (pack_tokens // 4)).astype(np.int32)
        self.pool = []
        for _ in range(_POOL):
            ids = rng.integers(0, vocab_size, pack_tokens).astype(np.int32)
            loss = rng.integers(0, 2, pack_tokens).astype(np.uint8)
            loss[np.append(starts[1:], pack_tokens) - 1] = 0  # label-aligned: last of each sequence
            self.pool.append((ids, loss, starts))
        self.packs, self.pack_size, self.vocab_size = packs, pack_tokens, vocab_size
        self.n_sequences, self.n_tokens = 4 * packs, pack_tokens * packs

    def __len__(self) -> int:
        return self.packs

    def iter_packs(self):
        pool = self.pool
        for i in range(self.packs):
            yield pool[i % _POOL]


class _RfcCorpus(_PoolCorpus):
    """The RFC test's packs: fresh random arrays per pack, as its loop draws them."""

    def __init__(self, packs: int = RFC_PACKS, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.packs, self.pack_size, self.vocab_size = packs, RFC_PACK_SIZE, RFC_VOCAB
        self.n_sequences, self.n_tokens = 4 * packs, RFC_TOKENS * packs
        self.starts = np.array([0, 500, 1000, 1500], dtype=np.uint32)

    def iter_packs(self):
        for _ in range(self.packs):
            ids = self.rng.integers(0, RFC_VOCAB, size=RFC_TOKENS, dtype=np.int32)
            loss = self.rng.integers(0, 2, size=RFC_TOKENS, dtype=np.uint8)
            loss[[499, 999, 1499, 1999]] = 0  # our builder refuses loss on a sequence's last token
            yield ids, loss, self.starts


def _warm_up(mod, out_dir: Path) -> None:
    """Write one tiny shard so imports, numba kernels and lazy state are loaded before the baseline."""
    mod.write(_PoolCorpus(2, 16), str(out_dir / "warmup"))
    shutil.rmtree(out_dir / "warmup", ignore_errors=True)


def write_memory_task(system: str, packs: int, pack_tokens: int, trace: bool, out_dir: str, rfc: bool = False) -> dict:
    """Child: write ``packs`` packs with ``system``'s writer; peak RSS / heap above the baseline."""
    from . import peers

    mod = peers.load(system)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warmup").mkdir(exist_ok=True)
    _warm_up(mod, out)
    corpus = _RfcCorpus(packs) if rfc else _PoolCorpus(packs, pack_tokens)
    (out / "data").mkdir(exist_ok=True)
    reset_ok = reset_peak_rss()
    base = proc_status()["VmRSS"]
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    mod.write(corpus, str(out / "data"))
    elapsed = time.perf_counter() - t0
    heap_peak = tracemalloc.get_traced_memory()[1] if trace else None
    if trace:
        tracemalloc.stop()
    status = proc_status()
    result = {"system": system, "packs": packs, "write_s": elapsed, "heap_peak_bytes": heap_peak,
              "rss_base_mb": base, "peak_rss_reset": reset_ok}
    if not trace:
        result.update(peak_rss_mb=status["VmHWM"], peak_delta_mb=status["VmHWM"] - base)
    shutil.rmtree(out, ignore_errors=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.builder_rss", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100000,1000000", help="two or more pack counts for the scaling part")
    p.add_argument("--pack-tokens", type=int, default=32, help="tokens per pack in the scaling part")
    p.add_argument("--systems", default=",".join(SCALING_SYSTEMS), help="writers of the scaling part")
    p.add_argument("--rfc-systems", default=",".join(RFC_SYSTEMS), help="writers of the RFC test")
    p.add_argument("--rfc-packs", type=int, default=RFC_PACKS)
    p.add_argument("--skip-rfc", action="store_true")
    p.add_argument("--no-trace", action="store_true", help="skip the tracemalloc children of the scaling part")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


def _run(work: Path, **kw) -> Dict:
    return run_child("bench.builder_rss:write_memory_task", out_dir=str(work / f"{kw['system']}_{kw['packs']}"), **kw)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = sorted(int(x) for x in args.sizes.split(",") if x.strip())
    except ValueError:
        print("error: --sizes takes a comma list of integers", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    rfc_systems = [s.strip() for s in args.rfc_systems.split(",") if s.strip()]
    if len(sizes) < 2 or sizes[0] <= 0 or args.pack_tokens < 8:
        print("error: give two or more positive --sizes and --pack-tokens >= 8", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi_bench_rss_"))
    scaling: Dict[str, List[Dict]] = {}
    rfc: Dict[str, Dict] = {}
    try:
        for system in systems:
            rows = []
            for n in sizes:
                print(f"[scaling] {system} {n} packs ...", file=sys.stderr, flush=True)
                row = _run(work, system=system, packs=n, pack_tokens=args.pack_tokens, trace=False)
                if not args.no_trace:
                    row["heap_peak_bytes"] = _run(work, system=system, packs=n, pack_tokens=args.pack_tokens,
                                                  trace=True)["heap_peak_bytes"]
                rows.append(row)
            scaling[system] = rows
        if not args.skip_rfc:
            for system in rfc_systems:
                print(f"[rfc] {system} ...", file=sys.stderr, flush=True)
                rfc[system] = _run(work, system=system, packs=args.rfc_packs, pack_tokens=RFC_TOKENS,
                                   trace=True, rfc=True)
    except (ChildError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    growth = {}
    for system, rows in scaling.items():
        a, b = rows[0], rows[-1]
        extra = b["packs"] - a["packs"]
        growth[system] = {"rss_bytes_per_pack": (b["peak_delta_mb"] - a["peak_delta_mb"]) * MIB / extra,
                          "heap_bytes_per_pack": (None if a.get("heap_peak_bytes") is None else
                                                  (b["heap_peak_bytes"] - a["heap_peak_bytes"]) / extra)}
    data_bytes = args.rfc_packs * RFC_TOKENS * 5
    payload = {"params": {"sizes": sizes, "pack_tokens": args.pack_tokens, "rfc_packs": args.rfc_packs,
                          "rfc_data_bytes": data_bytes},
               "scaling": scaling, "growth_per_pack": growth, "rfc": rfc,
               "rfc_heap_over_data": {s: r["heap_peak_bytes"] / data_bytes for s, r in rfc.items()}}
    path = write_json("builder_rss", payload, args.results_dir)
    _print(payload, sizes, data_bytes)
    print(f"\nJSON: {path}")
    return 0


def _growth_cell(ours, peer) -> str:
    """A ratio means nothing against a peer that does not grow: say so instead."""
    if ours is None or peer is None:
        return "—"
    if abs(peer) < 1.0:
        return f"peer flat ({peer:+.2g} B)"
    return ratio_cell(ours, peer, False)


def _print(payload: Dict, sizes: List[int], data_bytes: int) -> None:
    scaling, growth, rfc = payload["scaling"], payload["growth_per_pack"], payload["rfc"]
    if scaling:
        rows = [[s, r["packs"], r["write_s"], r["peak_delta_mb"],
                 None if r.get("heap_peak_bytes") is None else r["heap_peak_bytes"] / MIB]
                for s, rs in scaling.items() for r in rs]
        print(format_table(["writer", "packs", "write (s)", "peak RSS above baseline (MiB)",
                            "Python heap peak (MiB)"], rows))
        print(f"\nGrowth per pack from {sizes[0]:,} to {sizes[-1]:,} packs (bytes; flat = ~0)")
        peers = [s for s in growth if s != "ours"]
        rows = [[s, g["rss_bytes_per_pack"], g["heap_bytes_per_pack"]] for s, g in growth.items()]
        print(format_table(["writer", "RSS bytes/pack", "heap bytes/pack"], rows))
        if "ours" in growth and peers:
            print("\nRatios ours ÷ peer (growth per pack, lower better)")
            print(format_table(["metric"] + peers, [
                [key] + [_growth_cell(growth["ours"][key], growth[p][key]) for p in peers]
                for key in ("rss_bytes_per_pack", "heap_bytes_per_pack")]))
    if rfc:
        print(f"\nRFC memory test: {payload['params']['rfc_packs']:,} packs × {RFC_TOKENS} tokens, "
              f"data {data_bytes / MIB:.0f} MiB (int32 tokens + uint8 mask)")
        rows = [[s, r["write_s"], r["heap_peak_bytes"] / MIB, r["heap_peak_bytes"] / data_bytes,
                 r["heap_peak_bytes"] < 100 * 2 ** 20] for s, r in rfc.items()]
        print(format_table(["writer", "write (s)", "Python heap peak (MiB)", "heap ÷ data",
                            "RFC bound (< 100 MiB)"], rows))


if __name__ == "__main__":
    sys.exit(main())
