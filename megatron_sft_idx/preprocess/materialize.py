"""The materialize step: plan + store -> one output shard per unit, in a staging directory.

:func:`output_shards` names every output shard of a plan and the metadata it records (the same
whichever command writes it); :func:`resumed_shards` is how ``--resume`` takes the shards an
earlier attempt wrote (only once they verify).

Unit ``u`` writes output shard ``u`` (splits in order, shards in order inside a split): the
packs ``shard_starts[s]..shard_starts[s+1]`` of its split, a chunk of packs at a time. Each
chunk reads its sequences from the store's partitions with ``pread`` (see :class:`Gatherer`),
cut to the truncation length (the last kept position gets loss 0), padded with ``pad_id``
(loss 0) to the pad multiple, and is appended pack by pack to an
:class:`IndexedDatasetBuilder`. The staged shard is published into the staging directory
(``.idx`` last), then the unit's receipt is written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..builder import IndexedDatasetBuilder
from .._files import open_generation
from .._progress import own_peak_rss_mib
from ..errors import MetadataError, ShardError
from ..format import BIN_SUFFIX, LOSS_SUFFIX, PUBLISH_ORDER, SEQ_IDX_SUFFIX, ShardPaths
from ..metadata import ShardMetadata
from ..packing import exclusive_cumsum, fill_sequences, padded_length, truncation_length
from . import outputs
from ..jsondoc import normal_json
from .config import PackJob
from .integrity import verify_shard
from .planfile import PackPlan
from .receipts import REDO_HINT, ReceiptBook, settings_key
from .store import SequenceStore, encoding_extra
from .stores import SHARED_ENCODE_KEYS, StoreSet, open_stores

log = logging.getLogger("megatron_sft_idx.preprocess")

_CHUNK_TOKENS = 1 << 22  # tokens materialized at once
_CHUNK_SEQUENCES = 512   # sequences read at once (one pread each for tokens and loss mask)


@dataclass(frozen=True)
class OutputShard:
    """Where unit ``u`` goes: split ``split`` (index into the plan's splits), shard ``shard``."""

    split: int
    shard: int
    staged: str          # prefix in the staging directory
    final: str           # prefix it is published to
    metadata: dict       # the builder's metadata= for this shard


@dataclass(frozen=True)
class MaterializeStep:
    """Unit ``u``: output shard ``u`` (module doc). ``store_dir``: the store, or a mixture's stores
    (a tuple, with ``names``: then every sequence's source is recorded with the shard)."""

    store_dir: Union[str, Tuple[str, ...]]
    plan_path: str
    shards: Tuple[OutputShard, ...]
    pad_id: int
    vocab_size: int
    book: ReceiptBook
    name: str = "materialize"
    names: Tuple[str, ...] = ()

    @property
    def writes_to(self) -> str:
        return os.path.dirname(self.shards[0].staged)

    def run(self, unit: int) -> dict:
        out = self.shards[unit]
        store = open_stores(self.store_dir, self.names)
        plan = PackPlan(self.plan_path)
        settings = plan.settings
        gather = Gatherer(store, settings.pack_size, settings.pad_multiple, self.pad_id, settings.pad_layout,
                          settings.truncated_turn_loss)
        arrays = plan.arrays(out.split)
        first, last = int(arrays["shard_starts"][out.shard]), int(arrays["shard_starts"][out.shard + 1])
        try:
            with IndexedDatasetBuilder(out.staged, overwrite=True, vocab_size=self.vocab_size,
                                       pack_size=settings.pack_size, metadata=out.metadata) as builder:
                for b0, b1 in chunks(arrays["pack_offsets"], arrays["pack_loads"], first, last):
                    ids, mask, starts, ends = gather.packs(arrays, b0, b1)
                    sources = _chunk_sources(store, arrays, b0, b1)
                    for k in range(b1 - b0):
                        lo, hi = int(ends[k]), int(ends[k + 1])
                        builder.add_packed(ids[lo:hi], mask[lo:hi], starts[k] - lo,
                                           None if sources is None else sources[k])
        finally:
            gather.close()
        body = {"final": out.final, "packs": last - first, "metadata": builder.metadata.to_dict(),
                "peak_rss_mib": round(own_peak_rss_mib(), 1)}
        return self.book.write(unit, body, [out.staged + s for s in PUBLISH_ORDER], pinned=[out.staged + SEQ_IDX_SUFFIX])


def _chunk_sources(store, arrays: dict, b0: int, b1: int) -> Optional[List[np.ndarray]]:
    """Each pack's source ids (a mixture's stores), None for one store."""
    if not isinstance(store, StoreSet):
        return None
    offsets = np.asarray(arrays["pack_offsets"][b0:b1 + 1], dtype=np.int64)
    ids = store.source_of(arrays["sequence_ids"][offsets[0]:offsets[-1]])
    return np.split(ids, offsets[1:-1] - offsets[0])


def materialize_schema(doc) -> None:
    """The materialize receipt's own fields: the shard it wrote, and that shard's metadata."""
    doc.str("final")
    doc.int("packs", lo=1)
    doc.number("peak_rss_mib", 0.0, float(1 << 40))
    try:
        ShardMetadata.from_dict(doc.raw("metadata"), path=doc.path)
    except ShardError as exc:
        raise MetadataError(exc.message, path=doc.path, field=f"metadata.{exc.field}") from None
    doc.doc("metadata").doc("extra").str("split")


# --------------------------------------------------------------------------- the output shards


def shard_metadata(store: SequenceStore, job: PackJob, split: str, shard: int, count: int,
                   set_id: Optional[str] = None) -> dict:
    """The metadata every output shard records (the same whichever command wrote it); with
    ``set_id`` (a run writing several shards) the shard's set membership too."""
    s = job.settings
    cp, tp, sp = job.parallelism
    encode = store.identity["encode"]
    meta = {
        "pad_seq_to_mult": s.pad_multiple,
        "pad_layout": s.pad_layout,
        "tokenizer": store.tokenizer,
        "packing": {"algorithm": s.algorithm, "seed": s.seed, "pack_size": s.pack_size, "overlong": s.overlong},
        "parallelism": {"cp": cp, "tp": tp, "sp": bool(sp)},
        "source": {"inputs": store.inputs, "input_format": encode["input_format"]},
        "extra": {"loss_on": encode["loss_on"], "split": split, "shard_index": shard, "shard_count": count},
    }
    if set_id is not None:
        meta["set"] = {"id": set_id, "name": split, "index": shard, "count": count}
    if job.fp8 is not None:   # absent means no FP8 alignment (the bytes of earlier shards)
        meta["parallelism"]["fp8"] = job.fp8
    if s.truncated_turn_loss != "keep":  # absent means keep (the default; the bytes of earlier shards)
        meta["extra"]["truncated_turn_loss"] = s.truncated_turn_loss
    if job.mixture is None:
        meta["extra"].update(encoding_extra(encode))  # loss policy, prompt format: absent means the defaults
    else:   # a mixture: its sources, each with how its records were read (the rest is one for all)
        meta["source"] = {"inputs": store.inputs, "mixture": job.mixture.to_dict()}
        meta["extra"].update({k: v for k, v in encoding_extra(encode).items() if k in SHARED_ENCODE_KEYS})
        meta["sources"] = [dict({k: v for k, v in encoding_extra(st.identity["encode"]).items()
                                 if k not in SHARED_ENCODE_KEYS}, name=name, store_id=st.store_id,
                                input_format=st.identity["encode"]["input_format"])
                           for name, st in zip(store.names, store.stores)]
    if meta["tokenizer"] is None:  # pre-tokenized input without a tokenizer
        del meta["tokenizer"]
    return meta


def set_id(store: SequenceStore, job: PackJob, split: str) -> str:
    """The id of the set of one split's shards: a digest of everything that decides their bytes
    (what the store holds -- tokenizer, encoding, inputs by content -- and the pack settings)
    and the split's name. Deterministic: the same inputs and settings give the same id whatever
    the engine, the workers, the partitioning or a resume, and whether ``preprocess-sft`` or
    ``repack-sft`` wrote the shards; any change to what the shards hold gives another id."""
    settings = job.settings.to_dict()
    if settings.get("split"):  # weights as given by the CLI (floats) or the API (maybe ints): one spelling
        settings["split"] = [float(w) for w in settings["split"]]
    key = {"set": 1, "store": store.identity, "inputs": store.inputs, "settings": settings,
           "pad_id": job.pad_id, "vocab_size": job.vocab_size,
           "parallelism": [int(job.parallelism[0]), int(job.parallelism[1]), bool(job.parallelism[2])],
           "split": split}
    if job.fp8 is not None:   # (sets without --fp8 keep their ids)
        key["fp8"] = job.fp8
    if job.mixture is not None:   # (sets of one store keep their ids)
        key["mixture"] = job.mixture.to_dict()
        key["stores"] = [[n, st.store_id] for n, st in zip(store.names, store.stores)]
    return settings_key(key)


def output_shards(store: SequenceStore, job: PackJob, plan: dict, staged_dir: str) -> List[OutputShard]:
    """Every output shard of the plan, in publishing order (splits, then shard index). When the
    run writes more than one shard, each split's shards form a set (:func:`set_id`)."""
    numbered = bool(job.settings.max_packs_per_shard or job.settings.max_shard_bytes)
    by_name = dict(zip(job.settings.split_names, job.bases))
    several = sum(split["shards"] for split in plan["splits"]) > 1
    out = []
    for i, split in enumerate(plan["splits"]):
        count = split["shards"]
        ident = set_id(store, job, split["name"]) if several else None
        for k in range(count):
            final = outputs.shard_prefix(by_name[split["name"]], k, numbered)
            out.append(OutputShard(i, k, os.path.join(staged_dir, os.path.basename(final)), final,
                                   shard_metadata(store, job, split["name"], k, count, ident)))
    return out


def resumed_shards(books: Dict[str, ReceiptBook], count: int, copies: bool,
                   verdicts: Callable[[List[int]], Dict[int, str]]) -> Tuple[Dict[int, dict], set]:
    """``({unit: materialize receipt}, {published units})`` of the ``count`` units an earlier
    attempt finished whose shard still verifies (where it is now: staged, or under its final
    name once published to a destination that moves the staged files, ``copies`` False). A unit
    that does not verify loses both its receipts (``books``: ``materialize`` and ``publish``),
    logged: it is written again. ``verdicts(units)``: the check of those units, made by the
    engine (:class:`VerifyShardStep`), ``{unit: why}`` of those that do not verify."""
    candidates = {}
    for u in range(count):
        pub = books["publish"].read(u)
        receipt = books["materialize"].read(u, artifacts=not (pub is not None and not copies))
        if receipt is None:
            books["publish"].discard(u)
            continue
        candidates[u] = (receipt, pub)
    problems = verdicts(sorted(candidates)) if candidates else {}
    done, published = {}, set()
    for u, (receipt, pub) in candidates.items():
        if problems.get(u):
            log.warning("output shard %d does not verify; writing it again: %s", u, problems[u])
            books["materialize"].discard(u)
            books["publish"].discard(u)
            continue
        done[u] = receipt
        if pub is not None:
            published.add(u)
    return done, published


def unit_problem(receipt: dict, pub: Optional[dict], shard: OutputShard, plan: PackPlan, work_path: str,
                 copies: bool) -> str:
    """'' when output shard ``shard`` verifies against its receipts, else why not (``copies``:
    the destination copies the staged files, so a published shard is still staged)."""
    starts = plan.arrays(shard.split)["shard_starts"]
    try:
        _verify_unit(receipt, pub, shard, int(starts[shard.shard + 1] - starts[shard.shard]), work_path,
                     pub is not None and not copies)
    except ShardError as exc:
        return str(exc)
    return ""


@dataclass(frozen=True)
class VerifyShardStep:
    """Unit ``u``: :func:`unit_problem` of output shard ``u`` where the unit runs (a work directory
    in object storage: the task pulls the plan and that shard, the driver gets the verdict
    ``{"unit": u, "problem": why}``). ``copies``: the destination copies the staged files (an
    upload), else a published shard is read under its final name."""

    books: Dict[str, ReceiptBook]
    shards: Tuple[OutputShard, ...]
    plan_path: str
    work_path: str
    copies: bool
    name: str = "verify-shards"

    @property
    def writes_to(self) -> str:
        return self.work_path

    def reads(self, unit: int) -> List[str]:
        return [self.plan_path] + [self.shards[unit].staged + s for s in PUBLISH_ORDER]

    def run(self, unit: int) -> dict:
        pub = self.books["publish"].read(unit)
        receipt = self.books["materialize"].read(unit, artifacts=False)
        why = "no materialize receipt" if receipt is None else unit_problem(
            receipt, pub, self.shards[unit], PackPlan(self.plan_path, verify=False), self.work_path, self.copies)
        return {"unit": unit, "problem": why}


def _verify_unit(receipt: dict, pub: Optional[dict], shard: OutputShard, packs: int, work_path: str,
                 moved: bool) -> None:
    """Raise unless the unit's receipts name this shard and its bytes verify.

    Raises:
        ShardError: a receipt of another shard, or a checksum or the metadata differ.
    """
    final = outputs.normal_path(shard.final)
    if (outputs.normal_path(receipt["final"]) != final or receipt["packs"] != packs
            or (pub is not None and outputs.normal_path(pub["final"]) != final)):
        raise MetadataError("the receipts of this unit name another shard", path=shard.staged, field="final",
                            expected=[shard.final, packs], actual=[receipt["final"], receipt["packs"]])
    rel = os.path.relpath(shard.staged + SEQ_IDX_SUFFIX, work_path)
    ds = verify_shard(shard.final if moved else shard.staged, REDO_HINT, receipt.get("crc32", {}).get(rel))
    if normal_json(ds.metadata.to_dict()) != normal_json(receipt["metadata"]):
        raise MetadataError("the shard's metadata differs from its receipt's", path=ds.paths.seq_idx,
                            field="metadata")


# --------------------------------------------------------------------------- gathering packs


def chunks(offsets: np.ndarray, loads: np.ndarray, first: int, last: int):
    """``(b0, b1)`` runs of packs of at most ``_CHUNK_TOKENS`` tokens and ``_CHUNK_SEQUENCES``
    sequences (at least one pack each)."""
    b0 = first
    while b0 < last:
        b1 = b0 + 1
        tokens = int(loads[b0])
        while (b1 < last and tokens + int(loads[b1]) <= _CHUNK_TOKENS
               and int(offsets[b1 + 1]) - int(offsets[b0]) <= _CHUNK_SEQUENCES):
            tokens += int(loads[b1])
            b1 += 1
        yield b0, b1
        b0 = b1


class Gatherer:
    """Builds packs from store sequences: truncation, padding and the truncated-end mask rule.

    Sequences are read with ``pread`` into a chunk-sized buffer, not through a map: packs take
    their sequences from anywhere in the store, and every fault on a mapped file maps the whole
    page-cache folio around it (64 KiB to MiBs on current kernels, whatever ``madvise`` says),
    which charged the process ~100 MiB of file pages per chunk. A read maps nothing, so RSS is
    the chunk's own buffers however large the store is.
    """

    def __init__(self, store: SequenceStore, pack_size: int, pad_multiple: int, pad_id: int,
                 pad_layout: str = "stored", truncated_turn_loss: str = "keep") -> None:
        self.store = store
        self.part_starts = store.starts()
        self.truncate_to = truncation_length(pack_size, pad_multiple, pad_layout)
        self.pad_multiple = pad_multiple
        self.pad_layout = pad_layout
        self.pad_id = pad_id
        self.drop_cut_turn = truncated_turn_loss == "drop"
        self._files = {}   # partition -> _PartFiles

    def _part(self, k: int) -> "_PartFiles":
        files = self._files.get(k)
        if files is None:
            files = self._files[k] = _PartFiles(self.store.part(k), self.store.part_prefix(k))
        return files

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def packs(self, arrays: dict, b0: int, b1: int):
        """Packs ``b0..b1`` of a split: ``(ids int64, mask uint8, seq starts per pack, pack ends)``.

        ``seq starts per pack`` is a list of int64 arrays of absolute offsets in ``ids``; pack k
        spans ``ends[k]..ends[k+1]``.

        Raises:
            ShardError: a store partition is shorter than its index says (changed under the run).
        """
        offsets = arrays["pack_offsets"]
        s0, s1 = int(offsets[b0]), int(offsets[b1])
        seq = np.asarray(arrays["sequence_ids"][s0:s1], dtype=np.int64)
        part = np.searchsorted(self.part_starts, seq, side="right") - 1
        local = seq - self.part_starts[part]
        touched = np.unique(part)
        full = np.empty(seq.size, dtype=np.int64)
        for k in touched:
            sel = part == k
            full[sel] = self._part(int(k)).lengths[local[sel]]
        copy = np.minimum(full, self.truncate_to)
        dst = exclusive_cumsum(padded_length(copy, self.pad_multiple, self.pad_layout))
        ids = np.full(int(dst[-1]), self.pad_id, dtype=np.int64)
        mask = np.zeros(int(dst[-1]), dtype=np.uint8)
        for k in touched:
            sel = np.flatnonzero(part == k)
            tokens, loss, src = self._part(int(k)).read(local[sel], copy[sel])
            fill_sequences(ids, mask, dst[sel], tokens, loss, src, copy[sel], full[sel], self.drop_cut_turn)
        pack_seq = np.asarray(offsets[b0:b1 + 1], dtype=np.int64) - s0
        ends = dst[pack_seq]
        starts = [dst[pack_seq[k]:pack_seq[k + 1]] for k in range(b1 - b0)]
        return ids, mask, starts, ends


class _PartFiles:
    """One store partition for reading sequences: its index arrays (mapped: small) and its
    token and loss-mask files, read with ``pread``."""

    def __init__(self, ds, prefix: str) -> None:
        self.lengths = ds.sequence_lengths
        self.pointers = ds.sequence_pointers
        self.dtype = ds.dtype.numpy
        self.itemsize = ds.dtype.itemsize
        self.prefix = prefix
        self.files = open_generation(prefix, ShardPaths.from_prefix(prefix))

    def read(self, local: np.ndarray, count: np.ndarray):
        """The first ``count[i]`` tokens and loss values of sequences ``local``, one after another:
        ``(tokens, loss, start of each sequence in them)``.

        Raises:
            ShardError: a file is shorter than the index says, or cannot be read.
        """
        starts = exclusive_cumsum(count)
        tokens = np.empty(int(starts[-1]), dtype=self.dtype)
        loss = np.empty(int(starts[-1]), dtype=np.uint8)
        token_bytes, loss_bytes = memoryview(tokens).cast("B"), memoryview(loss)
        size, read = self.itemsize, self.files.read_into
        for pointer, a, b in zip(self.pointers[local].tolist(), starts[:-1].tolist(), starts[1:].tolist()):
            if (read(BIN_SUFFIX, token_bytes[a * size:b * size], pointer) != (b - a) * size
                    or read(LOSS_SUFFIX, loss_bytes[a:b], pointer // size) != b - a):
                raise ShardError("store partition is shorter than its index says", path=self.prefix,
                                 field="sequence_pointers", hint="the sequence store changed under the run; "
                                 "rebuild it (rerun without --resume)")
        return tokens, loss, starts[:-1]

    def close(self) -> None:
        self.files.close()
