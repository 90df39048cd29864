"""Read-back: packs read through ``MMapIndexedDataset`` must equal what the raw arrays say.

This is the one place the gate loops over packs in Python, on purpose: it
exercises the reader's own per-pack path, the one training uses. Level
``standard`` reads a deterministic sample (first, last, and ``sample`` spread
at random); ``deep`` reads every pack.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShardError
from ..reader import MMapIndexedDataset
from . import content
from ._context import ShardContext

#: Mismatching packs listed per shard before the rest are only counted.
MAX_READBACK_FINDINGS = 16
#: Sampled packs read back between two releases of the resident pages: scattered packs each
#: fault in whole page-cache folios (up to MiBs each). Level deep reads every pack in order and
#: releases after each ``content.CHUNK_TOKENS`` tokens.
_SAMPLED_BETWEEN_RELEASES = 8


def sample_indices(n: int, sample: int, deep: bool) -> np.ndarray:
    if deep or n <= sample + 2:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(n)  # deterministic: the same shard is sampled the same way
    picks = rng.choice(n, size=sample, replace=False)
    return np.unique(np.concatenate(([0, n - 1], picks))).astype(np.int64)


def read_back(ctx: ShardContext, sample: int, deep: bool) -> None:
    try:
        ds = MMapIndexedDataset(ctx.prefix)
    except ShardError as exc:
        ctx.add("READER_REFUSED", f"MMapIndexedDataset refused to open it: {exc}")
        return
    except Exception as exc:  # a reader bug: report it, never crash the gate
        ctx.add("READER_CRASHED", f"MMapIndexedDataset raised {exc.__class__.__name__}: {exc}")
        return
    n = ctx.idx_header.sequence_count
    if len(ds) != n or ds.is_pretrain != (ctx.report.kind == "pretrain"):
        ctx.add("READBACK_MISMATCH", f"the reader sees {len(ds)} packs (pretrain={ds.is_pretrain}); the "
                f"index holds {n} ({ctx.report.kind})")
        return
    lengths, pointers = ctx.lengths(), ctx.pointers()
    itemsize = ctx.idx_header.dtype.itemsize
    tokens = ctx.tokens()
    sft = ctx.report.kind == "sft"
    if sft:
        loss, starts, offsets = ctx.loss(), ctx.seq_starts(), ctx.seq_offsets()
    bad = 0
    budget = content.CHUNK_TOKENS if deep else _SAMPLED_BETWEEN_RELEASES
    read = 0
    for i in sample_indices(n, sample, deep).tolist():
        if read >= budget:  # keep the resident pages to a chunk's worth
            ds.release_pages()
            ctx.release_all()
            read = 0
        read += int(lengths[i]) if deep else 1
        try:
            pack = ds[i]
        except ShardError as exc:
            ctx.add("READER_REFUSED", f"reading the pack failed: {exc}", pack=i)
            bad += 1
            continue
        except Exception as exc:
            ctx.add("READER_CRASHED", f"reading the pack raised {exc.__class__.__name__}: {exc}", pack=i)
            return
        t0 = int(pointers[i]) // itemsize
        t1 = t0 + int(lengths[i])
        if sft:
            want_loss, want_starts = loss[t0:t1], starts[int(offsets[i]):int(offsets[i + 1])]
        else:
            want_loss, want_starts = np.ones(t1 - t0, np.uint8), np.zeros(1, np.int32)
        for name, got, want in (("input_ids", pack.input_ids, tokens[t0:t1]),
                                ("loss_mask", pack.loss_mask, want_loss),
                                ("seq_start_id", pack.seq_start_id, want_starts)):
            if got.shape != want.shape or not np.array_equal(got, want):
                bad += 1
                if bad <= MAX_READBACK_FINDINGS:
                    ctx.add("READBACK_MISMATCH", f"{name} read through the reader differs from the raw "
                            f"arrays (shape {got.shape} vs {want.shape})", pack=i)
                break
    if ds.is_mapped:
        ds.release_pages()
    ctx.release_all()
    if bad > MAX_READBACK_FINDINGS:
        ctx.add("READBACK_MISMATCH", f"{bad} packs differ in total; the first {MAX_READBACK_FINDINGS} are listed")
