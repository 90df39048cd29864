"""Packing time: numba segment-tree algorithms vs a pure-Python segment-tree first fit.

The peer is first fit decreasing with a segment tree over bins written in plain
Python, as Megatron-Bridge's packer does; it runs on a smaller N (it is slow),
and ours runs on the same N for the ratio, then on 1M lengths (13M with --full).

    python -m bench.packing            # 1M ours, 200k peer
    python -m bench.packing --full     # adds 13M ours and a 1M peer
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import format_table, ratio_cell, write_json
from megatron_sft_idx.packing import ALGORITHMS, pack_lengths, packing_summary


def sft_lengths(n: int, pack_size: int, seed: int = 0) -> np.ndarray:
    """Log-normal SFT-like lengths (median ~400 tokens), clipped to [1, pack_size]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 0.9, n), 1, pack_size).astype(np.int64)


def python_segment_tree_ffd(lengths, capacity):
    """Pure-Python FFD: sort, then a max-segment-tree over bins to find the first that fits."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = 1
    while size < len(lengths):
        size *= 2
    tree = [capacity] * (2 * size)
    bin_of = [0] * len(lengths)
    n_bins = 0
    for i in order:
        item = lengths[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= item else 2 * node + 1
        b = node - size
        bin_of[i] = b
        n_bins = max(n_bins, b + 1)
        tree[node] -= item
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bin_of, n_bins


def time_ours(lengths, pack_size, algorithm, repeat=3):
    pack_lengths(lengths[:1000], pack_size, algorithm)  # compile / load the numba cache
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = pack_lengths(lengths, pack_size, algorithm, seed=0)
        best = min(best, time.perf_counter() - t)
    return best, packing_summary(result, lengths)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="lengths for our algorithms (default: 1000000)")
    p.add_argument("--peer-n", type=int, default=200_000, help="lengths for the Python peer (default: 200000)")
    p.add_argument("--pack-size", type=int, default=4096, help="bin capacity (default: 4096)")
    p.add_argument("--full", action="store_true", help="also 13M lengths (ours) and a 1M Python peer")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rows, results = [], {"pack_size": args.pack_size, "runs": []}
    peer_n = 1_000_000 if args.full else args.peer_n
    peer_lengths = sft_lengths(peer_n, args.pack_size)
    t = time.perf_counter()
    _, peer_bins = python_segment_tree_ffd(peer_lengths.tolist(), args.pack_size)
    peer_s = time.perf_counter() - t
    ours_s, summary = time_ours(peer_lengths, args.pack_size, "first_fit_decreasing")
    if summary["bins"] != peer_bins:  # same algorithm, so the same answer
        raise RuntimeError(f"numba FFD made {summary['bins']} bins, the Python peer {peer_bins}")
    results["runs"].append({"n": peer_n, "algorithm": "first_fit_decreasing", "seconds": ours_s,
                            "peer_python_seconds": peer_s, "bins": peer_bins})
    rows.append([f"{peer_n:,}", "first_fit_decreasing", ours_s, peer_s, ratio_cell(ours_s, peer_s, False),
                 summary["efficiency"]])
    sizes = [args.n] + ([13_000_000] if args.full else [])
    for n in sizes:
        lengths = sft_lengths(n, args.pack_size, seed=1)
        for algorithm in ALGORITHMS:
            seconds, summary = time_ours(lengths, args.pack_size, algorithm, repeat=1 if n > 2_000_000 else 3)
            results["runs"].append({"n": n, "algorithm": algorithm, "seconds": seconds, **summary})
            rows.append([f"{n:,}", algorithm, seconds, None, "—", summary["efficiency"]])
    print(format_table(["lengths", "algorithm", "ours s", "python segtree s", "ours/python", "efficiency"], rows))
    print("wrote", write_json("packing", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
