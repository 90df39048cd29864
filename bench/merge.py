"""Merging shards: peak RSS and time, ours vs upstream's ``merge_datasets.py`` logic, same inputs.

``python -m bench.merge`` builds, once per scenario, N input shards (``--templates``
distinct shards written by our builder, copied to N names), then merges them in fresh
child processes:

* **ours**: :func:`megatron_sft_idx.tools.merge.merge_shards` -- the whole tool: data
  concatenated with ``copy_file_range``, indexes rebased in numba, then the promotion gate
  (standard level: every CRC and pack re-read) before the atomic publish. The child
  reports the peak RSS of the merge itself and of the gate pass separately
  (``VmHWM`` reset between them through ``/proc/self/clear_refs``);
* **upstream**: what Megatron-LM's ``tools/merge_datasets.py`` does -- the *installed*
  megatron-core ``IndexedDatasetBuilder``, ``add_index(prefix)`` for every input in order,
  then ``finalize``. It merges ``.bin``/``.idx`` only (our shards' tokens are
  upstream-readable), so it does less work than ours: no loss mask, no sequence starts,
  no checksums, no validation.

Both outputs' ``.bin`` and ``.idx`` are compared byte for byte. Scenarios (default):
``small-200`` and ``small-2000`` (200 / 2,000 shards of ``--small-packs`` packs: memory
must stay flat in the number of inputs and packs for ours; upstream's per-pack Python
lists grow) and ``large`` (``--large-shards`` shards of ``--large-packs`` packs each).
Ratios are ours ÷ upstream in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

from ._common import (RESULTS_DIR, format_table, proc_status, ratio_cell, reset_peak_rss, run_child,
                      write_json)

SUFFIXES = (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")


def _random_run(rng, packs: int, mean_tokens: int, vocab: int = 32000):
    """``packs`` packs of 1-4 sequences, lengths around ``mean_tokens``, as flat arrays + offsets."""
    lengths = rng.integers(max(4, mean_tokens // 2), mean_tokens * 3 // 2 + 1, packs)
    seqs = np.minimum(rng.integers(1, 5, packs), lengths // 2)
    token_offsets = np.concatenate(([0], np.cumsum(lengths)))
    seq_offsets = np.concatenate(([0], np.cumsum(seqs)))
    starts = np.zeros(int(seq_offsets[-1]), dtype=np.int32)
    for k in range(1, 4):  # sequence k of each pack (if any) starts at k * len // seqs
        has = seqs > k
        starts[seq_offsets[:-1][has] + k] = (k * lengths[has]) // seqs[has]
    tokens = rng.integers(0, vocab, int(token_offsets[-1])).astype(np.uint16)
    loss = rng.integers(0, 2, tokens.size).astype(np.uint8)
    ends = np.concatenate((starts[1:], [0])) + np.repeat(token_offsets[:-1], seqs)
    ends[seq_offsets[1:] - 1] = token_offsets[1:]  # last sequence of each pack ends at the pack end
    loss[ends - 1] = 0  # label-aligned: nothing to predict after a sequence's last token
    return tokens, loss, starts, token_offsets, seq_offsets


def make_inputs(directory: str, count: int, packs: int, mean_tokens: int, templates: int, seed: int = 0) -> List[str]:
    """``count`` shards of ``packs`` packs: ``templates`` distinct ones, copied to the other names."""
    from megatron_sft_idx import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    prefixes = [os.path.join(directory, f"part_{i:05d}") for i in range(count)]
    for t in range(min(templates, count)):
        with IndexedDatasetBuilder(prefixes[t], dtype=np.uint16, pack_size=mean_tokens * 2, vocab_size=32000) as b:
            for start in range(0, packs, 1 << 18):
                b.add_packs(*_random_run(rng, min(1 << 18, packs - start), mean_tokens))
    for i in range(templates, count):
        for suffix in SUFFIXES:
            shutil.copyfile(prefixes[i % templates] + suffix, prefixes[i] + suffix)
    return prefixes


# --------------------------------------------------------------------------- children


class _AnonPeak:
    """Samples ``RssAnon`` (heap and other private memory; not mapped file pages, which are
    reclaimable page cache) every few milliseconds: the kernel keeps no high-water mark of it."""

    def __init__(self, interval: float = 0.005) -> None:
        import threading

        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status().get("RssAnon", 0.0))
            self._stop.wait(interval)

    def __enter__(self) -> "_AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status().get("RssAnon", 0.0))


def _warm_up(directory: str) -> None:
    """Merge one one-pack shard: loads the numba kernels, the gate and the reader (fixed costs,
    ~100 MiB of LLVM runtime) before the RSS baseline, so growth above it is what the merge holds."""
    from megatron_sft_idx import IndexedDatasetBuilder
    from megatron_sft_idx.tools import merge

    with IndexedDatasetBuilder(os.path.join(directory, "tiny"), pack_size=8) as b:
        b.add_packed(np.array([1, 2, 3]), np.array([1, 1, 0]), np.array([0]))
    merge.merge_shards(os.path.join(directory, "tiny_out"), [os.path.join(directory, "tiny")])


def merge_ours(out: str, inputs: List[str]) -> Dict[str, float]:
    from megatron_sft_idx.tools import merge

    scratch = tempfile.mkdtemp(prefix="warm_", dir=os.path.dirname(out))
    _warm_up(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    phases = {}
    real_gate = merge._gate

    def measured_gate(*args):
        phases["merge_peak_rss_mb"] = proc_status()["VmHWM"]
        phases["reset"] = reset_peak_rss()
        real_gate(*args)
        phases["gate_peak_rss_mb"] = proc_status()["VmHWM"]

    merge._gate = measured_gate
    reset_peak_rss()
    base, base_anon = proc_status()["VmRSS"], proc_status().get("RssAnon", 0.0)
    t0 = time.perf_counter()
    with _AnonPeak() as anon:
        result = merge.merge_shards(out, inputs)
    seconds = time.perf_counter() - t0
    peak = max(phases["merge_peak_rss_mb"], phases["gate_peak_rss_mb"])
    return {"seconds": seconds, "gate_seconds": result.gate_seconds, "base_rss_mb": base,
            "peak_rss_mb": peak, "packs": result.metadata.stats.pack_count, "base_anon_mb": base_anon,
            "peak_anon_mb": anon.peak, **phases}


def merge_upstream(out: str, inputs: List[str]) -> Dict[str, float]:
    """Megatron-LM's tools/merge_datasets.py, as a loop over the installed builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    base, base_anon = proc_status()["VmRSS"], proc_status().get("RssAnon", 0.0)
    t0 = time.perf_counter()
    with _AnonPeak() as anon:
        builder = IndexedDatasetBuilder(get_bin_path(out), dtype=np.uint16)
        for prefix in inputs:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(out))
    return {"seconds": time.perf_counter() - t0, "base_rss_mb": base, "packs": len(builder.sequence_lengths),
            "base_anon_mb": base_anon, "peak_anon_mb": anon.peak}


