"""The preprocessing pipeline: inputs -> spool -> global packing -> shards.

Memory stays flat in the dataset size except for ~22 bytes per conversation
(length, spool location, source line) and the packing arrays (~20 bytes per
sequence); tokens only ever live in one batch per worker and one chunk of
packs. Same inputs + seed give byte-identical shards whatever ``--workers``.
"""

from __future__ import annotations

import mmap
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from .._extras import require_extra
from ..builder import IndexedDatasetBuilder
from ..errors import ShardError
from ..packing import pack_lengths, pad_multiple_for, packing_summary, padded_length, truncation_length
from ..reader import MMapIndexedDataset
from . import outputs
from ._materialize import exclusive_cumsum, fill_sequences
from .chat import load_chat_tokenizer
from .inputs import expand_inputs, file_digest, iter_batches
from .spool import Batch, BatchResult, EncodeOptions, run_spool

_CHUNK_TOKENS = 1 << 22  # tokens materialized at once
# Packs gather sequences from anywhere in the spool, and the kernel maps ~64 KiB around every
# page fault (fault-around), for tokens and loss mask alike: bounding the sequences per chunk,
# and dropping the mapped pages after it, keeps the spool's share of RSS near 64 MiB however
# large the spool is.
_CHUNK_SEQUENCES = 512


@dataclass
class Config:
    """Everything the pipeline needs; the CLI fills it from its flags."""

    inputs: Sequence[str]
    output_prefix: str
    tokenizer: Optional[str] = None
    vocab_size: Optional[int] = None
    pack_size: int = 4096
    workers: int = 1
    seed: int = 1234
    algorithm: str = "first_fit_decreasing"
    loss_on: str = "assistant"
    input_format: str = "auto"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    pad_seq_to_mult: int = 1
    pad_layout: str = "stored"  # "runtime" pads for Megatron-Bridge (packing/padding.py)
    cp: int = 1
    tp: int = 1
    sp: bool = False
    pad_id: Optional[int] = None
    overlong: str = "truncate"
    skip_bad: bool = False
    overwrite: bool = False
    split: Optional[Sequence[float]] = None
    max_packs_per_shard: Optional[int] = None
    max_shard_bytes: Optional[int] = None
    batch_size: int = 256
    check: bool = False
    verify_masks: int = 0
    progress: bool = True
    tokenizer_backend: str = "auto"
    span_method: str = "auto"


@dataclass
class Spooled:
    """Per-conversation arrays, in global (input) order, and the spool shards."""

    prefixes: List[str]
    lengths: np.ndarray      # int32 tokens
    worker: np.ndarray       # int16 spool shard
    local: np.ndarray        # int32 index inside it
    file_index: np.ndarray   # int32
    line: np.ndarray         # int64
    records: int
    skipped: Dict[str, int] = field(default_factory=dict)
    first_skipped: Dict[str, str] = field(default_factory=dict)


def _progress(enabled: bool, **kw):
    require_extra("preprocess", "tqdm")
    from tqdm import tqdm

    return tqdm(disable=not enabled, dynamic_ncols=True, mininterval=0.5, **kw)


def _peak_rss_mib() -> Dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"main": round(own, 1), "workers_max": round(kids, 1)}


def resolve_pad_multiple(cfg: Config) -> int:
    """``lcm(--pad-seq-to-mult, multiple for --cp/--tp/--sp)``.

    Raises:
        ShardError: the multiple exceeds the pack size.
    """
    mult = int(np.lcm(max(1, cfg.pad_seq_to_mult), pad_multiple_for(cfg.cp, cfg.tp, cfg.sp)))
    if mult > cfg.pack_size:
        raise ShardError(f"padding multiple {mult} exceeds --pack-size {cfg.pack_size}", field="pack_size")
    return mult


def _batches(files: Sequence[str], batch_size: int, counter: list):
    batch_id = 0
    for file_index, path in enumerate(files):
        for _, records in iter_batches(path, batch_size):
            counter[0] += len(records)
            yield Batch(batch_id, file_index, path, records)
            batch_id += 1


