"""The plan step: global packing of the store's lengths into a pack plan file.

One unit, lengths only: the store's ``.rows`` are read a partition at a time, overlong
sequences are truncated, dropped or refused (``--overlong``), the kept conversations are
split (``--split``, seeded) and each split is packed globally (numba, the five algorithms)
into packs of ``--pack-size`` with every sequence padded to the pad multiple, then cut into
output shards (``--max-packs-per-shard`` / ``--max-shard-bytes``). The result is a
:mod:`.planfile`: pack -> store sequence ids. :func:`resumed_plan` is how ``--resume`` takes
an earlier attempt's plan (only once it verifies). :class:`PlanSettings` is defined in
:mod:`.config`.

Memory: about 16 bytes per conversation without ``--split`` and 24 with it (int32 padded
lengths, packing order and bin ids, plus split ids and members), plus ~40 bytes per pack;
``bench/plan.py`` measures it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._numba import numba
from ..errors import HeaderError, ShardError, ShardNotFoundError
from ..packing import exclusive_cumsum, pack_lengths_csr, packing_summary
from ..packing.algorithms import index_dtype
from ..jsondoc import normal_json
from .config import PlanSettings  # noqa: F401  (PlanSettings: this module's name for it before)
from .records.errors import input_error
from .planfile import PLAN_FORMAT, PackPlan, PlanWriter
from .receipts import REDO_HINT, ReceiptBook
from .files import LOCAL, Files
from .store import SequenceStore, rows_paths
from .stores import open_stores
from .summary import merged_skips, skipped_text

log = logging.getLogger("megatron_sft_idx.preprocess")
_CHUNK = 1 << 20


def split_conversations(n: int, weights: Optional[Sequence[float]], seed: int) -> List[np.ndarray]:
    """Global conversation indices of each split (ascending), from a seeded permutation."""
    split_of = split_assignment(n, weights, seed)
    if split_of is None:
        return [np.arange(n, dtype=np.int64)]
    return [np.flatnonzero(split_of == i) for i in range(len(weights))]


def _split_bounds(n: int, weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return np.round(np.concatenate([[0.0], np.cumsum(w / w.sum())]) * n).astype(np.int64)


def split_sizes(n: int, weights: Sequence[float]) -> np.ndarray:
    """Conversations per split."""
    return np.diff(_split_bounds(n, weights))


def split_assignment(n: int, weights: Optional[Sequence[float]], seed: int) -> Optional[np.ndarray]:
    """The split of every conversation (int8), or None without splits.

    Split ``i`` is ``permutation(n)[bounds[i]:bounds[i+1]]`` for the seeded permutation and
    the rounded cumulative weights; the permutation is built in int32 (Generator.shuffle
    draws what Generator.permutation draws) and freed before returning.
    """
    if not weights:
        return None
    bounds = _split_bounds(n, weights)
    perm = np.arange(n, dtype=index_dtype(n))
    np.random.default_rng(seed).shuffle(perm)
    split_of = np.empty(n, dtype=np.int8)
    _assign_splits(perm, bounds, split_of)
    return split_of


@numba.njit(cache=True)
def _assign_splits(perm, bounds, split_of):
    """``split_of[perm[bounds[i]:bounds[i+1]]] = i``, without numpy's int64 copy of the index."""
    for i in range(bounds.shape[0] - 1):
        for k in range(bounds[i], bounds[i + 1]):
            split_of[perm[k]] = i


@numba.njit(cache=True)
def _select(split_of, which, values, out):
    """``out[k] = values[i]`` (or ``i`` when ``values`` is empty) for the k-th i of split ``which``."""
    k = 0
    for i in range(split_of.shape[0]):
        if split_of[i] == which:
            out[k] = values[i] if values.shape[0] else i
            k += 1
    return k


def _split_members(split_of: np.ndarray, which: int, count: int, values=None) -> np.ndarray:
    """Conversations of split ``which`` (ascending), or their ``values``, exactly ``count`` long."""
    out = np.empty(count, dtype=values.dtype if values is not None else index_dtype(split_of.size))
    _select(split_of, which, values if values is not None else np.empty(0, out.dtype), out)
    return out