# --------------------------------------------------------------------------- driver


def _same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 24), fb.read(1 << 24)
            if x != y:
                return False
            if not x:
                return True


def run_scenario(name: str, work: str, count: int, packs: int, mean_tokens: int, templates: int) -> dict:
    inputs_dir = os.path.join(work, name, "inputs")
    t0 = time.perf_counter()
    prefixes = make_inputs(inputs_dir, count, packs, mean_tokens, templates)
    made = time.perf_counter() - t0
    data_bytes = sum(os.path.getsize(p + s) for p in prefixes for s in SUFFIXES)
    row = {"scenario": name, "shards": count, "packs": count * packs, "input_bytes": data_bytes, "make_s": made}
    for system, target in (("upstream", "bench.merge:merge_upstream"), ("ours", "bench.merge:merge_ours")):
        out = os.path.join(work, name, f"out_{system}")
        row[system] = run_child(target, out=out, inputs=prefixes)
    ours, up = os.path.join(work, name, "out_ours"), os.path.join(work, name, "out_upstream")
    row["same_bin_and_idx"] = _same_bytes(ours + ".bin", up + ".bin") and _same_bytes(ours + ".idx", up + ".idx")
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    return row


def _table(rows: List[dict]) -> str:
    """Peak RSS (and its growth above the process's RSS after imports: torch for upstream,
    numba for ours), time with and without our gate pass, ratios ours ÷ upstream."""
    out = []
    for r in rows:
        o, u = r["ours"], r["upstream"]
        o_delta, u_delta = o["peak_rss_mb"] - o["base_rss_mb"], u["peak_rss_mb"] - u["base_rss_mb"]
        o_anon = o.get("peak_anon_mb", 0) - o.get("base_anon_mb", 0)
        u_anon = u.get("peak_anon_mb", 0) - u.get("base_anon_mb", 0)
        out.append([r["scenario"], f"{r['packs']:,}", f"{r['input_bytes'] / 2**20:,.0f} MiB",
                    o["peak_rss_mb"], u["peak_rss_mb"],
                    ratio_cell(o["peak_rss_mb"], u["peak_rss_mb"], higher_is_better=False),
                    o.get("merge_peak_rss_mb", 0) - o["base_rss_mb"], o_delta, u_delta, o_anon, u_anon,
                    ratio_cell(o_anon, u_anon, higher_is_better=False),
                    o["seconds"], o["gate_seconds"], u["seconds"],
                    ratio_cell(o["seconds"], u["seconds"], higher_is_better=False),
                    ratio_cell(o["seconds"] - o["gate_seconds"], u["seconds"], higher_is_better=False),
                    r["same_bin_and_idx"]])
    header = ["scenario", "packs", "input", "ours peak RSS MiB", "upstream peak RSS MiB", "peak RSS ours÷up",
              "ours merge growth MiB", "ours growth incl. gate", "upstream growth", "ours anon growth",
              "upstream anon growth", "anon growth ours÷up", "ours s (incl. gate)",
              "of which gate s", "upstream s", "time ours÷up", "ours w/o gate ÷ up", ".bin/.idx identical"]
    return format_table(header, out)