def tokenize_to_spool(cfg: Config, files, options: EncodeOptions, spool_dir: str) -> Spooled:
    results: Dict[int, BatchResult] = {}
    counter = [0]
    bar = _progress(cfg.progress, desc="tokenize", unit="conv")

    def on_result(r: BatchResult) -> None:
        results[r.batch_id] = r
        bar.update(int(r.lengths.size) + sum(r.skipped.values()))

    try:
        prefixes = run_spool(_batches(files, cfg.batch_size, counter), options, spool_dir, cfg.workers, on_result)
    finally:
        bar.close()
    ordered = [results[k] for k in sorted(results)]
    skipped: Dict[str, int] = {}
    first: Dict[str, str] = {}
    for r in ordered:
        for k, v in r.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
        for k, v in r.first_skipped.items():
            first.setdefault(k, v)

    def cat(get, dtype):
        parts = [np.asarray(get(r), dtype=dtype) for r in ordered]
        return np.concatenate(parts) if parts else np.empty(0, dtype)

    return Spooled(
        prefixes=prefixes,
        lengths=cat(lambda r: r.lengths, np.int32),
        worker=cat(lambda r: np.full(r.lengths.size, r.worker), np.int16),
        local=cat(lambda r: r.local_start + np.arange(r.lengths.size), np.int32),
        file_index=cat(lambda r: np.full(r.lengths.size, r.file_index), np.int32),
        line=cat(lambda r: r.lines, np.int64),
        records=counter[0], skipped=skipped, first_skipped=first)


def split_conversations(n: int, weights: Optional[Sequence[float]], seed: int) -> List[np.ndarray]:
    """Global conversation indices of each split (ascending), from a seeded permutation."""
    if not weights:
        return [np.arange(n, dtype=np.int64)]
    w = np.asarray(weights, dtype=np.float64)
    bounds = np.round(np.concatenate([[0.0], np.cumsum(w / w.sum())]) * n).astype(np.int64)
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(perm[bounds[i]:bounds[i + 1]]) for i in range(len(w))]


def plan_shards(loads: np.ndarray, seq_counts: np.ndarray, itemsize: int,
                max_packs: Optional[int], max_bytes: Optional[int]) -> np.ndarray:
    """First pack of each shard plus the end (int64[S+1]); each shard holds >= 1 pack."""
    n = loads.size
    if not max_packs and not max_bytes:
        return np.array([0, n], dtype=np.int64)
    cum = exclusive_cumsum(loads * (itemsize + 1) + seq_counts * 4 + 20)
    starts = [0]
    while starts[-1] < n:
        s = starts[-1]
        end = n if not max_packs else min(n, s + max_packs)
        if max_bytes:
            end = min(end, int(np.searchsorted(cum, cum[s] + max_bytes, side="right")) - 1)
        starts.append(max(end, s + 1))
    return np.asarray(starts, dtype=np.int64)


@dataclass
class SplitPlan:
    name: str
    members: np.ndarray       # global conversation indices, ascending
    copy_len: np.ndarray      # tokens kept per member (after truncation)
    padded: np.ndarray        # padded length per member
    assignment: object
    shard_starts: np.ndarray  # first pack per shard + end
    finals: List[str]
    staged: List[str]


def materialize_shard(plan: SplitPlan, shard: int, sp: Spooled, spool: SpoolViews, pad_id: int,
                      builder_kw: dict, bar) -> dict:
    """Write packs ``shard_starts[shard]..[shard+1]`` of a split to its staged prefix."""
    a = plan.assignment
    first, last = int(plan.shard_starts[shard]), int(plan.shard_starts[shard + 1])
    with IndexedDatasetBuilder(plan.staged[shard], overwrite=True, **builder_kw) as builder:
        b0 = first
        while b0 < last:
            b1 = b0 + 1
            tokens = int(a.loads[b0])
            while (b1 < last and tokens + int(a.loads[b1]) <= _CHUNK_TOKENS
                   and int(a.offsets[b1 + 1]) - int(a.offsets[b0]) <= _CHUNK_SEQUENCES):
                tokens += int(a.loads[b1])
                b1 += 1
            _write_chunk(plan, b0, b1, tokens, sp, spool.readers, pad_id, builder)
            spool.release_pages()
            bar.update(b1 - b0)
            b0 = b1
    return builder.metadata.to_dict()


