"""Training reads from a bucket, side by side on one S3 server on loopback, in one run.

``python -m bench.remote --packs 5000 --pack-size 4096 --block-size 1M --cache-blocks 8``

One seeded corpus is written as our shard and as Bridge's packed Parquet, uploaded to
moto's S3 server (its own process, behind a counting proxy: ``bench/s3loop.py``), and
read back by fresh child processes, each touching every array of every pack it reads
(digests checked against the corpus, so a reader returning wrong data shows
``verified: NO``):

* ``ours_shuffle`` — ``MMapIndexedDataset("s3://...")[i]`` in a full shuffle;
* ``ours_shuffle_batched`` — the same order, ``get_many`` 32 packs at a time (parallel GETs);
* ``ours_block_local`` — ``ds[i]`` in the block-local order (``--window`` blocks);
* ``upstream_s3`` — megatron-core's own S3 reader (``IndexedDataset`` with
  ``ObjectStorageConfig(bin_chunk_nbytes=--block-size)``) on our ``.bin/.idx``, tokens
  only, full shuffle;
* ``parquet_msc`` — Bridge's ``GPTSFTPackedParquetDataset`` logic over
  ``multistorageclient.open`` (what Bridge does with MSC enabled), full shuffle;
* ``parquet_arrow`` — the same reader over pyarrow's ``S3FileSystem`` (ranged reads of
  row groups), full shuffle.

Reported per reader: open time (index download included), random packs/s, GETs and
MiB fetched per pack (counted at the proxy, open included), hit rate where there is a
block cache. Then the order statistics of the block-local order against a full shuffle
on the same shard. Results: ``bench/results/remote.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from ._common import MIB, RESULTS_DIR, ROOT, ChildError, format_table, ratio_cell, run_child, write_json
from ._measure import verify_digests
from .corpus import Corpus
from .s3loop import fetch_stats

BUCKET = "bench-remote"
SYSTEMS = ("ours_shuffle", "ours_shuffle_batched", "ours_block_local", "upstream_s3", "parquet_msc",
           "parquet_arrow")
BATCH = 32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packs", type=int, default=5000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--block-size", default="1M", help="bytes of .bin per ranged GET (ours and upstream)")
    p.add_argument("--cache-blocks", type=int, default=8, help="our in-memory blocks per data file")
    p.add_argument("--window", type=int, default=8, help="blocks per window of the block-local order")
    p.add_argument("--reads", type=int, default=0, help="packs read per system (0: every pack)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="cap of each read pass")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


# --------------------------------------------------------------------------- the children


def _touching(system: str):
    from .peers import ours, parquet, upstream

    return {"upstream_s3": upstream, "parquet_msc": parquet, "parquet_arrow": parquet}.get(system, ours)


def _open(system: str, url: str, parquet_key: str, endpoint: str, cache_dir: str, block_size: int,
          cache_blocks: int):
    if system.startswith("ours"):
        from megatron_sft_idx.storage import RemoteIndexedDataset, StorageConfig

        config = StorageConfig.resolve(cache_dir=cache_dir, block_size=block_size, cache_blocks=cache_blocks)
        return RemoteIndexedDataset(url, config=config)
    if system == "upstream_s3":
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

        return IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(
            path_to_idx_cache=cache_dir, bin_chunk_nbytes=block_size))
    if system == "parquet_msc":
        import multistorageclient as msc

        return RemoteParquet(lambda: msc.open(f"msc://bench/{parquet_key}", "rb"))
    from pyarrow import fs

    s3 = fs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                         endpoint_override=endpoint.split("://", 1)[1], scheme="http")
    return RemoteParquet(lambda: s3.open_input_file(f"{BUCKET}/{parquet_key}"))


class RemoteParquet:
    """Bridge's packed-Parquet reader (bisect over row groups, one cached row group,
    ``.as_py()`` per row), over a file handle: Bridge's own MSC path, or pyarrow's S3."""

    def __init__(self, opener) -> None:
        import pyarrow.parquet as pq

        self._handle = opener()
        if hasattr(self._handle, "seekable") and not self._handle.seekable():  # Bridge's fallback
            import pyarrow as pa

            self._handle = pa.BufferReader(self._handle.read())
        self._pf = pq.ParquetFile(self._handle)
        meta = self._pf.metadata
        self._offsets = [0]
        for i in range(meta.num_row_groups):
            self._offsets.append(self._offsets[-1] + meta.row_group(i).num_rows)
        self._cached_id, self._table = None, None

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, idx: int) -> dict:
        import bisect

        group = bisect.bisect_right(self._offsets, idx) - 1
        row = idx - self._offsets[group]
        if self._cached_id != group:
            self._table = self._pf.read_row_group(group, columns=["input_ids", "seq_start_id", "loss_mask"])
            self._cached_id = group
        ids = self._table.column("input_ids")[row].as_py()
        starts = self._table.column("seq_start_id")[row].as_py()
        return {"input_ids": ids, "seq_boundaries": starts + [len(ids)],
                "loss_mask": self._table.column("loss_mask")[row].as_py()}


def read_task(system: str, url: str, parquet_key: str, endpoint: str, work: str, order_path: str,
              block_size: int, cache_blocks: int, max_seconds: float, digests_out: str) -> dict:
    """One reader in a fresh process: open (timed), read ``order`` (timed, capped), digests."""
    mod = _touching(system)
    order = np.load(order_path)
    cache_dir = tempfile.mkdtemp(prefix="idx-cache-", dir=work)
    fetch_stats(endpoint, clear=True)
    t0 = time.perf_counter()
    ds = _open(system, url, parquet_key, endpoint, cache_dir, block_size, cache_blocks)
    open_s = time.perf_counter() - t0
    out = np.zeros((order.size, 4), dtype=np.int64)
    t0 = time.perf_counter()
    k = 0
    if system == "ours_shuffle_batched":
        while k < order.size and time.perf_counter() - t0 < max_seconds:
            batch = order[k:k + BATCH]
            for j, pack in enumerate(ds.get_many(batch)):
                out[k + j] = mod.touch(pack)
            k += batch.size
    else:
        for i in order.tolist():
            out[k] = mod.touch(ds[i])
            k += 1
            if not k & 7 and time.perf_counter() - t0 > max_seconds:
                break
    read_s = time.perf_counter() - t0
    requests = fetch_stats(endpoint)["requests"]
    gets = [r for r in requests if r[0] == "GET"]
    np.savez(digests_out, index=order[:k], digest=out[:k], columns=np.array(mod.TOUCHES))
    result = {"system": system, "open_s": open_s, "reads": k, "packs_per_s": k / read_s if read_s else None,
              "gets": len(gets), "gets_per_pack": len(gets) / k if k else None,
              "mib_per_pack": sum(r[3] for r in gets) / MIB / k if k else None}
    if system.startswith("ours"):
        stats = ds.block_stats().get(".bin", {})
        total = stats.get("hits", 0) + stats.get("misses", 0)
        result["hit_rate"] = stats["hits"] / total if total else None
    return result


# --------------------------------------------------------------------------- order statistics


def order_statistics(order: np.ndarray, pointers: np.ndarray, lengths: np.ndarray, longest: np.ndarray,
                     block_size: int, cache_blocks: int) -> Dict[str, float]:
    """How an epoch's order looks to training and to the block cache."""
    n = order.size
    blocks = pointers[order] // block_size
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    batches = blocks[: n - n % BATCH].reshape(-1, BATCH)
    lens = lengths[order].astype(np.float64)
    batch_means = lens[: n - n % BATCH].reshape(-1, BATCH).mean(axis=1)
    return {
        "block_fetches_per_epoch": _lru_misses(blocks, cache_blocks),
        "distinct_blocks": int(np.unique(blocks).size),
        "mean_abs_step_over_n": float(np.abs(np.diff(order)).mean() / n),
        "distinct_blocks_per_batch": float(np.mean([np.unique(b).size for b in batches])),
        "lag1_corr_packed_len": float(np.corrcoef(lens[:-1], lens[1:])[0, 1]),
        "lag1_corr_longest_seq": float(np.corrcoef(longest[order][:-1], longest[order][1:])[0, 1]),
        "corr_epoch_position_vs_storage": float(np.corrcoef(pos, np.arange(n))[0, 1]),
        "batch_mean_len_std_over_iid": float(batch_means.std() / (lens.std() / np.sqrt(BATCH))),
    }


