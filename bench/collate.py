"""Collate speed: our vectorised packed collate against Megatron-Bridge 0.6.2's own ``collate_fn``.

Both sides collate the same packs in one process. The packs are written once as a shard
(random sequence lengths, tokens drawn from the bundled tokenizer's vocabulary, EOS
padding at each sequence's tail when ``pad_seq_to_mult`` > 1, in Bridge's runtime layout)
and converted to Bridge's packed Parquet plus its packing-metadata JSON with
``convert-packed --to parquet --pack-metadata``. Then:

* **Bridge**: ``build_gpt_sft_split`` over the Parquet file (Bridge's
  ``GPTSFTPackedParquetDataset``, its HF tokenizer wrapper over ``examples/tokenizer``),
  items from its ``__getitem__`` (Python lists), batches by its ``collate_fn``;
* **ours**: ``PackedSFTDataset`` over the shard with the same options and the same
  metadata JSON, items from its ``__getitem__`` (read-only numpy views), batches by its
  ``collate_fn``;
* **Bridge on numpy items**: Bridge's ``collate_fn`` fed our items, to separate the cost of
  its list-based items from the cost of its collate.

Every batch is compared key for key (values, dtypes, shapes) between the three before
anything is timed; a difference stops the benchmark. The items are fetched before the
clock starts: only the collate is timed (16 batches per round, the three taking turns;
medians over ``--repeat`` rounds of the times and of the per-round ratios).

Bridge is not in the system environment: ``make install-compat`` installs it (with
megatron-core 0.19.2) into ``.deps/megatron-bridge-0.6.2``; it is imported the way
``bench.preprocess_vs_bridge`` imports it (``tests/compat/megatron_cpu.py``).

    python -m bench.collate --packs 256 --pack-size 4096 --batch-size 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

from bench._common import RESULTS_DIR, ROOT, format_table, write_json
from bench.preprocess_vs_bridge import DEPS, _import_bridge

TOKENIZER = os.path.join(str(ROOT), "examples", "tokenizer")
OPTION_SETS = {"dyn": dict(pad_to_max_length=False, pad_cu_seqlens=False),
               "max": dict(pad_to_max_length=True, pad_cu_seqlens=False),
               "max+cu": dict(pad_to_max_length=True, pad_cu_seqlens=True)}


def random_pack(rng, pack_size: int, max_seqs: int, mult: int, vocab: int, eos: int):
    """One pack in Bridge's runtime layout: each sequence's length minus one is a multiple of
    ``mult``; with ``mult`` > 1 a sequence's tail may be EOS padding (loss 0), as Bridge pads."""
    k = int(rng.integers(1, max_seqs + 1))
    units = max(1, (pack_size // k - 1) // mult)
    lengths = rng.integers(1, units + 1, k) * mult + 1
    ids = rng.integers(0, vocab - 1, int(lengths.sum()))
    ids[ids >= eos] += 1  # EOS only where padding puts it
    loss = rng.integers(0, 2, ids.size).astype(np.uint8)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if mult > 1:
        for end, pad in zip(ends, rng.integers(0, mult, k)):
            ids[end - pad:end], loss[end - pad:end] = eos, 0
    loss[ends - 1] = 0
    return ids, loss, starts


def write_packs(prefix: str, packs, pack_size: int, mult: int, vocab: int) -> None:
    from megatron_sft_idx import IndexedDatasetBuilder

    with IndexedDatasetBuilder(prefix, pack_size=pack_size, vocab_size=vocab,
                               metadata={"pad_seq_to_mult": mult, "pad_layout": "runtime"}) as builder:
        for pack in packs:
            builder.add_packed(*pack)


def same_batch(ref: dict, got: dict, where: str) -> None:
    """Raise AssertionError unless ``got`` equals ``ref`` key for key (values, dtypes, shapes)."""
    import torch

    if set(got) != set(ref):
        raise AssertionError(f"{where}: keys {sorted(got)} != Bridge's {sorted(ref)}")
    for key, want in ref.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            ok = (isinstance(have, torch.Tensor) and have.dtype == want.dtype and have.shape == want.shape
                  and torch.equal(have, want))
        else:
            ok = have == want
        if not ok:
            raise AssertionError(f"{where}: {key} differs from Bridge's\nBridge {want}\nother  {have}")


def _rounds(work: dict, repeat: int) -> dict:
    """Seconds per system in each of ``repeat`` rounds; in each round every system collates
    all batches once, in a rotating order, so a load spike on this shared machine hits one
    round rather than one system."""
    names = list(work)
    for fn in work.values():
        fn()  # warm-up
    times = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            work[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def measure(tmp: str, args, mult: int, tokenizer) -> List[dict]:
    """Every option set and batch size for one pad multiple: equal batches first, then times."""
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split

    from megatron_sft_idx.tools.convert_to_parquet import shards_to_parquet
    from megatron_sft_idx.training.bridge import PackedSFTDataset

    rng = np.random.default_rng([args.seed, mult])
    eos, vocab = tokenizer.eos_id, tokenizer.vocab_size
    packs = [random_pack(rng, args.pack_size, args.max_seqs, mult, vocab, eos) for _ in range(args.packs)]
    prefix, parquet, meta = (os.path.join(tmp, f"cp{mult}{s}") for s in ("", ".parquet", ".meta.json"))
    write_packs(prefix, packs, args.pack_size, mult, vocab)
    shards_to_parquet([prefix], parquet, pack_metadata=meta)
    rows = []
    for name, opts in OPTION_SETS.items():
        bridge = build_gpt_sft_split(parquet, tokenizer=tokenizer, seq_length=args.pack_size, memmap_workers=1,
                                     seed=1234, packed_sequence_size=args.pack_size, pack_metadata_path=meta,
                                     pad_cu_seqlens=opts["pad_cu_seqlens"], pad_seq_to_mult=mult,
                                     dataset_kwargs={"pad_to_max_length": opts["pad_to_max_length"]})
        ours = PackedSFTDataset(prefix, max_seq_length=args.pack_size, eos_id=eos, pad_seq_to_mult=mult,
                                pack_metadata_file_path=meta if opts["pad_cu_seqlens"] else None, **opts)
        for bs in args.batch_size:
            picks = [[int(i) for i in rng.integers(-len(ours), len(ours), bs)] for _ in range(16)]
            theirs_items = [[bridge[i] for i in b] for b in picks]
            ours_items = [[ours[i] for i in b] for b in picks]
            for b, (t_items, o_items) in enumerate(zip(theirs_items, ours_items)):
                ref = bridge.collate_fn(t_items)
                where = f"pad_seq_to_mult {mult}, {name}, batch size {bs}, batch {picks[b]}"
                same_batch(ref, ours.collate_fn(o_items), f"ours vs Bridge, {where}")
                same_batch(ref, bridge.collate_fn(o_items), f"Bridge on numpy items vs Bridge, {where}")
            times = _rounds({"ours": lambda: [ours.collate_fn(b) for b in ours_items],
                             "bridge": lambda: [bridge.collate_fn(b) for b in theirs_items],
                             "bridge_numpy_items": lambda: [bridge.collate_fn(b) for b in ours_items]}, args.repeat)
            ms = {k: statistics.median(v) / len(picks) * 1e3 for k, v in times.items()}
            ratio = {k: statistics.median(t / o for t, o in zip(times[k], times["ours"]))
                     for k in ("bridge", "bridge_numpy_items")}
            rows.append({"pad_seq_to_mult": mult, "options": name, "batch_size": bs, "ours_ms": ms["ours"],
                         "bridge_ms": ms["bridge"], "bridge_numpy_items_ms": ms["bridge_numpy_items"],
                         "speedup": ratio["bridge"], "speedup_vs_numpy_items": ratio["bridge_numpy_items"],
                         "batches_equal": 16})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.collate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packs", type=int, default=256, help="packs written (default 256)")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--max-seqs", type=int, default=16, help="max sequences per pack (default 16)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--pad-seq-to-mult", type=int, nargs="+", default=[1, 4],
                   help="pad multiples (context parallelism) to measure (default 1 4)")
    p.add_argument("--repeat", type=int, default=9, help="timed rounds; medians are reported (default 9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bridge-deps", default=DEPS, help=f"Bridge --target install (default: {DEPS})")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(os.path.join(args.bridge_deps, "megatron", "bridge")):
        print(f"Megatron-Bridge is not installed under {args.bridge_deps}: run `make install-compat`",
              file=sys.stderr)
        return 2
    _import_bridge(args.bridge_deps)
    import logging

    logging.disable(logging.WARNING)  # Bridge logs every dataset it builds
    from megatron.bridge import package_info
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=TOKENIZER))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_collate_") as tmp:
        for mult in args.pad_seq_to_mult:
            rows += measure(tmp, args, mult, tokenizer)
    print(format_table(
        ["pad mult", "options", "batch", "ours ms", "Bridge ms", "Bridge on numpy items ms", "Bridge ÷ ours",
         "Bridge(numpy) ÷ ours"],
        [[r["pad_seq_to_mult"], r["options"], r["batch_size"], f"{r['ours_ms']:.3f}", f"{r['bridge_ms']:.3f}",
          f"{r['bridge_numpy_items_ms']:.3f}", f"{r['speedup']:.1f}×", f"{r['speedup_vs_numpy_items']:.1f}×"]
         for r in rows]))
    print("every batch was identical, key for key, between ours and Bridge's collate before timing")
    path = write_json("collate", {"benchmark": "collate", "peer": f"megatron-bridge {package_info.__version__} "
                                  "GPTSFTPackedParquetDataset.collate_fn", "params": vars(args), "results": rows},
                      Path(args.results_dir))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