def _write_chunk(plan, b0, b1, tokens, sp, readers, pad_id, builder) -> None:
    a = plan.assignment
    s0, s1 = int(a.offsets[b0]), int(a.offsets[b1])
    pos = a.items[s0:s1]                 # positions inside the split
    conv = plan.members[pos]             # global conversation index
    dst = exclusive_cumsum(plan.padded[pos])
    out_ids = np.full(tokens, pad_id, dtype=np.int64)
    out_mask = np.zeros(tokens, dtype=np.uint8)
    for w, (ids, mask, pointers, itemsize) in enumerate(readers):
        sel = np.flatnonzero(sp.worker[conv] == w)
        if sel.size:
            src_start = pointers[sp.local[conv[sel]]] // itemsize
            fill_sequences(out_ids, out_mask, dst[sel], ids, mask, src_start,
                           plan.copy_len[pos[sel]].astype(np.int64), sp.lengths[conv[sel]].astype(np.int64))
    pack_ends = exclusive_cumsum(a.loads[b0:b1])
    for k in range(b1 - b0):
        lo, hi = int(a.offsets[b0 + k]) - s0, int(a.offsets[b0 + k + 1]) - s0
        start = pack_ends[k]
        builder.add_packed(out_ids[start:pack_ends[k + 1]], out_mask[start:pack_ends[k + 1]], dst[lo:hi] - start)


class SpoolViews(NamedTuple):
    """The spool as mmap views: per worker (tokens, loss mask, byte pointers, itemsize)."""

    readers: list
    datasets: list

    def release_pages(self) -> None:
        """Packs gather conversations from all over the spool; dropping the mapped pages after
        each chunk keeps RSS at one chunk's working set instead of the spool's size."""
        for ds in self.datasets:
            ds.release_pages()


def open_spool(prefixes: Sequence[str]) -> SpoolViews:
    readers, datasets = [], []
    for prefix in prefixes:
        if not os.path.exists(prefix + ".idx"):
            readers.append((np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.int64), 1))
            continue
        ds = MMapIndexedDataset(prefix)
        if hasattr(mmap, "MADV_RANDOM"):  # packs gather scattered sequences: map only what is read
            ds.advise(mmap.MADV_RANDOM)
        arr = ds.arrays()
        readers.append((arr.tokens, arr.loss_mask, np.asarray(ds.sequence_pointers), ds.dtype.itemsize))
        datasets.append(ds)
    return SpoolViews(readers, datasets)


def _encode_options(cfg: Config, vocab: Optional[int], mult: int) -> EncodeOptions:
    return EncodeOptions(
        tokenizer_path=cfg.tokenizer, vocab_size=vocab, loss_on=cfg.loss_on, input_format=cfg.input_format,
        prompt_key=cfg.prompt_key, completion_key=cfg.completion_key, skip_bad=cfg.skip_bad,
        pack_size=cfg.pack_size, pad_multiple=mult, overlong=cfg.overlong,
        truncate_to=truncation_length(cfg.pack_size, mult, cfg.pad_layout), pad_layout=cfg.pad_layout,
        tokenizer_backend=cfg.tokenizer_backend, span_method=cfg.span_method)


def _plan_split(cfg, name, members, sp, mult, itemsize, final_base, work) -> SplitPlan:
    trunc = truncation_length(cfg.pack_size, mult, cfg.pad_layout)
    copy_len = np.minimum(sp.lengths[members].astype(np.int64), trunc)
    padded = padded_length(copy_len, mult, cfg.pad_layout)
    assignment = pack_lengths(padded, cfg.pack_size, cfg.algorithm, cfg.seed)
    starts = plan_shards(assignment.loads, np.diff(assignment.offsets), itemsize,
                         cfg.max_packs_per_shard, cfg.max_shard_bytes)
    numbered = bool(cfg.max_packs_per_shard or cfg.max_shard_bytes)
    finals = [outputs.shard_prefix(final_base, i, numbered) for i in range(starts.size - 1)]
    return SplitPlan(name, members, copy_len, padded, assignment, starts, finals,
                     [outputs.staged_prefix(work, f) for f in finals])