def _lru_misses(blocks: np.ndarray, capacity: int) -> int:
    from collections import OrderedDict

    cache: "OrderedDict[int, None]" = OrderedDict()
    misses = 0
    for b in blocks.tolist():  # a simulation over one epoch: bench code, not a hot path
        if b in cache:
            cache.move_to_end(b)
            continue
        misses += 1
        cache[b] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


# --------------------------------------------------------------------------- setup


def _start_server() -> tuple:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "bench.s3loop"], cwd=str(ROOT), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise ChildError("the S3 server did not start (is moto[server] installed?)")
    return proc, json.loads(line)


def _prepare(args, work: Path, endpoint: str) -> tuple:
    """Corpus, our shard and the Parquet file written locally, then uploaded."""
    import boto3

    from megatron_sft_idx.storage import upload_shard

    from .peers import ours, parquet

    corpus = Corpus.generate(work / "corpus", args.packs, args.pack_size, args.vocab_size, args.seed)
    for mod, sub in ((ours, "ours"), (parquet, "parquet")):
        (work / sub).mkdir(exist_ok=True)
        mod.write(corpus, work / sub)
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    upload_shard(str(work / "ours" / "shard"), f"s3://{BUCKET}/ours/shard")
    client.upload_file(str(work / "parquet" / "packed.idx.parquet"), BUCKET, "parquet/packed.idx.parquet")
    msc_config = work / "msc.json"
    msc_config.write_text(json.dumps({"profiles": {"bench": {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                       "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials", "options": {"access_key": "testing",
                                                                      "secret_key": "testing"}}}}}))
    os.environ["MSC_CONFIG"] = str(msc_config)
    return corpus


