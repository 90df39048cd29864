"""A mixture's plan at scale: N sequences in S stores planned by trained tokens (time, peak RSS).

S synthetic sequence stores holding only what the planner reads (``.rows`` and ``.trained`` per
partition, the receipts, ``store.json``; lengths from ``bench/corpus.py``'s heavy-tailed SFT
mixture, each store's trained fraction its own, from 5 % to 95 %; weights 1, 2, 3, 1, ... by
trained tokens, no repetition: the smallest source decides the total, the others are sampled
down) are planned in a fresh child process per size by the real plan of a mixture
(``write_mix_plan``: kept lengths and trained
counts of every store, a split, each source's share realised, global packing, shards, the plan
file). The interleaved order of the largest split is timed too (``batching.interleave``). Bytes
per sequence is the slope of the child's peak RSS between two sizes, so the interpreter, numpy
and numba (the same at every size) cancel out.

    python -m bench.mix_plan                                   # 1.3M and 13M sequences in 10 stores
    python -m bench.mix_plan --sizes 1000000,13000000 --stores 10 --split 98,1,1
    python -m bench.mix_plan --unit epochs          # every source once: every stored sequence planned
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

_PART = 250_000  # sequences per synthetic partition


def make_store(directory: str, n: int, pack_size: int, trained_fraction: float, seed: int) -> None:
    """A store of ``n`` sequences whose partitions have rows and trained counts but no token files
    (lengths within the pack size: the plan then reads no mask)."""
    from megatron_sft_idx.preprocess.records.partitions import Partition
    from megatron_sft_idx.preprocess.store import (ROW_DTYPE, TRAINED_DTYPE, TRAINED_SUFFIX, part_prefix,
                                                   tokenize_book, write_store_file)

    rng = np.random.default_rng(seed)
    parts = [Partition(0, "lines", k, k + 1, 1 + k * _PART) for k in range(-(-n // _PART))]
    identity = {"tokenizer": None, "encode": {"vocab_size": 32000, "loss_on": "assistant", "input_format": "chat",
                                              "prompt_key": "prompt", "completion_key": "completion",
                                              "skip_bad": False}, "max_record_bytes": 2 << 20}
    store_id = write_store_file(directory, identity, [{"name": f"synthetic_{seed}.jsonl", "sha256": "0" * 64,
                                                       "bytes": len(parts)}], parts, None, [])
    book = tokenize_book(directory, store_id)
    os.makedirs(os.path.join(directory, "parts"), exist_ok=True)
    for k, part in enumerate(parts):
        count = min(_PART, n - k * _PART)
        rows = np.zeros(count, dtype=ROW_DTYPE)
        rows["line"] = part.first_line + np.arange(count)
        rows["length"] = sample_lengths(rng, count, pack_size)
        trained = np.maximum(1, np.rint(rows["length"] * trained_fraction * rng.uniform(0.6, 1.0, count)))
        trained = np.minimum(trained, rows["length"] - 1).astype(TRAINED_DTYPE)
        rows["first_trained"] = rows["length"] - 1 - trained
        prefix = part_prefix(directory, k)
        rows.tofile(prefix + ".rows")
        trained.tofile(prefix + TRAINED_SUFFIX)
        book.write(k, {"records": count, "sequences": count, "tokens": int(rows["length"].sum()), "skipped": {},
                       "first_skipped": {}}, [prefix + ".rows", prefix + TRAINED_SUFFIX])


def child_plan(stores, plan: str, pack_size: int, split, unit: str, interleave_gbs: int, weights) -> dict:
    from megatron_sft_idx.batching.interleave import interleave
    from megatron_sft_idx.preprocess.config import PackSettings
    from megatron_sft_idx.preprocess.mixplan import write_mix_plan
    from megatron_sft_idx.preprocess.mixture import parse_mixture
    from megatron_sft_idx.preprocess.planfile import PackPlan
    from megatron_sft_idx.preprocess.store import SequenceStore
    from megatron_sft_idx.preprocess.stores import StoreSet

    names = [f"s{k}" for k in range(len(stores))]
    mixture = parse_mixture({"version": 1, "unit": unit, "sources": [
        {"name": n, "store": d, "weight": weight} for n, d, weight in zip(names, stores, weights)]},
        os.path.join(os.path.dirname(stores[0]), "mix.json"))
    settings = PackSettings(pack_size=pack_size, split=tuple(split) if split else None, overlong="drop",
                            max_shard_bytes=1 << 30).plan_settings(32000)
    t, cpu = time.perf_counter(), time.process_time()
    st = StoreSet([SequenceStore(d) for d in stores], names)
    meta = write_mix_plan(st, mixture, settings, plan)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    p = PackPlan(plan, verify=False)
    split0 = p.splits[0]
    measures = np.asarray(p.arrays(0)["pack_measures"]).reshape(-1, len(names))
    target = np.array([s["amount"] for s in split0["sources"]], dtype=np.float64)
    t = time.perf_counter()
    interleave(measures, target / target.sum(), seed=1)
    inter = time.perf_counter() - t
    return {"plan_s": wall, "plan_cpu_s": cpu, "interleave_s": inter, "sequences": meta["conversations"],
            "packs": sum(s["packs"] for s in meta["splits"]), "plan_bytes": os.path.getsize(plan),
            "stored": st.sequence_count,
            "max_share_deviation": 0.0 if unit == "epochs" else max(
                abs(s["amount"] / sum(x["amount"] for x in sp["sources"]) - w / sum(weights))
                for sp in meta["splits"] for w, s in zip(weights, sp["sources"]))}


def child_baseline() -> dict:
    """The planner's imports and numba kernels loaded, nothing planned: the RSS floor."""
    import megatron_sft_idx.batching.interleave  # noqa: F401
    import megatron_sft_idx.preprocess.mixplan  # noqa: F401

    return {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1300000,13000000", help="total sequences (default: 1300000,13000000)")
    p.add_argument("--stores", type=int, default=10, help="stores (sources) (default: 10)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--split", default="", help="split weights, e.g. 98,1,1 (default: none)")
    p.add_argument("--unit", default="trained_tokens", help="the mixture's unit (default: trained_tokens)")
    p.add_argument("--gbs", type=int, default=512, help="global batch size of the interleave (default: 512)")
    p.add_argument("--work-dir", default=None, help="where the synthetic stores go (default: a temporary dir)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    split = [float(x) for x in args.split.split(",")] if args.split else None
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-mix-")
    results = []
    try:
        floor = run_child("bench.mix_plan:child_baseline")["peak_rss_mb"]
        for n in sizes:
            stores = []
            for k in range(args.stores):
                store = os.path.join(work, f"n{n}", f"store_{k}")
                if not os.path.exists(os.path.join(store, "store.json")):
                    make_store(store, n // args.stores, args.pack_size, 0.05 + 0.9 * k / max(1, args.stores - 1),
                               seed=k)
                stores.append(store)
            r = run_child("bench.mix_plan:child_plan", stores=stores, plan=os.path.join(work, "m.plan"),
                          pack_size=args.pack_size, split=split, unit=args.unit, interleave_gbs=args.gbs,
                          weights=[1 + k % 3 if args.unit != "epochs" else 1 for k in range(args.stores)])
            r.update(n=n, floor_mb=floor)
            results.append(r)
        for a, b in zip(results, results[1:]):
            b["bytes_per_seq_slope"] = (b["peak_rss_mb"] - a["peak_rss_mb"]) * (1 << 20) / (b["n"] - a["n"])
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    rows = [[f"{r['n']:,}", args.stores, f"{r['sequences']:,}", r["plan_s"], r["plan_cpu_s"], r["interleave_s"],
             r["peak_rss_mb"], r.get("bytes_per_seq_slope"), f"{r['packs']:,}",
             f"{100 * r['max_share_deviation']:.4f}%"] for r in results]
    print(f"interpreter + numba floor: {floor:.0f} MiB")
    print(format_table(["stored", "stores", "planned", "plan s", "plan CPU s", "interleave s", "peak MiB",
                        "B/stored seq (slope)", "packs", "worst share dev"], rows))
    print("wrote", write_json("mix_plan", {"params": vars(args), "floor_mb": floor, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