def render(paths: List[str]) -> str:
    """The table of one or several results files (scenarios run separately)."""
    import json

    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)["rows"]
    return _table(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small-shards", default="200,2000", help="input counts of the small scenarios")
    p.add_argument("--small-packs", type=int, default=2500, help="packs per small shard")
    p.add_argument("--large-shards", type=int, default=4)
    p.add_argument("--large-packs", type=int, default=2_500_000, help="packs per large shard")
    p.add_argument("--mean-tokens", type=int, default=48, help="mean tokens per pack")
    p.add_argument("--templates", type=int, default=8, help="distinct small shards (copied to the rest)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--skip-large", action="store_true")
    p.add_argument("--name", default="merge", help="results file name under bench/results/ (default merge)")
    p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                   help="only print the table of earlier results files")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0
    work = args.work or tempfile.mkdtemp(prefix="bench_merge_")
    rows = []
    try:
        for count in [int(x) for x in args.small_shards.split(",") if x]:
            rows.append(run_scenario(f"small-{count}", work, count, args.small_packs, args.mean_tokens,
                                     args.templates))
            print(_table(rows[-1:]), flush=True)
        if not args.skip_large:
            rows.append(run_scenario("large", work, args.large_shards, args.large_packs, args.mean_tokens,
                                     args.large_shards))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    table = _table(rows)
    print(table)
    path = write_json(args.name, {"rows": rows, "table": table}, args.results_dir)
    print(f"results: {path}")
    return 0 if all(r["same_bin_and_idx"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
