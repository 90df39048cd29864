"""What re-verifying the index cache costs: opening a remote shard from a warm cache, per process.

``python -m bench.index_cache --packs 1000000``

One shard of ``--packs`` packs (``--pack-size`` tokens, two sequences each: small packs, so
the index files are large for the data) is written, uploaded to moto's S3 server (its own
process, ``bench/s3loop.py``) and opened once, which downloads and verifies its index files
into the cache. Then ``--repeats`` fresh processes each open it from the warm cache, as every
rank and spawned DataLoader worker does: each re-verifies the cached files once (CRC-32 of
``.idx``, ``.seq.idx`` and ``.seq.bin``, read from the descriptors it maps) before it maps
them. Reported: the open time, the part of it spent verifying, the bytes verified and their
rate, and the CRC backend. A second open in the same process verifies nothing (measured too).
Results: ``bench/results/index_cache.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import MIB, RESULTS_DIR, run_child, write_json

BUCKET = "bench-index-cache"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.index_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--packs", type=int, default=1_000_000)
    p.add_argument("--pack-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


def write(prefix: str, packs: int, pack_size: int) -> None:
    """``packs`` full packs of two sequences each, written in runs by the vectorised builder."""
    from megatron_sft_idx.builder import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    run = 1 << 18
    with IndexedDatasetBuilder(prefix, pack_size=pack_size, vocab_size=32000) as b:
        for start in range(0, packs, run):
            n = min(run, packs - start)
            tokens = rng.integers(0, 32000, n * pack_size, dtype=np.int32)
            loss = np.ones(n * pack_size, np.uint8)
            loss[pack_size // 2 - 1::pack_size] = 0
            loss[pack_size - 1::pack_size] = 0
            starts = np.tile(np.array([0, pack_size // 2], np.int64), n)
            b.add_packs(tokens, loss, starts, np.arange(n + 1, dtype=np.int64) * pack_size,
                        np.arange(n + 1, dtype=np.int64) * 2)


def open_task(url: str, env: dict, reopen: bool) -> dict:
    """In a fresh process: open ``url`` from the warm cache; time the whole open and the part
    spent in the index cache's verification."""
    os.environ.update(env)
    from megatron_sft_idx import MMapIndexedDataset
    from megatron_sft_idx._crc import CRC_BACKEND
    from megatron_sft_idx.storage import index_cache

    spent = [0.0]
    real = index_cache._verify_entry

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    index_cache._verify_entry = timed
    t0 = time.perf_counter()
    ds = MMapIndexedDataset(url)
    first = time.perf_counter() - t0
    verified = sum(os.path.getsize(ds.local_index_prefix + s) for s in (".idx", ".seq.idx", ".seq.bin"))
    out = {"open_s": first, "verify_s": spent[0], "verified_mib": verified / MIB, "crc_backend": CRC_BACKEND,
           "packs": len(ds)}
    if reopen:
        spent[0] = 0.0
        t0 = time.perf_counter()
        MMapIndexedDataset(url)
        out.update(reopen_s=time.perf_counter() - t0, reopen_verify_s=spent[0])
    return out


def main(argv=None) -> int:
    import shutil
    import sys

    from .s3loop import LoopProcess

    args = build_parser().parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi-bench-index-cache-"))
    prefix = str(work / "shard")
    t0 = time.perf_counter()
    write(prefix, args.packs, args.pack_size)
    print(f"wrote {args.packs} packs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    with LoopProcess(env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 30)}) as loop:
        loop.make_bucket(BUCKET)
        env = {**loop.env(), "MEGATRON_SFT_IDX_CACHE": str(work / "cache")}
        os.environ.update(env)
        from megatron_sft_idx.publishing import upload_shard

        url = f"s3://{BUCKET}/big/shard"
        upload_shard(prefix, url)
        first = run_child("bench.index_cache:open_task", url=url, env=env, reopen=False)  # downloads, verifies
        runs = [run_child("bench.index_cache:open_task", url=url, env=env, reopen=True) for _ in range(args.repeats)]
    rows = {k: statistics.median(r[k] for r in runs) for k in ("open_s", "verify_s", "reopen_s", "reopen_verify_s")}
    result = {"packs": args.packs, "pack_size": args.pack_size, "verified_mib": runs[0]["verified_mib"],
              "crc_backend": runs[0]["crc_backend"], "cold_open_s": first["open_s"], **rows,
              "verify_mib_per_s": runs[0]["verified_mib"] / rows["verify_s"] if rows["verify_s"] else None,
              "runs": runs}
    write_json("index_cache", result, Path(args.results_dir))
    print(f"{args.packs} packs, {result['verified_mib']:.0f} MiB of index files ({result['crc_backend']}): "
          f"cold open {first['open_s']:.2f} s; warm open in a fresh process {rows['open_s']:.3f} s, of which "
          f"re-verification {rows['verify_s']:.3f} s ({result['verify_mib_per_s'] or 0:.0f} MiB/s); "
          f"reopen in the same process {rows['reopen_s']:.4f} s (verification {rows['reopen_verify_s']:.4f} s)")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
