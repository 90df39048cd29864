"""The plan of a mixture: global packing of several stores' sequences, each source at its share.

One unit, lengths only, as the plan of one store (:mod:`.plan`), over a :class:`~.stores.StoreSet`:

1. every store's sequences are kept, cut or dropped by the pack settings (``--overlong``:
   :func:`~.plan.load_kept`), and measured in the mixture's unit (:mod:`.mixing`): trained
   tokens as the pack will train them (the store's ``.trained`` counts, recounted from the loss
   mask for a sequence cut by truncation), padded tokens, or 1;
2. each store's kept sequences are split (``--split``) by a seed derived from the run's seed and
   the store's id (adding a source changes no other source's split);
3. per split, each source's epochs are set from the weights, the total and the caps, and
   realised as whole epochs plus a seeded remainder (:func:`~.mixing.realise`);
4. the split's chosen sequences -- every source's, a sequence once per epoch it is taken -- are
   packed together, globally, by the run's algorithm (numba), cut into output shards.

The plan file is a :mod:`.planfile` of version 1.1: ``stores`` names the sources' stores (by
store id) and ``sequence_ids`` are global ids over them (store ``j``'s sequence ``g`` is
``offsets[j] + g``), ascending inside a pack (a repeated sequence may appear twice); each split
records, per source, what it realised (``sources``) and, per pack and source, the measure in the
unit (``pack_measures``, int32[P * S]: what the interleaved order and the window report read).
What the mixture realised against ``data_path`` sample weights is :mod:`.mixreport`'s.

Memory: per kept sequence ~13 bytes (padded length, trained count, split), per planned sequence
~26 while a split is packed (global id, padded length, source, measure, the packer's order and
bins), plus 4 bytes per source per pack (``bench/mix_plan.py`` measures it).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._numba import numba
from ..errors import ShardError
from ..packing import pack_lengths_csr, packing_summary
from ..packing.algorithms import index_dtype
from .config import PlanSettings
from .files import LOCAL, Files
from .mixing import derived_seed, realise, source_caps, split_epochs
from .mixture import Mixture
from .plan import Kept, _plan_shards_csr, load_kept, plan_summary, split_assignment, store_ids
from .planfile import MIX_PLAN_VERSION, PLAN_FORMAT, PackPlan, PlanWriter
from .receipts import ReceiptBook
from .store import ROWS_SUFFIX, SequenceStore, TRAINED_SUFFIX, part_prefix
from .stores import StoreSet

log = logging.getLogger("megatron_sft_idx.preprocess")
_DTYPES = {"int32": np.int32, "int64": np.int64}


# --------------------------------------------------------------------------- one source's sequences


@dataclass
class SourceKept:
    """One store's kept sequences (store order): padded lengths, trained tokens after the cut,
    the measure in the unit, and the split of each (None without ``--split``)."""

    kept: Kept
    trained: np.ndarray            # int32
    measure: np.ndarray            # int32 (trained, padded) or int8 ones
    split_of: Optional[np.ndarray]

    @property
    def padded(self) -> np.ndarray:
        return self.kept.padded


@numba.njit(cache=True, nogil=True)
def cut_trained(src_mask, src_start, trunc, drop_cut_turn, out):
    """Trained positions of sequences cut at ``trunc`` as the materialize step fills them
    (:func:`~megatron_sft_idx.packing.fill_sequences`): ones before the new last token, less the
    cut turn's under ``drop_cut_turn``."""
    for k in range(src_start.shape[0]):
        s = src_start[k]
        count = 0
        for j in range(trunc - 1):
            count += src_mask[s + j] != 0
        if drop_cut_turn and src_mask[s + trunc - 1] != 0:
            j = trunc - 2
            while j >= 0 and src_mask[s + j] != 0:
                count -= 1
                j -= 1
        out[k] = count


def _kept_mask(n: int, dropped: np.ndarray, base: int) -> np.ndarray:
    keep = np.ones(n, dtype=np.bool_)
    inside = dropped[(dropped >= base) & (dropped < base + n)] - base
    keep[inside] = False
    return keep