def _orders(args, work: Path, block_size: int) -> tuple:
    """One epoch in each order (for the statistics) and the files the readers follow
    (cut to ``--reads``)."""
    from megatron_sft_idx import MMapIndexedDataset
    from megatron_sft_idx.locality import BlockLocalOrder

    local = MMapIndexedDataset(str(work / "ours" / "shard"))
    n = len(local)
    epochs = {"shuffle": np.random.RandomState(args.seed).permutation(n),
              "block_local": BlockLocalOrder(args.window, block_size)(local, np.arange(n),
                                                                     np.random.RandomState(args.seed))}
    paths = {}
    for name, order in epochs.items():
        paths[name] = work / f"order_{name}.npy"
        np.save(paths[name], order[: args.reads] if args.reads else order)
    return paths, epochs


def _longest_sequence(local) -> np.ndarray:
    """The longest sequence of every pack (vectorised over the whole shard)."""
    a = local.arrays()
    starts, offsets = a.seq_starts.astype(np.int64), a.seq_offsets
    ends = np.append(starts[1:], 0)
    ends[offsets[1:] - 1] = a.sequence_lengths  # a pack's last sequence ends at its packed_len
    return np.maximum.reduceat(ends - starts, offsets[:-1])


# --------------------------------------------------------------------------- run


def run_systems(args, systems: List[str], work: Path, corpus: Corpus, endpoint: str, block_size: int,
                orders: Dict[str, Path]) -> Dict[str, dict]:
    digests = corpus.digests()
    rows = {}
    for system in systems:
        print(f"[bench.remote] {system} ...", file=sys.stderr, flush=True)
        order = orders["block_local" if system == "ours_block_local" else "shuffle"]
        dig = work / f"digests_{system}.npz"
        row = run_child("bench.remote:read_task", timeout=1800, system=system, url=f"s3://{BUCKET}/ours/shard",
                        parquet_key="parquet/packed.idx.parquet", endpoint=endpoint, work=str(work),
                        order_path=str(order), block_size=block_size, cache_blocks=args.cache_blocks,
                        max_seconds=args.max_seconds, digests_out=str(dig))
        check = verify_digests(digests, str(dig))
        row["verified"] = check["mismatches"] == 0 and check["checked"] > 0
        rows[system] = row
    return rows


