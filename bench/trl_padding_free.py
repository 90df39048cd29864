"""Padding-free batches per second: our shard adapter against TRL's own packing path.

The same sequences (random lengths and tokens, a random label-aligned loss mask) go both ways:

* **TRL**: a ``datasets.Dataset`` of one row per sequence (``input_ids``, ``labels`` -100 where
  the mask does not train), packed by TRL 1.16's ``pack_dataset(..., strategy="bfd")`` (what
  ``SFTTrainer(packing=True)`` runs), rows fetched as its trainer's loader does
  (``Dataset.__getitems__``: Arrow to Python lists), batches by TRL's
  ``DataCollatorForLanguageModeling(padding_free=True)``;
* **ours**: a shard written from the same sequences (first-fit-decreasing into packs of the
  same size), rows from :class:`~megatron_sft_idx.training.hf.PaddingFreeDataset` (numpy views),
  batches by :class:`~megatron_sft_idx.training.hf.PaddingFreeCollator`;
* **TRL's collator on our rows**: to separate the cost of the rows from that of the collate.

Before timing: both sides hold the same tokens (counts and the multiset of trained labels), and
our collator's batch equals TRL's collator's on our rows, key for key. Then each side runs one
pass over all its packs in a seeded shuffled order, per batch size; medians over ``--repeat``
rounds. The one-time preparation (TRL's ``pack_dataset``; our shard write) is reported apart.

    python -m bench.trl_padding_free --sequences 20000 --pack-size 4096 --batch-size 1 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

from bench._common import RESULTS_DIR, format_table, write_json


def make_sequences(count: int, max_len: int, vocab: int, seed: int):
    """``count`` sequences: (ids int64, label-aligned loss uint8 with 0 on the last position)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, max_len + 1, count)
    out = []
    for n in lengths:
        ids = rng.integers(0, vocab, int(n)).astype(np.int64)
        loss = (rng.random(int(n)) < 0.6).astype(np.uint8)
        loss[-1] = 0
        out.append((ids, loss))
    return out


def write_shard(seqs, pack_size: int, prefix: str) -> float:
    from megatron_sft_idx import IndexedDatasetBuilder
    from megatron_sft_idx.packing import pack_lengths

    start = time.perf_counter()
    lengths = np.array([s[0].shape[0] for s in seqs])
    plan = pack_lengths(lengths, pack_size, "first_fit_decreasing")
    with IndexedDatasetBuilder(prefix, pack_size=pack_size, dtype=np.int32) as b:
        for k in range(plan.offsets.shape[0] - 1):
            members = plan.items[plan.offsets[k]:plan.offsets[k + 1]]
            ids = np.concatenate([seqs[i][0] for i in members])
            loss = np.concatenate([seqs[i][1] for i in members])
            starts = np.concatenate(([0], np.cumsum([seqs[i][0].shape[0] for i in members])[:-1]))
            b.add_packed(ids, loss, starts)
    return time.perf_counter() - start


def trl_packed(seqs, pack_size: int):
    import datasets
    from trl.data_utils import pack_dataset

    from megatron_sft_idx.training.hf import pack_labels

    rows = {"input_ids": [s[0].tolist() for s in seqs],
            "labels": [pack_labels(s[0], s[1], np.array([0, s[0].shape[0]])).tolist() for s in seqs]}
    ds = datasets.Dataset.from_dict(rows)
    start = time.perf_counter()
    packed = pack_dataset(ds, pack_size, strategy="bfd")
    return packed, time.perf_counter() - start


def _batches(n: int, size: int, seed: int) -> List[List[int]]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i:i + size].tolist() for i in range(0, n, size)]


def _pass(fetch, collate, batches) -> float:
    start = time.perf_counter()
    for idx in batches:
        collate(fetch(idx))
    return time.perf_counter() - start


def run(sequences: int, pack_size: int, batch_sizes, repeat: int, seed: int, workdir: str) -> dict:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from megatron_sft_idx.training.hf import PaddingFreeCollator, PaddingFreeDataset

    seqs = make_sequences(sequences, max(16, pack_size // 4), 32000, seed)
    write_s = write_shard(seqs, pack_size, str(Path(workdir) / "s"))
    theirs, pack_s = trl_packed(seqs, pack_size)
    ours = PaddingFreeDataset(str(Path(workdir) / "s"))
    trl_collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    our_collate = PaddingFreeCollator(0)
    total_ours = sum(int(ours.source[i].input_ids.shape[0]) for i in range(len(ours)))
    total_theirs = sum(sum(r) for r in theirs["seq_lengths"])
    if total_ours != total_theirs or total_ours != sum(s[0].shape[0] for s in seqs):
        raise SystemExit(f"token counts differ: ours {total_ours}, TRL {total_theirs}")
    first = [ours[i] for i in range(min(4, len(ours)))]
    a, b = our_collate(first), trl_collate(first)
    if set(a) != set(b) or any(getattr(a[k], "tolist", lambda: a[k])() != getattr(b[k], "tolist", lambda: b[k])()
                               for k in a):
        raise SystemExit("our collator's batch differs from TRL's on the same rows")
    fetch_theirs = (theirs.__getitems__ if hasattr(theirs, "__getitems__") else lambda idx: [theirs[i] for i in idx])
    rows = []
    for size in batch_sizes:
        times = {"trl": [], "ours": [], "trl_collate_our_rows": []}
        for r in range(repeat):
            tb, ob = _batches(len(theirs), size, seed + r), _batches(len(ours), size, seed + r)
            times["trl"].append((len(tb), _pass(fetch_theirs, trl_collate, tb)))
            times["ours"].append((len(ob), _pass(lambda idx: [ours[i] for i in idx], our_collate, ob)))
            times["trl_collate_our_rows"].append((len(ob), _pass(lambda idx: [ours[i] for i in idx],
                                                                 trl_collate, ob)))
        rate = {k: statistics.median(n / t for n, t in v) for k, v in times.items()}
        rows.append({"batch_size": size, "batches_per_s": {k: round(v, 1) for k, v in rate.items()},
                     "tokens_per_s": {k: round(v * total_ours / max(1, len(ours)) * size, 0)
                                      for k, v in rate.items()},
                     "ours_vs_trl": round(rate["ours"] / rate["trl"], 2)})
    return {"sequences": sequences, "pack_size": pack_size, "tokens": total_ours,
            "packs": {"ours": len(ours), "trl": len(theirs)},
            "prepare_s": {"ours_shard_write": round(write_s, 3), "trl_pack_dataset": round(pack_s, 3)},
            "repeat": repeat, "rows": rows}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=20000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as work:
        result = run(args.sequences, args.pack_size, args.batch_size, args.repeat, args.seed, work)
    write_json("trl_padding_free", result, Path(args.results_dir))
    print(format_table(["batch size", "TRL batches/s", "ours batches/s", "TRL collate, our rows", "ours / TRL"],
                       [[r["batch_size"], r["batches_per_s"]["trl"], r["batches_per_s"]["ours"],
                         r["batches_per_s"]["trl_collate_our_rows"], r["ours_vs_trl"]] for r in result["rows"]]))
    print(f"prepare: TRL pack_dataset {result['prepare_s']['trl_pack_dataset']} s, "
          f"our shard write {result['prepare_s']['ours_shard_write']} s; {result['tokens']:,} tokens, "
          f"packs ours {result['packs']['ours']} / TRL {result['packs']['trl']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
