"""Collate speed: our vectorised Bridge packed collate vs a list-based one.

The peer, :func:`reference_collate`, follows Megatron-Bridge's
``GPTSFTPackedDataset.collate_fn`` step by step with Python lists (per-sequence
slicing and concatenation, per-sequence ``range`` for positions, per-row list
padding), which is how Bridge builds its batch. It is also the oracle the tests
compare :class:`PackedCollator` with.

    python -m bench.collate --packs 512 --pack-size 4096 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import List, Optional

import numpy as np
import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "collate.json")


def reference_collate(batch, max_seq_length: int, *, pad_id: int = 0, pad_to_max_length: bool = False,
                      pad_seq_length_to_mult: int = 16, pad_seq_to_mult: int = 1,
                      pad_cu_seqlens: bool = False, summary=None) -> dict:
    """Bridge's packed batch built the straightforward way, with Python lists."""
    inputs, labels, losses, positions = [], [], [], []
    for item in batch:
        ids, bnd, loss = list(item["input_ids"]), list(item["seq_boundaries"]), list(item["loss_mask"])
        row_in, row_lab, row_loss, row_pos = [], [], [], []
        for k in range(len(bnd) - 1):
            lo, hi = int(bnd[k]), int(bnd[k + 1])
            row_in += ids[lo:hi - 1]
            row_lab += ids[lo + 1:hi]
            row_loss += loss[lo:hi - 1]
            row_pos += list(range(hi - lo - 1))
        inputs.append(row_in)
        labels.append(row_lab)
        losses.append(row_loss)
        positions.append(row_pos)
    token_count = [len(r) for r in inputs]
    if pad_to_max_length:
        max_length = max_seq_length
    else:
        longest = max(token_count)
        if pad_seq_length_to_mult > 1:
            longest = -(-longest // pad_seq_length_to_mult) * pad_seq_length_to_mult
        max_length = min(max_seq_length, longest)
    logical_rows, padded_rows, padding_masks = [], [], []
    for b, item in enumerate(batch):
        bnd = [int(x) for x in item["seq_boundaries"]]
        seg = [bnd[k + 1] - bnd[k] - 1 for k in range(len(bnd) - 1)]
        phys = [0]
        for s in seg:
            phys.append(phys[-1] + s)
        if pad_seq_to_mult > 1:
            logical = [0]
            for k, s in enumerate(seg):
                start = phys[k]
                n = s
                while n > 0 and inputs[b][start + n - 1] == pad_id and not losses[b][start + n - 1]:
                    n -= 1
                logical.append(logical[-1] + n)
            if phys[-1] != max_length:
                phys.append(max_length)
            if len(phys) > len(logical):
                logical.append(logical[-1])
            mask = [True] * max_length
            for k in range(len(logical) - 1):
                for t in range(phys[k], phys[k] + logical[k + 1] - logical[k]):
                    mask[t] = False
        else:
            logical = phys[:]
            if logical[-1] != max_length:
                logical.append(max_length)
            mask = [False] * token_count[b] + [True] * (max_length - token_count[b])
            phys = None
        if pad_cu_seqlens:
            target = summary.max_samples_per_bin + 2
            if phys is not None:
                fill = target - len(phys)
                phys += [max_length] * fill
                logical += [logical[-1]] * fill
            else:
                logical += [max_length] * (target - len(logical))
        logical_rows.append(logical)
        if phys is not None:
            padded_rows.append(phys)
        padding_masks.append(mask)
    width = max(len(r) for r in logical_rows + padded_rows)
    for r in logical_rows + padded_rows:
        r += [r[-1]] * (width - len(r))

    def pad(rows, value):
        return [r + [value] * (max_length - len(r)) for r in rows]

    out = {
        "tokens": torch.LongTensor(pad(inputs, pad_id)),
        "labels": torch.LongTensor(pad(labels, pad_id)),
        "loss_mask": torch.LongTensor(pad(losses, 0)),
        "position_ids": torch.LongTensor(pad(positions, 0)),
        "token_count": token_count,
        "padding_mask": torch.BoolTensor(padding_masks),
        "pad_between_seqs": bool(padded_rows) and any(a != b for a, b in zip(logical_rows, padded_rows)),
        "attention_mask": None,
        "cu_seqlens_q": torch.IntTensor(logical_rows),
    }
    out["cu_seqlens_kv"] = out["cu_seqlens_q"]
    ref = torch.IntTensor(padded_rows) if padded_rows else out["cu_seqlens_q"]
    if padded_rows:
        out["cu_seqlens_q_padded"] = out["cu_seqlens_kv_padded"] = ref
    if pad_cu_seqlens:
        bridge_min_packed = max(summary.min_packed_seqlen - summary.max_samples_per_bin, 0)
        value = max(summary.dataset_max_seqlen - 1, max_length - bridge_min_packed)
        out["max_seqlen_q"] = torch.IntTensor([value] * len(batch))
    else:
        out["max_seqlen_q"] = (ref[:, 1:] - ref[:, :-1]).max(dim=1, keepdim=True).values
    out["max_seqlen_kv"] = out["max_seqlen_q"]
    return out


def _time(fn, repeat: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.collate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packs", type=int, default=256, help="packs in the test shard")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--max-seqs", type=int, default=32, help="max sequences per pack")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--pad-seq-to-mult", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=RESULTS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from shardgen import random_packs, write_shard

    from megatron_sft_idx.training.bridge import PackedSFTDataset

    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "bench")
        write_shard(prefix, random_packs(rng, args.packs, pack_size=args.pack_size,
                                         max_seqs=args.max_seqs, pad_mult=args.pad_seq_to_mult,
                                         full=False), pack_size=args.pack_size,
                    metadata={"pad_seq_to_mult": args.pad_seq_to_mult})
        ds = PackedSFTDataset(prefix, pad_to_max_length=True, pad_cu_seqlens=True)
        for bs in args.batch_size:
            batches = [[ds[int(i)] for i in rng.integers(0, len(ds), bs)] for _ in range(16)]

            def ours():
                for b in batches:
                    ds.collate_fn(b)

            def peer():
                for b in batches:
                    reference_collate(b, ds.max_seq_length, pad_to_max_length=True,
                                      pad_seq_to_mult=args.pad_seq_to_mult, pad_cu_seqlens=True,
                                      summary=ds.summary)

            t_ours = _time(ours, args.repeat) / len(batches)
            t_peer = _time(peer, args.repeat) / len(batches)
            rows.append({"batch_size": bs, "pack_size": args.pack_size, "max_seqs": args.max_seqs,
                         "pad_seq_to_mult": args.pad_seq_to_mult, "ours_ms": t_ours * 1e3,
                         "list_based_ms": t_peer * 1e3, "speedup": t_peer / t_ours})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "collate", "results": rows}, f, indent=1)
    print(f"{'batch':>5} {'ours ms':>9} {'list ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['ours_ms']:>9.3f} {r['list_based_ms']:>9.3f} {r['speedup']:>7.1f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
