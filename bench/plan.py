"""The plan stage at scale: global packing of N conversations' lengths (time, peak RSS, bytes/conversation).

A synthetic sequence store holding only what the planner reads (``.rows`` per partition, the
receipts, ``store.json``; lengths from ``bench/corpus.py``'s heavy-tailed SFT mixture) is
planned in a fresh child process per size by the real plan stage (``write_plan``: read the
rows, overlong handling, split, numba packing, shards, the plan file). Bytes per conversation
is the slope of the child's peak RSS between two sizes, so the interpreter, numpy and numba
(the same at every size) cancel out.

    python -m bench.plan                                  # 1M and 5M, first_fit_decreasing
    python -m bench.plan --sizes 1000000,5000000,13000000 --algorithms all --split 98,1,1
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from bench._common import format_table, run_child, write_json
from bench.corpus import sample_lengths

_PART = 250_000  # conversations per synthetic partition


def make_store(directory: str, n: int, pack_size: int, seed: int = 0) -> None:
    """A store whose partitions have rows (lengths up to 2x the pack size) but no token files."""
    from megatron_sft_idx.preprocess.records.partitions import Partition
    from megatron_sft_idx.preprocess.store import ROW_DTYPE, part_prefix, tokenize_book, write_store_file

    rng = np.random.default_rng(seed)
    parts = [Partition(0, "lines", k, k + 1, 1 + k * _PART) for k in range(-(-n // _PART))]
    identity = {"tokenizer": None, "encode": {"vocab_size": 32000, "loss_on": "assistant", "input_format": "chat",
                                              "prompt_key": "prompt", "completion_key": "completion",
                                              "skip_bad": False}, "max_record_bytes": 2 << 20}
    # (one byte per partition: the partitions cover the named input, as store.json is checked to)
    store_id = write_store_file(directory, identity, [{"name": "synthetic.jsonl", "sha256": "0" * 64,
                                                       "bytes": len(parts)}], parts, None, [])
    book = tokenize_book(directory, store_id)
    os.makedirs(os.path.join(directory, "parts"), exist_ok=True)
    for k, part in enumerate(parts):
        count = min(_PART, n - k * _PART)
        rows = np.zeros(count, dtype=ROW_DTYPE)
        rows["line"] = part.first_line + np.arange(count)
        rows["length"] = sample_lengths(rng, count, 2 * pack_size)  # some overlong: truncation is exercised
        rows["first_trained"] = rows["length"] // 3
        path = part_prefix(directory, k) + ".rows"
        rows.tofile(path)
        book.write(k, {"records": count, "sequences": count, "tokens": int(rows["length"].sum()), "skipped": {},
                       "first_skipped": {}}, [path])


def child_plan(store: str, plan: str, pack_size: int, algorithm: str, split, cp: int) -> dict:
    from megatron_sft_idx.packing import pad_multiple_for
    from megatron_sft_idx.preprocess.plan import PlanSettings, write_plan
    from megatron_sft_idx.preprocess.store import SequenceStore

    settings = PlanSettings(pack_size=pack_size, pad_multiple=pad_multiple_for(cp), algorithm=algorithm, seed=1,
                            split=tuple(split) if split else None, overlong="truncate", skip_bad=False,
                            max_packs_per_shard=None, max_shard_bytes=1 << 30, itemsize=2)
    t = time.perf_counter()
    meta = write_plan(SequenceStore(store), settings, plan)
    wall = time.perf_counter() - t
    return {"plan_s": wall, "conversations": meta["conversations"], "packs": sum(s["packs"] for s in meta["splits"]),
            "efficiency": meta["splits"][0]["packing_efficiency"], "plan_bytes": os.path.getsize(plan)}


def child_baseline() -> dict:
    """The planner's imports and numba kernels loaded, nothing planned: the RSS floor."""
    import megatron_sft_idx.preprocess.plan  # noqa: F401

    return {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,5000000", help="conversation counts (default: 1000000,5000000)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--algorithms", default="first_fit_decreasing",
                   help="comma-separated algorithms, or 'all' (default: first_fit_decreasing)")
    p.add_argument("--split", default="", help="split weights, e.g. 98,1,1 (default: none)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism to pad for (default: 1)")
    p.add_argument("--work-dir", default=None, help="where the synthetic stores go (default: a temporary dir)")
    return p


def main(argv=None) -> int:
    from megatron_sft_idx.packing import ALGORITHMS

    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    algorithms = list(ALGORITHMS) if args.algorithms == "all" else args.algorithms.split(",")
    split = [float(x) for x in args.split.split(",")] if args.split else None
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-plan-")
    rows, results = [], []
    try:
        floor = run_child("bench.plan:child_baseline")["peak_rss_mb"]
        for n in sizes:
            store = os.path.join(work, f"store_{n}")
            if not os.path.exists(os.path.join(store, "store.json")):
                make_store(store, n, args.pack_size)
            for algorithm in algorithms:
                r = run_child("bench.plan:child_plan", store=store, plan=os.path.join(work, "p.plan"),
                              pack_size=args.pack_size, algorithm=algorithm, split=split, cp=args.cp)
                r.update(n=n, algorithm=algorithm, floor_mb=floor,
                         bytes_per_conv_over_floor=(r["peak_rss_mb"] - floor) * (1 << 20) / n)
                results.append(r)
        for algorithm in algorithms:
            runs = [r for r in results if r["algorithm"] == algorithm]
            for a, b in zip(runs, runs[1:]):
                slope = (b["peak_rss_mb"] - a["peak_rss_mb"]) * (1 << 20) / (b["n"] - a["n"])
                b["bytes_per_conv_slope"] = slope
            for r in runs:
                rows.append([algorithm, f"{r['n']:,}", r["plan_s"], r["peak_rss_mb"],
                             r.get("bytes_per_conv_slope"), r["bytes_per_conv_over_floor"], r["packs"],
                             r["efficiency"], r["plan_bytes"] / r["n"]])
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"interpreter + numba floor: {floor:.0f} MiB")
    print(format_table(["algorithm", "conversations", "plan s", "peak MiB", "B/conv (slope)",
                        "B/conv (over floor)", "packs", "efficiency", "plan file B/conv"], rows))
    print("wrote", write_json("plan", {"params": vars(args), "floor_mb": floor, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
