"""Offset accumulation (pack lengths -> int64 byte pointers) for 1M and 10M packs.

``python -m bench.offsets`` times three ways of computing ``pointer[i] = itemsize *
sum(lengths[:i])``:

- ``numba``: ``megatron_sft_idx._kernels.exclusive_cumsum`` (what our builder runs,
  with an int64 overflow check per element); its first call in a process, which
  loads the compiled kernel from numba's cache, is reported separately;
- ``python_loop``: upstream megatron-core's ``_IndexWriter._sequence_pointers`` (the
  real function from the installed package when available, else the same
  per-element loop), fed a Python list of lengths as upstream's builder holds them;
- ``numpy``: ``np.cumsum`` in int64, for reference (no overflow check).

All three results are compared element by element. The design budget: 10M packs in
milliseconds, not the seconds of a Python loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from ._common import RESULTS_DIR, format_table, write_json

ITEMSIZE = 2  # uint16 tokens


def _upstream_loop():
    """upstream's ``_sequence_pointers`` bound to a uint16 writer, or None without megatron-core."""
    try:
        from megatron.core.datasets.indexed_dataset import _IndexWriter
    except Exception:  # megatron-core absent or its import failed: use the local loop
        return None
    fake_writer = SimpleNamespace(dtype=np.uint16)
    return lambda lengths: _IndexWriter._sequence_pointers(fake_writer, lengths)


def local_loop(lengths) -> list:
    """The per-element loop upstream runs, for when megatron-core is not installed."""
    itemsize = np.int64(ITEMSIZE)
    pointer = np.int64(0)
    out = []
    for length in lengths:
        out.append(pointer.item())
        pointer += length * itemsize
    return out


def numpy_pointers(lengths: np.ndarray) -> np.ndarray:
    out = np.empty(lengths.size, dtype=np.int64)
    out[0] = 0
    np.cumsum(lengths[:-1], dtype=np.int64, out=out[1:])
    out *= ITEMSIZE
    return out


def _median_time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.offsets", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000000,10000000", help="comma list of pack counts")
    p.add_argument("--repeats", type=int, default=5, help="repeats of the numba and numpy runs (median)")
    p.add_argument("--loop-repeats", type=int, default=1, help="repeats of the Python loop (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        print("error: --sizes takes a comma list of integers", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 2 or args.repeats < 1 or args.loop_repeats < 1:
        print("error: sizes must be >= 2 and repeats >= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    from megatron_sft_idx import _kernels
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _kernels.exclusive_cumsum(np.ones(4, dtype=np.int32), ITEMSIZE, 0)
    first_call_s = time.perf_counter() - t0
    upstream = _upstream_loop()
    loop = upstream or local_loop
    rng = np.random.default_rng(args.seed)
    rows, results = [], {}
    for n in sizes:
        lengths = rng.integers(1, 4097, n, dtype=np.int32)
        numba_s, (ptr_numba, end, bad) = _median_time(lambda: _kernels.exclusive_cumsum(lengths, ITEMSIZE, 0),
                                                      args.repeats)
        numpy_s, ptr_numpy = _median_time(lambda: numpy_pointers(lengths), args.repeats)
        as_list = lengths.tolist()  # upstream's builder keeps a Python list of lengths
        loop_s, ptr_loop = _median_time(lambda: loop(as_list), args.loop_repeats)
        agree = (bad == -1 and np.array_equal(ptr_numba, ptr_numpy)
                 and np.array_equal(ptr_numba, np.asarray(ptr_loop, dtype=np.int64))
                 and end == int(lengths.sum(dtype=np.int64)) * ITEMSIZE)
        del ptr_loop  # free the big list of Python ints before the next size
        results[str(n)] = {"packs": n, "numba_s": numba_s, "numpy_s": numpy_s, "python_loop_s": loop_s,
                           "loop_over_numba": loop_s / numba_s, "numba_over_numpy": numba_s / numpy_s,
                           "results_agree": bool(agree)}
        rows.append([n, numba_s * 1e3, numpy_s * 1e3, loop_s * 1e3, loop_s / numba_s, numba_s / numpy_s, agree])
    payload = {"params": {"sizes": sizes, "repeats": args.repeats, "loop_repeats": args.loop_repeats,
                          "itemsize": ITEMSIZE},
               "python_loop": "megatron.core _IndexWriter._sequence_pointers" if upstream else "local copy of the loop",
               "numba_import_s": import_s, "numba_first_call_s": first_call_s, "sizes": results}
    path = write_json("offsets", payload, args.results_dir)
    print(format_table(["packs", "numba (ms)", "numpy cumsum (ms)", "Python loop (ms)",
                        "loop ÷ numba (speed-up)", "numba ÷ numpy", "results agree"], rows))
    print(f"\nPython loop: {payload['python_loop']}; numba first call in a process (cache load): "
          f"{first_call_s * 1e3:.0f} ms; importing the kernels module: {import_s * 1e3:.0f} ms")
    print(f"JSON: {path}")
    return 0 if all(r["results_agree"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
