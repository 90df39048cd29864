"""Training reads from a bucket, side by side on one S3 server on loopback, in one run.

``python -m bench.remote --packs 5000 --pack-size 4096``

One seeded corpus is written as ``--shards`` shards of ours (with a manifest) and as
many packed-Parquet files (Bridge reads a directory of them), uploaded to moto's S3
server (its own process, behind a counting proxy: ``bench/s3loop.py``; objects kept in
memory, since moto copies a whole object per GET and so charges per object size —
a few MiB per object keeps that cost small and equal for every format), and read back
by fresh child processes, each touching every array of every pack it reads
(digests checked against the corpus, so a reader returning wrong data shows
``verified: NO``):

* ``ours_shuffle`` — ``MMapIndexedDataset("s3://...")[i]`` in a full shuffle, with
  ``--shuffle-block-size`` blocks (a random read wants small ones);
* ``ours_shuffle_batched`` — the same order, ``get_many`` 32 packs at a time (parallel GETs);
* ``ours_block_local`` — ``ds[i]`` in the block-local order (``--window`` blocks of
  ``--block-size``, the cache holding a window);
* ``upstream_s3`` — megatron-core's own S3 reader (``IndexedDataset`` with
  ``ObjectStorageConfig(bin_chunk_nbytes=--shuffle-block-size)``) on our ``.bin/.idx``,
  tokens only, full shuffle;
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

from ._common import (MIB, RESULTS_DIR, ROOT, ChildError, format_table, median_dicts, ratio_cell, run_child,
                      write_json)
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
    p.add_argument("--shards", type=int, default=8, help="shards / Parquet files the corpus is split into")
    p.add_argument("--shuffle-block-size", default="64K",
                   help="bytes per ranged GET in the full-shuffle runs (ours and megatron-core's chunk)")
    p.add_argument("--block-size", default="4M", help="bytes of .bin per block in the block-local run")
    p.add_argument("--cache-blocks", type=int, default=8,
                   help="our in-memory blocks per data file (the block-local run keeps at least --window)")
    p.add_argument("--window", type=int, default=8, help="blocks per window of the block-local order")
    p.add_argument("--reads", type=int, default=0, help="packs read per system (0: every pack)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="cap of each read pass")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per reader, in rotated order; medians are reported")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


# --------------------------------------------------------------------------- the children


def _touching(system: str):
    """The peer module whose ``touch`` reads this system's records (imported alone: the
    upstream one brings torch and megatron, which the others must not pay for in RSS)."""
    from . import peers

    return peers.load({"upstream_s3": "upstream", "parquet_msc": "parquet", "parquet_arrow": "parquet"}
                      .get(system, "ours"))


def _open(system: str, endpoint: str, shards: int, cache_dir: str, block_size: int, cache_blocks: int):
    if system.startswith("ours"):
        from megatron_sft_idx import open_packed

        os.environ.update({"MEGATRON_SFT_IDX_CACHE": cache_dir, "MEGATRON_SFT_IDX_BLOCK_SIZE": str(block_size),
                           "MEGATRON_SFT_IDX_CACHE_BLOCKS": str(cache_blocks)})
        return open_packed(f"s3://{BUCKET}/ours/all.json")
    if system == "upstream_s3":
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

        config = ObjectStorageConfig(path_to_idx_cache=cache_dir, bin_chunk_nbytes=block_size)
        return Concat([IndexedDataset(f"s3://{BUCKET}/ours/{_name(k)}", mmap=False, object_storage_config=config)
                       for k in range(shards)])
    keys = [f"parquet/{_name(k)}.idx.parquet" for k in range(shards)]
    if system == "parquet_msc":
        import multistorageclient as msc

        return RemoteParquet([lambda key=key: msc.open(f"msc://bench/{key}", "rb") for key in keys])
    from pyarrow import fs

    s3 = fs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                         endpoint_override=endpoint.split("://", 1)[1], scheme="http")
    return RemoteParquet([lambda key=key: s3.open_input_file(f"{BUCKET}/{key}") for key in keys])


def _name(k: int) -> str:
    return f"part_{k:03d}"


class Concat:
    """Upstream datasets read as one (bisect over their lengths), as our multi-shard view does."""

    def __init__(self, parts) -> None:
        self.parts = parts
        self.starts = np.concatenate(([0], np.cumsum([len(p) for p in parts])))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int):
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - int(self.starts[k])]


class RemoteParquet:
    """Bridge's ``GPTSFTPackedParquetDataset`` reading logic over file handles: metadata of
    every file at open, files reopened lazily, bisect over files then row groups, the last
    row group cached, ``.as_py()`` per row; Bridge's fallback for unseekable handles kept."""

    def __init__(self, openers) -> None:
        import pyarrow.parquet as pq

        self._openers = openers
        self._files: Dict[int, object] = {}
        self._file_offsets, self._groups = [0], []
        for opener in openers:
            meta = pq.ParquetFile(self._readable(opener())).metadata
            groups = [0]
            for i in range(meta.num_row_groups):
                groups.append(groups[-1] + meta.row_group(i).num_rows)
            self._groups.append(groups)
            self._file_offsets.append(self._file_offsets[-1] + meta.num_rows)
        self._cached, self._table = None, None

    @staticmethod
    def _readable(handle):
        if hasattr(handle, "seekable") and not handle.seekable():
            import pyarrow as pa

            return pa.BufferReader(handle.read())
        return handle

    def __len__(self) -> int:
        return self._file_offsets[-1]

    def __getitem__(self, idx: int) -> dict:
        import bisect

        import pyarrow.parquet as pq

        f = bisect.bisect_right(self._file_offsets, idx) - 1
        row_in_file = idx - self._file_offsets[f]
        group = bisect.bisect_right(self._groups[f], row_in_file) - 1
        row = row_in_file - self._groups[f][group]
        if self._cached != (f, group):
            if f not in self._files:
                self._files[f] = pq.ParquetFile(self._readable(self._openers[f]()))
            self._table = self._files[f].read_row_group(group, columns=["input_ids", "seq_start_id", "loss_mask"])
            self._cached = (f, group)
        ids = self._table.column("input_ids")[row].as_py()
        starts = self._table.column("seq_start_id")[row].as_py()
        return {"input_ids": ids, "seq_boundaries": starts + [len(ids)],
                "loss_mask": self._table.column("loss_mask")[row].as_py()}