def _metadata(cfg, tok_identity, mult, input_info, split, shard, shard_count) -> dict:
    meta = {
        "pad_seq_to_mult": mult,
        "pad_layout": cfg.pad_layout,
        "tokenizer": tok_identity,
        "packing": {"algorithm": cfg.algorithm, "seed": cfg.seed, "pack_size": cfg.pack_size,
                    "overlong": cfg.overlong},
        "parallelism": {"cp": cfg.cp, "tp": cfg.tp, "sp": bool(cfg.sp)},
        "source": {"inputs": input_info, "input_format": cfg.input_format},
        "extra": {"loss_on": cfg.loss_on, "split": split, "shard_index": shard, "shard_count": shard_count},
    }
    if tok_identity is None:  # pre-tokenized input without a tokenizer
        del meta["tokenizer"]
    return meta


def run(cfg: Config) -> dict:
    """Run the whole pipeline; returns the summary (also what ``--summary-json`` writes).

    Raises:
        ShardError: bad arguments, bad input (InputError, naming file:line),
            an existing output without ``overwrite``, a failed check.
    """
    times: Dict[str, float] = {}
    t = time.perf_counter()
    files = expand_inputs(cfg.inputs)
    tok = load_chat_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    vocab = cfg.vocab_size or (tok.vocab_size if tok else None)
    pad_id = cfg.pad_id if cfg.pad_id is not None else (tok.pad_id if tok else None)
    if pad_id is None or pad_id < 0 or (vocab is not None and pad_id >= vocab):
        raise ShardError("no usable pad id", field="pad_id", actual=pad_id,
                         hint="pass --pad-id in [0, vocab size) (the tokenizer has no pad or EOS token)")
    mult = resolve_pad_multiple(cfg)
    split_names = outputs.SPLIT_NAMES[:len(cfg.split)] if cfg.split else ("all",)
    bases = [outputs.split_prefix(cfg.output_prefix, s, bool(cfg.split)) for s in split_names]
    replaced = outputs.refuse_existing(bases, cfg.overwrite)
    input_info = [{"name": p, "sha256": file_digest(p), "bytes": os.path.getsize(p)} for p in files]
    tok_identity = None
    if tok:
        tok_identity = {k: v for k, v in tok.identity().items() if k != "path"}
    times["inputs"] = time.perf_counter() - t
    work = outputs.make_work_dir(cfg.output_prefix)
    try:
        return _run_in(cfg, work, files, tok, tok_identity, vocab, pad_id, mult, split_names, bases,
                       replaced, input_info, times)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(cfg, work, files, tok, tok_identity, vocab, pad_id, mult, split_names, bases, replaced,
            input_info, times) -> dict:
    t = time.perf_counter()
    sp = tokenize_to_spool(cfg, files, _encode_options(cfg, vocab, mult), os.path.join(work, "spool"))
    times["tokenize"] = time.perf_counter() - t
    if sp.lengths.size == 0:
        raise ShardError("no conversation survived preprocessing; nothing to write", path=cfg.output_prefix,
                         hint=f"skipped: {sp.skipped}")
    t = time.perf_counter()
    itemsize = 2 if (vocab or 0) and vocab <= 65536 else 4
    plans, empty = [], []
    for name, members, base in zip(split_names, split_conversations(sp.lengths.size, cfg.split, cfg.seed), bases):
        if members.size:
            plans.append(_plan_split(cfg, name, members, sp, mult, itemsize, base, work))
        else:  # e.g. a 1% split of a tiny dataset: reported, not written
            empty.append(name)
    times["pack"] = time.perf_counter() - t
    t = time.perf_counter()
    spool = open_spool(sp.prefixes)
    shard_meta = {}
    total_packs = sum(p.assignment.n_bins for p in plans)
    with _progress(cfg.progress, desc="write", unit="pack", total=total_packs) as bar:
        for plan in plans:
            count = len(plan.finals)
            for i in range(count):
                kw = dict(vocab_size=vocab, pack_size=cfg.pack_size,
                          metadata=_metadata(cfg, tok_identity, mult, input_info, plan.name, i, count))
                shard_meta[plan.finals[i]] = materialize_shard(plan, i, sp, spool, pad_id, kw, bar)
    del spool
    times["write"] = time.perf_counter() - t
    verify = None
    if cfg.verify_masks:
        from .verify import verify_masks

        t = time.perf_counter()
        verify = verify_masks(cfg, tok, plans, sp, files, mult, cfg.verify_masks)
        times["verify_masks"] = time.perf_counter() - t
    gate = None
    if cfg.check:
        t = time.perf_counter()
        gate = run_gate([s for p in plans for s in p.staged])
        times["check"] = time.perf_counter() - t
    outputs.publish_all([(s, f) for p in plans for s, f in zip(p.staged, p.finals)], replaced)
    summary = build_summary(cfg, files, sp, plans, shard_meta, mult, times, verify, gate)
    summary["empty_splits"] = empty
    return summary