@numba.njit(cache=True)
def _shard_starts(loads, offsets, itemsize, max_packs, max_bytes, out):
    n = loads.shape[0]
    count, s = 1, 0
    out[0] = 0
    while s < n:
        e, size = s, 0
        while e < n and (max_packs == 0 or e - s < max_packs):
            pack = loads[e] * (itemsize + 1) + (offsets[e + 1] - offsets[e]) * 4 + 20  # bytes of its files
            if max_bytes and size + pack > max_bytes:
                break
            size += pack
            e += 1
        s = max(e, s + 1)
        out[count] = s
        count += 1
    return count


def plan_shards(loads: np.ndarray, seq_counts: np.ndarray, itemsize: int,
                max_packs: Optional[int], max_bytes: Optional[int]) -> np.ndarray:
    """First pack of each shard plus the end (int64[S+1]): each shard holds as many packs as fit
    ``max_packs`` and ``max_bytes`` (its files' bytes), and at least one."""
    n = loads.size
    if not max_packs and not max_bytes:
        return np.array([0, n], dtype=np.int64)
    offsets = exclusive_cumsum(np.asarray(seq_counts, dtype=np.int64))
    return _plan_shards_csr(np.asarray(loads, dtype=np.int64), offsets, itemsize, max_packs, max_bytes)


def _plan_shards_csr(loads, offsets, itemsize: int, max_packs, max_bytes) -> np.ndarray:
    n = loads.size
    if not max_packs and not max_bytes:
        return np.array([0, n], dtype=np.int64)
    out = np.empty(n + 1, dtype=np.int64)
    count = _shard_starts(loads, offsets, itemsize, int(max_packs or 0), int(max_bytes or 0), out)
    return out[:count].copy()


# --------------------------------------------------------------------------- kept lengths


@dataclass
class Kept:
    """The conversations that go into packs, in store order."""

    padded: np.ndarray                  # int32 padded length per kept conversation
    dropped: np.ndarray                 # int64 store ids of the conversations not kept, ascending
    truncated: int
    padding_tokens: int
    skipped: Dict[str, int]
    first_skipped: Dict[str, str]
    cut_turns: int = 0                  # truncated conversations whose cut fell inside a trained turn
    split_of: Optional[np.ndarray] = None   # int8 split of each kept conversation (None: no --split)
    id_dtype: str = "int64"             # of store ids in the plan (int32 when every id fits)


#: Skip reason of an overlong conversation that is not kept, by --overlong mode.
OVERLONG_REASON = {"drop": "overlong_dropped", "truncate": "overlong_untrainable_after_truncation",
                    "error": "overlong"}


def _overlong_error(s: PlanSettings, name: str, line: int, length: int):
    """The InputError the tokenizer workers raised for this record before the plan stage
    existed (same message and reason, so summaries and --skip-bad counts are unchanged)."""
    if s.overlong == "drop":
        return input_error("overlong sequence dropped", name, line, reason="overlong_dropped")
    if s.overlong == "truncate":
        return input_error("nothing trained within the first --pack-size tokens", name, line,
                           reason="overlong_untrainable_after_truncation")
    padded = int(s.padded([length])[0])
    return input_error(f"sequence of {length} tokens (padded {padded}) exceeds --pack-size {s.pack_size}",
                       name, line, field="input_ids", reason="overlong",
                       hint="use --overlong truncate or drop, or a larger --pack-size")