def _preimport(system: str) -> None:
    import importlib

    names = {"upstream_s3": ["boto3", "megatron.core.datasets.indexed_dataset"],
             "parquet_msc": ["multistorageclient", "pyarrow.parquet"],
             "parquet_arrow": ["pyarrow.fs", "pyarrow.parquet"]}.get(
        system, ["boto3", "megatron_sft_idx.storage.remote", "megatron_sft_idx.multi"])
    for name in names:
        importlib.import_module(name)


def read_task(system: str, endpoint: str, shards: int, work: str, order_path: str, block_size: int,
              cache_blocks: int, max_seconds: float, digests_out: str) -> dict:
    """One reader in a fresh process: open (timed), read ``order`` (timed, capped), digests."""
    mod = _touching(system)
    _preimport(system)  # open_s is the dataset's constructor, not its imports
    order = np.load(order_path)
    cache_dir = tempfile.mkdtemp(prefix="idx-cache-", dir=work)
    fetch_stats(endpoint, clear=True)
    t0 = time.perf_counter()
    ds = _open(system, endpoint, shards, cache_dir, block_size, cache_blocks)
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
    result = {"system": system, "block_size": block_size, "open_s": open_s, "reads": k,
              "packs_per_s": k / read_s if read_s else None,
              "gets": len(gets), "gets_per_pack": len(gets) / k if k else None,
              "mib_per_pack": sum(r[3] for r in gets) / MIB / k if k else None}
    if system.startswith("ours"):
        stats = [ds.shard(k).block_stats().get(".bin", {}) for k in ds.open_shards]
        hits, misses = sum(x.get("hits", 0) for x in stats), sum(x.get("misses", 0) for x in stats)
        result["hit_rate"] = hits / (hits + misses) if hits + misses else None
    return result


# --------------------------------------------------------------------------- order statistics