def trained_after_cut(store: SequenceStore, s: PlanSettings, dropped: np.ndarray) -> np.ndarray:
    """Trained tokens of every kept sequence of ``store`` (int32, store order) as its pack trains
    it: the ``.trained`` counts, recounted from the loss mask for a sequence cut by truncation.

    Raises:
        ShardError: a partition's counts or mask cannot be read.
    """
    out, base, trunc = [], 0, s.truncate_to
    for k in range(len(store.partitions)):
        rows = store.rows(k)
        trained = store.trained(k).astype(np.int32)
        keep = _kept_mask(rows.size, dropped, base)
        base += rows.size
        cut = np.flatnonzero(keep & (rows["length"] > trunc))
        if cut.size:
            ds = store.part(k)
            starts = np.asarray(ds.sequence_pointers[cut], dtype=np.int64) // ds.dtype.itemsize
            fresh = np.empty(cut.size, dtype=np.int64)
            cut_trained(ds.arrays().loss_mask, starts, int(trunc), s.truncated_turn_loss == "drop", fresh)
            ds.release_pages()
            trained[cut] = fresh
        out.append(trained[keep])
    return np.concatenate(out) if out else np.empty(0, np.int32)


def load_source(store: SequenceStore, s: PlanSettings, unit: str, seed: int) -> SourceKept:
    """:class:`SourceKept` of ``store`` for the pack settings ``s``, measured in ``unit``.

    Raises:
        InputError: an overlong sequence under ``--overlong error`` (see :func:`~.plan.load_kept`).
    """
    kept = load_kept(store, s)
    trained = trained_after_cut(store, s, kept.dropped)
    if unit == "trained_tokens":
        measure = trained
    elif unit == "tokens":
        measure = kept.padded
    else:
        measure = np.ones(kept.padded.size, dtype=np.int8)
    split_of = split_assignment(kept.padded.size, s.split, derived_seed(seed, store.content_id, 0)) \
        if kept.padded.size else (None if not s.split else np.empty(0, np.int8))
    return SourceKept(kept, trained, measure, split_of)


def _members(src: SourceKept, split: int) -> np.ndarray:
    """The kept indices of the source's sequences in ``split`` (ascending; int32 while they fit)."""
    dtype = index_dtype(src.padded.size)
    if src.split_of is None:
        return np.arange(src.padded.size, dtype=dtype)
    return np.flatnonzero(src.split_of == split).astype(dtype)


# --------------------------------------------------------------------------- the plan


def _split_totals(mixture: Mixture, s: PlanSettings, counts: Sequence[int]) -> List[Optional[float]]:
    """Each split's total in the unit: the mixture's total by the split weights (None: no total)."""
    if mixture.total is None:
        return [None] * len(counts)
    weights = np.asarray(s.split if s.split else [1.0], dtype=np.float64)
    weights = np.where(np.asarray(counts) > 0, weights, 0.0)
    return [float(mixture.total * w / weights.sum()) if w > 0 else None for w in weights]


def write_mix_plan(stores: StoreSet, mixture: Mixture, s: PlanSettings, path: str) -> dict:
    """Plan the mixture over ``stores`` with settings ``s`` into the plan file ``path``; returns
    its metadata (module doc).

    Raises:
        ShardError: a source empty after filtering; InfeasibleMixtureError: targets the caps cannot meet;
        InputError: see :func:`~.plan.load_kept`.
    """
    names = stores.names
    sources = [load_source(st, s, mixture.unit, s.seed) for st in stores.stores]
    for j, src in enumerate(sources):
        if src.padded.size == 0:
            why = ", ".join(f"{r}: {n}" for r, n in sorted(src.kept.skipped.items())) or "it holds none"
            raise ShardError(f"source {names[j]!r} is empty after filtering: no sequence of its store is kept "
                             f"({why})", path=stores.stores[j].directory, field=f"sources[{j}]",
                             hint="check its inputs and --overlong / --pack-size, or leave it out of the mixture")
    split_names = s.split_names
    counts = [sum(_members(src, i).size for src in sources) for i in range(len(split_names))]
    totals = _split_totals(mixture, s, counts)
    caps = source_caps([x.max_epochs for x in mixture.sources], [x.max_tokens for x in mixture.sources],
                       [int(src.padded.sum(dtype=np.int64)) for src in sources],
                       repeats=mixture.total is not None or mixture.unit == "epochs")
    id_dtype = "int32" if index_dtype(stores.sequence_count) == np.int32 else "int64"
    writer = PlanWriter(path)
    try:
        splits = []
        for i, name in enumerate(split_names):
            if counts[i]:
                splits.append(_plan_split(writer, stores, sources, mixture, s, caps, i, totals[i], id_dtype))
        meta = {"format": PLAN_FORMAT, "settings": s.to_dict(),
                "stores": [{"name": n, "store_id": st.store_id, "sequences": st.sequence_count}
                           for n, st in zip(names, stores.stores)],
                "mixture": mixture.to_dict(),
                "conversations": sum(sp["conversations"] for sp in splits),
                "truncated": sum(src.kept.truncated for src in sources),
                "truncated_turns_cut": sum(src.kept.cut_turns for src in sources),
                "padding_tokens": sum(src.kept.padding_tokens for src in sources),
                "skipped": _merged([src.kept.skipped for src in sources]),
                "first_skipped": _first([src.kept.first_skipped for src in sources]),
                "splits": splits, "empty_splits": [n for i, n in enumerate(split_names) if not counts[i]]}
        writer.close(meta, version=MIX_PLAN_VERSION)
    except BaseException:
        writer.abort()
        raise
    return meta