def load_kept(store: SequenceStore, s: PlanSettings) -> Kept:
    """Padded lengths of the kept conversations, a partition at a time.

    Raises:
        InputError: an overlong conversation under ``--overlong error`` (without skip_bad).
    """
    total = store.sequence_count
    padded = np.empty(total, dtype=np.int32)
    dropped: List[np.ndarray] = []
    n = base = truncated = padding = 0
    skipped: Dict[str, int] = {}
    first: Dict[str, str] = {}
    trunc = s.truncate_to
    cut_total = 0
    for k, part in enumerate(store.partitions):
        rows = store.rows(k)
        full = rows["length"]
        drop = s.padded(full) > s.pack_size
        if drop.any():
            if s.overlong == "truncate":
                drop &= rows["first_trained"] >= trunc - 1
                cut, untrainable = _cut_turns(store, k, rows, ~drop & (full > trunc), trunc,
                                              required=s.truncated_turn_loss == "drop")
                cut_total += int(cut.sum())
                if s.truncated_turn_loss == "drop":
                    drop |= untrainable
            bad = np.flatnonzero(drop)
            if bad.size:
                name, line, length = store.inputs[part.file]["name"], int(rows["line"][bad[0]]), int(full[bad[0]])
                if s.overlong == "error" and not s.skip_bad:
                    raise _overlong_error(s, name, line, length)
                reason = OVERLONG_REASON[s.overlong]
                skipped[reason] = skipped.get(reason, 0) + int(bad.size)
                first.setdefault(reason, str(_overlong_error(s, name, line, length)))
        keep = ~drop
        kept = full[keep]
        copy = np.minimum(kept, trunc)
        pad = s.padded(copy)
        truncated += int((kept > trunc).sum())
        padding += int(pad.sum() - copy.sum())
        padded[n:n + kept.size] = pad
        if kept.size != full.size:
            dropped.append(base + np.flatnonzero(drop))
        n += kept.size
        base += full.size
    gone = np.concatenate(dropped) if dropped else np.empty(0, np.int64)
    return Kept(padded[:n], gone, truncated, padding, skipped, first, cut_total)


@numba.njit(cache=True)
def cut_turns(src_mask, src_start, first_trained, trunc, cut, untrainable_if_dropped):
    """For each truncated sequence k: ``cut[k]`` when the cut at ``trunc`` falls inside a trained
    run (an assistant turn loses its end), and ``untrainable_if_dropped[k]`` when that run is
    the sequence's first trained one (masking it would leave nothing trained)."""
    for k in range(src_start.shape[0]):
        s = src_start[k]
        cut[k] = src_mask[s + trunc - 1] != 0
        untrainable_if_dropped[k] = False
        if cut[k]:
            j = trunc - 1
            while j >= first_trained[k] and src_mask[s + j] != 0:
                j -= 1
            untrainable_if_dropped[k] = j < first_trained[k]



def _cut_turns(store: SequenceStore, k: int, rows: np.ndarray, truncated: np.ndarray, trunc: int,
               required: bool = True):
    """Over partition ``k``'s rows: which truncated conversations are cut inside a trained turn,
    and which would train nothing once that turn is masked (``--truncated-turn-loss drop``).
    Reads one mask byte per truncated conversation (a little more when a turn is cut). A store of
    lengths only (``bench/plan.py``'s) counts nothing unless the answer changes the plan (``required``)."""
    cut = np.zeros(rows.size, dtype=np.bool_)
    untrainable = np.zeros(rows.size, dtype=np.bool_)
    which = np.flatnonzero(truncated)
    try:
        ds = store.part(k) if which.size else None
    except ShardNotFoundError:
        if required:
            raise
        ds = None
    if ds is None:
        return cut, untrainable
    starts = np.asarray(ds.sequence_pointers[which]) // ds.dtype.itemsize
    first = np.asarray(rows["first_trained"][which], dtype=np.int64)
    c = np.empty(which.size, dtype=np.bool_)
    u = np.empty(which.size, dtype=np.bool_)
    cut_turns(ds.arrays().loss_mask, starts.astype(np.int64), first, int(trunc), c, u)
    ds.release_pages()
    cut[which], untrainable[which] = c, u
    return cut, untrainable


def store_ids(kept: np.ndarray, dropped: np.ndarray) -> np.ndarray:
    """Store ids of kept-conversation indices: kept ``k`` is store id ``k`` plus the number of
    dropped ids before it (8 bytes per dropped conversation instead of a map of all of them)."""
    if dropped.size == 0:
        return kept
    kept_before = dropped - np.arange(dropped.size)  # kept conversations before each dropped one
    return kept + np.searchsorted(kept_before, kept, side="right")