def order_statistics(orders, blocks: np.ndarray, lengths: np.ndarray, longest: np.ndarray,
                     cache_blocks: int) -> Dict[str, float]:
    """How an epoch's order looks to training and to the block cache, averaged over
    ``orders`` (one epoch each, different seeds); ``blocks``: each pack's block number."""
    rows = [_one_order(o, blocks, lengths, longest, cache_blocks) for o in orders]
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _one_order(order, all_blocks, lengths, longest, cache_blocks) -> Dict[str, float]:
    n = order.size
    blocks = all_blocks[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    cut = n - n % BATCH
    lens, long_ = lengths[order].astype(np.float64), longest[order].astype(np.float64)
    batch_means = long_[:cut].reshape(-1, BATCH).mean(axis=1)
    return {
        "block_fetches_per_epoch": _lru_misses(blocks, cache_blocks),
        "distinct_blocks_per_batch": float(np.mean([np.unique(b).size for b in blocks[:cut].reshape(-1, BATCH)])),
        "mean_abs_step_over_n": float(np.abs(np.diff(order)).mean() / n),
        "lag1_corr_packed_len": float(np.corrcoef(lens[:-1], lens[1:])[0, 1]),
        "lag1_corr_longest_seq": float(np.corrcoef(long_[:-1], long_[1:])[0, 1]),
        "abs_corr_epoch_vs_storage_position": float(abs(np.corrcoef(pos, np.arange(n))[0, 1])),
        "batch_mean_longest_std_over_iid": float(batch_means.std() / (long_.std() / np.sqrt(BATCH))),
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
    # moto keeps an object in memory up to this size (else it re-reads a temp file per GET).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(256 << 20))
    proc = subprocess.Popen([sys.executable, "-m", "bench.s3loop"], cwd=str(ROOT), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise ChildError("the S3 server did not start (is moto[server] installed?)")
    return proc, json.loads(line)


def _prepare(args, work: Path, endpoint: str) -> Corpus:
    """The corpus as our shards (+ manifest) and as Parquet files, written locally, uploaded."""
    import boto3

    from megatron_sft_idx.publishing import publish

    corpus = Corpus.generate(work / "corpus", args.packs, args.pack_size, args.vocab_size, args.seed)
    edges = np.linspace(0, len(corpus), args.shards + 1).astype(int)
    ours_dir, parquet_dir = work / "ours", work / "parquet"
    ours_dir.mkdir(exist_ok=True)
    parquet_dir.mkdir(exist_ok=True)
    prefixes = []
    for k in range(args.shards):
        prefixes.append(str(ours_dir / _name(k)))
        _write_ours(corpus, prefixes[-1], int(edges[k]), int(edges[k + 1]))
        _write_parquet(corpus, parquet_dir / f"{_name(k)}.idx.parquet", int(edges[k]), int(edges[k + 1]))
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    publish(prefixes, f"s3://{BUCKET}/ours", manifest="all.json")
    for k in range(args.shards):
        client.upload_file(str(parquet_dir / f"{_name(k)}.idx.parquet"), BUCKET, f"parquet/{_name(k)}.idx.parquet")
    msc_config = work / "msc.json"
    msc_config.write_text(json.dumps({"profiles": {"bench": {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                       "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials", "options": {"access_key": "testing",
                                                                      "secret_key": "testing"}}}}}))
    os.environ["MSC_CONFIG"] = str(msc_config)
    return corpus


def _write_ours(corpus: Corpus, prefix: str, first: int, last: int) -> None:
    from megatron_sft_idx import IndexedDatasetBuilder

    with IndexedDatasetBuilder(prefix, vocab_size=corpus.vocab_size, pack_size=corpus.pack_size,
                               overwrite=True) as builder:
        for ids, loss, starts in corpus.iter_packs(first, last):
            builder.add_packed(ids, loss, starts)


def _write_parquet(corpus: Corpus, path: Path, first: int, last: int) -> None:
    """Bridge's layout (row groups of 500, default compression), as ``bench.peers.parquet`` writes it."""
    import pyarrow.parquet as pq

    from .peers import parquet

    with pq.ParquetWriter(str(path), parquet.SCHEMA) as writer:
        rows = []
        for pack in corpus.iter_packs(first, last):
            rows.append(pack)
            if len(rows) == parquet.ROW_GROUP_SIZE:
                parquet._flush(writer, rows)
                rows = []
        if rows:
            parquet._flush(writer, rows)


def _local_set(work: Path):
    from megatron_sft_idx.multi import MultiShardDataset

    return MultiShardDataset.open(str(work / "ours"))


def _orders(args, work: Path, block_size: int) -> Dict[str, Path]:
    """The orders the readers follow (one epoch each, cut to ``--reads``)."""
    from megatron_sft_idx.locality import BlockLocalOrder

    local = _local_set(work)
    n = len(local)
    epochs = {"shuffle": np.random.RandomState(args.seed).permutation(n),
              "block_local": BlockLocalOrder(args.window, block_size)(local, np.arange(n),
                                                                     np.random.RandomState(args.seed))}
    paths = {}
    for name, order in epochs.items():
        paths[name] = work / f"order_{name}.npy"
        np.save(paths[name], order[: args.reads] if args.reads else order)
    return paths


def _longest_sequence(shard) -> np.ndarray:
    """The longest sequence of every pack of one shard (vectorised)."""
    a = shard.arrays()
    starts, offsets = a.seq_starts.astype(np.int64), a.seq_offsets
    ends = np.append(starts[1:], 0)
    ends[offsets[1:] - 1] = a.sequence_lengths  # a pack's last sequence ends at its packed_len
    return np.maximum.reduceat(ends - starts, offsets[:-1])


# --------------------------------------------------------------------------- run


def run_systems(args, systems: List[str], work: Path, corpus: Corpus, endpoint: str, block_size: int,
                shuffle_block: int, orders: Dict[str, Path]) -> Dict[str, dict]:
    digests = corpus.digests()
    runs: Dict[str, List[dict]] = {s: [] for s in systems}
    for repeat in range(args.repeats):
        # Rotate so that no reader always runs first, or always beside the same neighbour's load.
        for system in systems[repeat % len(systems):] + systems[:repeat % len(systems)]:
            print(f"[bench.remote] {repeat + 1}/{args.repeats} {system} ...", file=sys.stderr, flush=True)
            local = system == "ours_block_local"
            dig = work / f"digests_{system}.npz"
            row = run_child("bench.remote:read_task", timeout=1800, system=system, endpoint=endpoint,
                            shards=args.shards, work=str(work),
                            order_path=str(orders["block_local" if local else "shuffle"]),
                            block_size=block_size if local else shuffle_block,
                            cache_blocks=max(args.cache_blocks, args.window) if local else args.cache_blocks,
                            max_seconds=args.max_seconds, digests_out=str(dig))
            check = verify_digests(digests, str(dig))
            row["verified"] = check["mismatches"] == 0 and check["checked"] > 0
            runs[system].append(row)
    return {s: median_dicts(r) for s, r in runs.items()}


def report(rows: Dict[str, dict], stats: Dict[str, dict]) -> str:
    header = ["reader", "block", "open (s)", "packs/s", "GETs/pack", "MiB/pack", "hit rate", "peak RSS MiB",
              "verified"]
    table = [[s, _size(r["block_size"]) if s.startswith(("ours", "upstream")) else "—", r["open_s"],
              r["packs_per_s"], r["gets_per_pack"], r["mib_per_pack"], r.get("hit_rate"), r.get("peak_rss_mb"),
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
    for title, part in (("Order statistics over one epoch (this shard, as stored)", stats["as_stored"]),
                        ("The same, had the shard been stored sorted by longest sequence (FFD output order)",
                         stats["sorted_storage"])):
        keys = list(next(iter(part.values())))
        out += [title, format_table(["statistic"] + list(part), [[k] + [part[o][k] for o in part] for k in keys]),
                ""]
    return "\n".join(out)


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10}K"


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
        orders = _orders(args, work, block_size)
        rows = run_systems(args, systems, work, corpus, ends["endpoint"], block_size,
                           parse_size(args.shuffle_block_size), orders)
        stats = _statistics(args, work, block_size)
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


def _statistics(args, work: Path, block_size: int) -> Dict[str, dict]:
    """Both orders over 10 seeds, on the set as stored and as if stored sorted by each pack's
    longest sequence (what a first-fit-decreasing packer emits when it does not shuffle)."""
    from megatron_sft_idx.locality import block_local_permutation, pack_blocks

    local = _local_set(work)
    shards = [local.shard(k) for k in range(local.num_shards)]
    lengths = np.concatenate([np.asarray(s.sequence_lengths) for s in shards]).astype(np.int64)
    longest = np.concatenate([_longest_sequence(s) for s in shards])
    itemsize = shards[0].dtype.itemsize
    cache = max(args.cache_blocks, args.window)
    seeds = range(args.seed, args.seed + 10)
    out = {}
    for name in ("as_stored", "sorted_storage"):
        if name == "as_stored":
            perm, blocks = np.arange(lengths.size), pack_blocks(local, block_size)
        else:  # one sorted stream of packs, cut into blocks
            perm = np.argsort(-longest, kind="stable")
            blocks = np.concatenate(([0], np.cumsum(lengths[perm])[:-1])) * itemsize // block_size
        lens, longs = lengths[perm], longest[perm]
        out[name] = {
            "shuffle": order_statistics([np.random.RandomState(s).permutation(lens.size) for s in seeds],
                                        blocks, lens, longs, cache),
            "block_local": order_statistics([block_local_permutation(blocks, args.window, np.random.RandomState(s))
                                             for s in seeds], blocks, lens, longs, cache)}
    return out


if __name__ == "__main__":
    sys.exit(main())