def _merged(dicts: Sequence[Dict[str, int]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _first(dicts: Sequence[Dict[str, str]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, v)
    return dict(sorted(out.items()))


def _plan_split(writer: PlanWriter, stores: StoreSet, sources: List[SourceKept], mixture: Mixture,
                s: PlanSettings, caps, which: int, total: Optional[float], id_dtype: str) -> dict:
    """Choose each source's sequences for split ``which``, pack them together and append the
    split's arrays; returns the split's metadata."""
    name = s.split_names[which]
    members = [_members(src, which) for src in sources]
    amounts = np.array([float(src.measure[m].sum(dtype=np.int64)) for src, m in zip(sources, members)])
    epochs = split_epochs(mixture.unit, mixture.weights, stores.names, amounts, caps, total, name, mixture.path)
    # every chosen sequence (sources in store order, each ascending: global ids ascend), with its
    # padded length, source and measure; the compact dtypes keep ~20 bytes per planned sequence
    ids, padded, source, measure, recorded = [], [], [], [], []
    for j, (src, m) in enumerate(zip(sources, members)):
        got = realise(src.measure[m].astype(np.float64), float(epochs[j]),
                      derived_seed(s.seed, stores.stores[j].content_id, 1, which))
        chosen = np.concatenate([np.tile(m, got.whole), m[got.extra]]) if got.whole else m[got.extra]
        chosen.sort(kind="stable")
        ids.append((stores.offsets[j] + store_ids(chosen.astype(np.int64), src.kept.dropped)).astype(_DTYPES[id_dtype]))
        padded.append(src.padded[chosen])
        source.append(np.full(chosen.size, j, dtype=np.int16))
        measure.append(src.measure[chosen].astype(np.int32))
        recorded.append(_source_record(stores.names[j], src, m, chosen, float(epochs[j]), amounts[j], s))
        del chosen
    ids, padded, source, measure = (np.concatenate(x) for x in (ids, padded, source, measure))
    # each source alone (its report's data_path column) in threads beside the global packing: the
    # packing kernels release the GIL
    with ThreadPoolExecutor(max(1, min(len(sources), (os.cpu_count() or 2) - 1))) as pool:
        alone = [pool.submit(_alone, src, m, s) for src, m in zip(sources, members)]
        a = pack_lengths_csr(padded, s.pack_size, s.algorithm, s.seed)
        summary = packing_summary(a, padded)
        del padded
        pack_measures = _pack_measures(a.items, a.offsets, source, measure, len(sources))
        del source, measure
        starts = _plan_shards_csr(a.loads, a.offsets, s.itemsize, s.max_packs_per_shard, s.max_shard_bytes)
        for rec, job in zip(recorded, alone):   # what the packs hold of each source, and its packs alone
            rec["packed_alone"] = job.result()
    arrays = {"shard_starts": writer.array(starts, "int64"),
              "pack_offsets": writer.array(a.offsets, "int64"),
              "pack_loads": writer.array(a.loads, "int32"),
              "sequence_ids": writer.array(ids[a.items], id_dtype),
              "pack_measures": writer.array(pack_measures.reshape(-1), "int32")}
    return {"name": name, "conversations": int(a.items.size), "packs": a.n_bins, "shards": int(starts.size - 1),
            "packing_efficiency": summary["efficiency"], "bins_over_lower_bound": summary["bins_over_lower_bound"],
            "sources": recorded, "arrays": arrays}


@numba.njit(cache=True, nogil=True)
def _pack_measure_kernel(items, offsets, source, measure, nsrc, out):
    for p in range(offsets.shape[0] - 1):
        for i in range(offsets[p], offsets[p + 1]):
            it = items[i]
            out[p * nsrc + source[it]] += measure[it]


def _pack_measures(items, offsets, source, measure, nsrc: int) -> np.ndarray:
    """int32[P, S]: each pack's measure of each source (at most the pack size each)."""
    out = np.zeros((offsets.size - 1) * nsrc, dtype=np.int32)
    _pack_measure_kernel(items, offsets, source, measure, nsrc, out)
    return out.reshape(-1, nsrc)


def _source_record(name: str, src: SourceKept, members: np.ndarray, chosen: np.ndarray, epochs: float,
                   amount: float, s: PlanSettings) -> dict:
    """What split's packs hold of one source (realised), and one epoch of it (``amount``)."""
    realised = float(src.measure[chosen].sum(dtype=np.int64))
    return {"name": name, "members": int(members.size), "sequences": int(chosen.size),
            "epoch_amount": int(amount), "target_epochs": round(epochs, 9), "amount": int(realised),
            "tokens": int(src.padded[chosen].sum(dtype=np.int64)),
            "trained_tokens": int(src.trained[chosen].sum(dtype=np.int64)),
            "epoch_tokens": int(src.padded[members].sum(dtype=np.int64)),
            "epoch_trained_tokens": int(src.trained[members].sum(dtype=np.int64))}


def _alone(src: SourceKept, members: np.ndarray, s: PlanSettings) -> dict:
    """One epoch of the source's split packed alone, as ``preprocess-sft`` of that source would
    (what a ``data_path`` blend of per-source shards samples from)."""
    padded = src.padded[members]
    a = pack_lengths_csr(padded, s.pack_size, s.algorithm, s.seed)
    return {"packs": a.n_bins, "tokens": int(padded.sum(dtype=np.int64)),
            "trained_tokens": int(src.trained[members].sum(dtype=np.int64)),
            "amount": int(src.measure[members].sum(dtype=np.int64))}


# --------------------------------------------------------------------------- the steps


def store_reads(store_dir: str) -> List[str]:
    """What the plan reads of a store: every partition's rows and trained counts (a store made
    before those counts: its shard files too, whose masks they are counted from)."""
    store = SequenceStore(store_dir)
    out = []
    for k in range(len(store.partitions)):
        prefix = part_prefix(store_dir, k)
        out.append(prefix + ROWS_SUFFIX)
        if store.has_trained(k):
            out.append(prefix + TRAINED_SUFFIX)
        elif store.receipts[k]["sequences"]:
            out.extend(prefix + x for x in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"))
    return out


def open_set(store_dirs: Sequence[str], names: Sequence[str], files: Files = LOCAL) -> StoreSet:
    return StoreSet([SequenceStore(d, files=files) for d in store_dirs], names)


@dataclass(frozen=True)
class MixPlanStep:
    """Unit 0: plan the mixture over the stores into ``path``; the receipt carries the plan's summary."""

    store_dirs: Tuple[str, ...]
    names: Tuple[str, ...]
    mixture: Mixture
    settings: PlanSettings
    path: str
    book: ReceiptBook
    files: Files = LOCAL
    name: str = "plan"

    @property
    def writes_to(self) -> str:
        return self.path

    def reads(self, unit: int) -> List[str]:
        return [p for d in self.store_dirs for p in store_reads(d)]

    def run(self, unit: int) -> dict:
        stores = open_set(self.store_dirs, self.names, self.files)
        metadata = write_mix_plan(stores, self.mixture, self.settings, self.path)
        t = time.perf_counter()
        PackPlan(self.path, verify=False).validate(stores)   # (a bug guard, as for one store)
        receipt = self.book.write(unit, plan_summary(metadata), [self.path], pinned=[self.path])
        return dict(receipt, validate_seconds=time.perf_counter() - t)


__all__ = ["write_mix_plan", "MixPlanStep", "SourceKept", "load_source", "trained_after_cut", "store_reads",
           "open_set"]