# --------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class PlanStep:
    """Unit 0: plan the whole store into ``path``; the receipt carries the plan's summary."""

    store_dir: str
    settings: PlanSettings
    path: str
    book: ReceiptBook
    files: Files = LOCAL
    name: str = "plan"

    @property
    def writes_to(self) -> str:
        return self.path

    def reads(self, unit: int) -> List[str]:
        """The store's rows (a store in object storage: the task pulls them alone)."""
        return rows_paths(self.store_dir)

    def run(self, unit: int) -> dict:
        store = SequenceStore(self.store_dir, files=self.files)
        metadata = write_plan(store, self.settings, self.path)
        t = time.perf_counter()
        PackPlan(self.path, verify=False).validate(store)   # (a bug guard: cheap, bench/stages.py measures it)
        receipt = self.book.write(unit, plan_summary(metadata), [self.path], pinned=[self.path])
        return dict(receipt, validate_seconds=time.perf_counter() - t)   # (to the driver, not in the receipt)


@dataclass(frozen=True)
class VerifyPlanStep:
    """Unit 0: :func:`plan_problem` of an earlier attempt's plan where the unit runs (a work
    directory in object storage: the task pulls the plan and the store's rows, the driver gets
    the verdict ``{"unit": 0, "problem": ...}``)."""

    receipts: ReceiptBook
    path: str
    store_dir: Union[str, Tuple[str, ...]]   # the store, or a mixture's stores (with ``names``)
    settings: PlanSettings
    files: Files = LOCAL
    name: str = "verify-plan"
    names: Tuple[str, ...] = ()

    @property
    def writes_to(self) -> str:
        return self.path

    def reads(self, unit: int) -> List[str]:
        dirs = [self.store_dir] if isinstance(self.store_dir, str) else list(self.store_dir)
        return [self.path] + [p for d in dirs for p in rows_paths(d)]

    def run(self, unit: int) -> dict:
        receipt = self.receipts.read(0)
        why = "no plan receipt" if receipt is None else plan_problem(
            receipt, self.receipts, self.path, open_stores(self.store_dir, self.names, self.files), self.settings)
        return {"unit": unit, "problem": why}


def plan_schema(doc) -> None:
    """The plan receipt's own fields (the rest is compared with the plan file's strict metadata)."""
    doc.int("conversations", lo=0)
    doc.list("splits")


_RECEIPT_KEYS = ("step", "unit", "key", "artifacts", "crc32")


def resumed_plan(book: ReceiptBook, verdict: Callable[[], str]) -> Optional[dict]:
    """The plan receipt of an earlier attempt when the plan file verifies (pinned CRC-32, the
    receipt equal to the file's metadata, the settings, every array valid against the store:
    ``verdict()``, made by the engine as :class:`VerifyPlanStep`, '' when it verifies), else
    None, its receipt discarded (logged: the plan is made again)."""
    receipt = book.read(0)
    if receipt is None:
        return None
    why = verdict()
    if why:
        log.warning("the pack plan does not verify; planning again: %s", why)
        book.discard(0)
        return None
    return receipt


def plan_problem(receipt: dict, book: ReceiptBook, path: str, store: SequenceStore, settings: PlanSettings) -> str:
    """'' when the plan file ``path`` verifies against its receipt (see :func:`resumed_plan`),
    else why not."""
    try:
        book.verify(receipt, REDO_HINT)
        plan = PackPlan(path)
        recorded = {k: v for k, v in receipt.items() if k not in _RECEIPT_KEYS}
        if normal_json(plan_summary(plan.metadata)) != normal_json(recorded):
            raise HeaderError("the plan receipt disagrees with the plan file", path=book.path(0), field="splits")
        if plan.settings != settings:
            raise HeaderError("the plan was made with other settings", path=path, field="settings")
        plan.validate(store)
    except ShardError as exc:
        return str(exc)
    return ""


def plan_summary(metadata: dict) -> dict:
    """What the plan receipt records: the plan's metadata without the arrays' locations."""
    summary = {k: v for k, v in metadata.items() if k != "splits"}
    summary["splits"] = [{k: v for k, v in sp.items() if k != "arrays"} for sp in metadata["splits"]]
    return summary