def report(rows: Dict[str, dict], stats: Dict[str, dict]) -> str:
    header = ["reader", "open (s)", "random packs/s", "GETs/pack", "MiB/pack", "block hit rate", "verified"]
    table = [[s, r["open_s"], r["packs_per_s"], r["gets_per_pack"], r["mib_per_pack"], r.get("hit_rate"),
              r["verified"]] for s, r in rows.items()]
    out = ["Reads from S3 on loopback (moto), fresh process each", format_table(header, table), ""]
    ours = rows.get("ours_shuffle")
    if ours:
        peers = [p for p in rows if not p.startswith("ours")]
        lines = [["random packs/s (full shuffle)"] + [ratio_cell(ours["packs_per_s"], rows[p]["packs_per_s"], True)
                                                    for p in peers],
                 ["GETs per pack"] + [ratio_cell(ours["gets_per_pack"], rows[p]["gets_per_pack"], False) for p in peers],
                 ["open time"] + [ratio_cell(ours["open_s"], rows[p]["open_s"], False) for p in peers]]
        out += ["ours_shuffle ÷ peer", format_table(["metric"] + peers, lines), ""]
    if "ours_block_local" in rows and ours:
        bl = rows["ours_block_local"]
        out += [f"block-local ÷ full shuffle: packs/s {ratio_cell(bl['packs_per_s'], ours['packs_per_s'], True)}, "
                f"GETs/pack {ratio_cell(bl['gets_per_pack'], ours['gets_per_pack'], False)}", ""]
    keys = list(next(iter(stats.values())))
    out += ["Order statistics over one epoch (same shard)",
            format_table(["statistic"] + list(stats), [[k] + [stats[o][k] for o in stats] for k in keys])]
    return "\n".join(out)


def main(argv=None) -> int:
    from megatron_sft_idx.storage.config import parse_size

    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or args.packs <= 0:
        print(f"error: unknown systems {unknown} (choose from {SYSTEMS}) or --packs <= 0", file=sys.stderr)
        return 2
    block_size = parse_size(args.block_size)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msi_bench_remote_"))
    work.mkdir(parents=True, exist_ok=True)
    server, ends = _start_server()
    saved = dict(os.environ)
    os.environ.update({"AWS_ENDPOINT_URL": ends["endpoint"], "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1"})
    try:
        corpus = _prepare(args, work, ends["endpoint"])
        orders, epochs = _orders(args, work, block_size)
        rows = run_systems(args, systems, work, corpus, ends["endpoint"], block_size, orders)
        stats = _statistics(args, work, block_size, epochs)
    except ChildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        os.environ.clear()
        os.environ.update(saved)
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    payload = {"params": {k: v for k, v in vars(args).items() if k not in ("work_dir", "results_dir")},
               "block_size_bytes": block_size, "readers": rows, "order_statistics": stats}
    path = write_json("remote", payload, Path(args.results_dir))
    print(report(rows, stats))
    print(f"\nJSON: {path}")
    bad = [s for s, r in rows.items() if not r["verified"]]
    if bad:
        print(f"error: data read back differs from the corpus for {bad}", file=sys.stderr)
        return 1
    return 0


def _statistics(args, work: Path, block_size: int, epochs: Dict[str, np.ndarray]) -> Dict[str, dict]:
    from megatron_sft_idx import MMapIndexedDataset

    local = MMapIndexedDataset(str(work / "ours" / "shard"))
    pointers, lengths = np.asarray(local.sequence_pointers), np.asarray(local.sequence_lengths)
    longest = _longest_sequence(local)
    return {name: order_statistics(order, pointers, lengths, longest, block_size, args.cache_blocks)
            for name, order in epochs.items()}


if __name__ == "__main__":
    sys.exit(main())