def run_gate(prefixes: Sequence[str]) -> dict:
    """Run the promotion gate on every staged shard.

    Raises:
        ShardError: the gate is not installed, or a shard fails it.
    """
    try:
        from ..gate import check
    except ImportError as exc:
        raise ShardError(f"--check needs megatron_sft_idx.gate ({exc})", field="check") from None
    report = check(list(prefixes), level="standard")
    if not report.passed:
        raise ShardError("the gate rejected the output; nothing was published:\n" + report.format_text(),
                         field="check")
    return {"passed": True, "shards": len(prefixes)}


def build_summary(cfg, files, sp, plans, shard_meta, mult, times, verify, gate) -> dict:
    trunc = truncation_length(cfg.pack_size, mult, cfg.pad_layout)
    stats = [m["stats"] for m in shard_meta.values()]
    tokens = sum(s["token_count"] for s in stats)
    loss_tokens = sum(s["loss_token_count"] for s in stats)
    packs = sum(s["pack_count"] for s in stats)
    splits = {}
    for p in plans:
        summary = packing_summary(p.assignment, p.padded)
        splits[p.name] = {"conversations": int(p.members.size), "packs": p.assignment.n_bins,
                          "shards": p.finals, "packing_efficiency": summary["efficiency"],
                          "bins_over_lower_bound": summary["bins_over_lower_bound"]}
    return {
        "inputs": [{"name": f} for f in files],
        "records_read": sp.records,
        "conversations": int(sp.lengths.size),
        "skipped": dict(sorted(sp.skipped.items())),
        "skipped_examples": dict(sorted(sp.first_skipped.items())),
        "truncated": int((sp.lengths > trunc).sum()),
        "sequences": sum(s["sequence_count"] for s in stats),
        "packs": packs,
        "tokens": tokens,
        "trainable_tokens": loss_tokens,
        "trainable_share": round(loss_tokens / tokens, 6) if tokens else 0.0,
        "padding_tokens": int(sum(int(p.padded.sum() - p.copy_len.sum()) for p in plans)),
        "packing_efficiency": round(tokens / (packs * cfg.pack_size), 6) if packs else 0.0,
        "pack_size": cfg.pack_size, "pad_seq_to_mult": mult, "algorithm": cfg.algorithm, "seed": cfg.seed,
        "loss_on": cfg.loss_on, "workers": cfg.workers,
        "splits": splits,
        "outputs": list(shard_meta),
        "verify_masks": verify, "check": gate,
        "seconds": {k: round(v, 3) for k, v in times.items()},
        "peak_rss_mib": _peak_rss_mib(),
    }