def write_plan(store: SequenceStore, s: PlanSettings, path: str) -> dict:
    """Plan ``store`` with settings ``s`` into the plan file ``path``; returns its metadata.

    Raises:
        ShardError: nothing survived (every conversation skipped); InputError: see :func:`load_kept`.
    """
    kept = load_kept(store, s)
    n = kept.padded.size
    if n == 0:
        raise _nothing_survived(store, kept)
    kept.split_of = split_assignment(n, s.split, s.seed)
    counts = [n] if kept.split_of is None else split_sizes(n, s.split)
    kept.id_dtype = "int32" if index_dtype(store.sequence_count) == np.int32 else "int64"
    writer = PlanWriter(path)
    planned: Dict[int, dict] = {}
    try:
        # smallest split first: the largest is packed last, after the kept lengths are released
        by_size = sorted((i for i in range(len(counts)) if counts[i]), key=lambda i: counts[i])
        for i in by_size:
            planned[i] = _plan_split(writer, kept, s, i, int(counts[i]), last=i == by_size[-1])
        splits = [planned[i] for i in sorted(planned)]
        # e.g. a 1% split of a tiny dataset: reported, not written
        empty = [name for i, name in enumerate(s.split_names) if not counts[i]]
        meta = {"format": PLAN_FORMAT, "settings": s.to_dict(),
                "store": {"store_id": store.store_id, "sequences": store.sequence_count},
                "conversations": n, "truncated": kept.truncated, "truncated_turns_cut": kept.cut_turns,
                "padding_tokens": kept.padding_tokens,
                "skipped": kept.skipped, "first_skipped": kept.first_skipped,
                "splits": splits, "empty_splits": empty}
        writer.close(meta)
    except BaseException:
        writer.abort()
        raise
    return meta


def _nothing_survived(store: SequenceStore, kept: Kept) -> ShardError:
    """Every record skipped: the error counts them by reason (tokenize and plan stages alike) and
    quotes the first of the most frequent."""
    skipped, first = merged_skips(store, {"skipped": kept.skipped, "first_skipped": kept.first_skipped})
    top = max(skipped, key=skipped.get) if skipped else None
    example = f"; the first: {first[top]}" if top in first else ""
    return ShardError(f"no conversation survived preprocessing; nothing to write (skipped: {skipped_text(skipped)})",
                      path=store.directory, hint=f"fix the inputs or the settings{example}")


def _plan_split(writer: PlanWriter, kept: Kept, s: PlanSettings, which: int, count: int, last: bool) -> dict:
    """Pack split ``which`` (``count`` conversations) and append its arrays to the plan. Peak
    memory: the split's padded lengths and split ids, the packer's order and bin ids (int32
    each) and its per-bin tree; the ``last`` split releases the kept lengths once it has copied
    its own."""
    split_of = kept.split_of
    padded = kept.padded if split_of is None else _split_members(split_of, which, count, kept.padded)
    if last:
        kept.padded = None
    a = pack_lengths_csr(padded, s.pack_size, s.algorithm, s.seed)
    summary = packing_summary(a, padded)
    del padded
    starts = _plan_shards_csr(a.loads, a.offsets, s.itemsize, s.max_packs_per_shard, s.max_shard_bytes)
    members = None if split_of is None else _split_members(split_of, which, count)

    def ids():
        for lo in range(0, a.items.size, _CHUNK):
            chunk = a.items[lo:lo + _CHUNK]
            yield store_ids(chunk if members is None else members[chunk], kept.dropped)

    arrays = {"shard_starts": writer.array(starts, "int64"),
              "pack_offsets": writer.array(a.offsets, "int64"),
              "pack_loads": writer.array(a.loads, "int32"),
              "sequence_ids": writer.array_chunks(ids(), kept.id_dtype)}
    return {"name": s.split_names[which], "conversations": int(a.items.size), "packs": a.n_bins, "shards": int(starts.size - 1),
            "packing_efficiency": summary["efficiency"],
            "bins_over_lower_bound": summary["bins_over_lower_bound"], "arrays": arrays}
