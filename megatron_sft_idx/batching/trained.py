"""Trained tokens: how many positions each consumer trains, per sequence and per pack, and per
planned step, micro-batch and rank.

A shard stores one label-aligned loss mask; a consumer trains a position of a sequence
``[start, end)`` when it reads it (``start <= j < end - 1``: no label crosses a sequence) and
its rule keeps it (docs/TRAINING.md, "Which positions each consumer trains"). Two rules cover
the consumers the adapters serve:

* :data:`STORED` — the stored mask: Megatron-LM's ``SFTIndexedDataset`` (the mask as stored;
  the last position of every sequence is 0, a format invariant), Megatron-Bridge ``main``
  (``"next"``, ``"pr5610"``) under ``answer_only_loss``, TRL / transformers padding-free
  (``labels[..., 1:] != -100``, what transformers counts as ``num_items_in_batch``);
* :data:`BRIDGE_06` — the stored mask, 0 where the input token is EOS: Megatron-Bridge 0.6's
  collate (needs the EOS id).

:func:`trained_counts` reads ``.loss.bin`` (and ``.bin`` for :data:`BRIDGE_06`) a chunk of
packs at a time (bounded memory) and returns :class:`TrainedCounts`: every sequence's count per
rule, from which a pack's count and its number of trained sequences follow. :func:`step_table`
sums per-pack values over the positions of a sample stream laid out by Megatron's sampler
(:mod:`.layout`): ``[step, micro-batch, rank]``, what a planned order records as its
denominators (:mod:`.order`). :func:`cp_sequence_counts` splits each sequence's trained tokens
over context-parallel ranks as each trainer splits them (for the audit, :mod:`.audit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from ..errors import ShardError
from .layout import Topology

__all__ = ["STORED", "BRIDGE_06", "RULES", "CONSUMER_RULES", "TrainedCounts", "trained_counts", "step_table",
           "cp_sequence_counts", "LAYOUT_MEGATRON", "LAYOUT_BRIDGE", "CHUNK_TOKENS"]

STORED = "stored"
BRIDGE_06 = "bridge-0.6"
RULES = (STORED, BRIDGE_06)
#: The rule whose count each adapter serves (``bridge_semantics`` for Bridge; TRL's ``answer_only_loss``).
CONSUMER_RULES = {"megatron-lm": STORED, "megatron-bridge-0.6": BRIDGE_06, "megatron-bridge-next": STORED,
                  "megatron-bridge-pr5610": STORED, "trl-padding-free": STORED}
#: How a trainer cuts a sequence for context parallelism: Megatron-LM splits each stored
#: sequence (the pack's last one runs to ``seq_length``); Bridge each runtime segment (``L - 1``).
LAYOUT_MEGATRON, LAYOUT_BRIDGE = "megatron", "bridge"
#: Tokens read per chunk (whole packs; at least one pack).
CHUNK_TOKENS = 1 << 22


@dataclass
class TrainedCounts:
    """Trained positions of every sequence, per rule, over a source's packs in order.

    Attributes:
        sequence_offsets: int64 ``[num_packs + 1]``: pack ``p`` holds sequences
            ``sequence_offsets[p] .. sequence_offsets[p + 1] - 1``.
        sequence: ``{rule: int32[num_sequences]}``, the trained positions of each sequence.
        eos_id: the EOS id :data:`BRIDGE_06` was counted with (None: that rule is absent).
    """

    sequence_offsets: np.ndarray
    sequence: Dict[str, np.ndarray]
    eos_id: Optional[int] = None
    _packs: Dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_packs(self) -> int:
        return int(self.sequence_offsets.shape[0]) - 1

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_offsets[-1])

    @property
    def rules(self) -> Tuple[str, ...]:
        return tuple(r for r in RULES if r in self.sequence)

    @classmethod
    def concat(cls, parts) -> "TrainedCounts":
        """The counts of several sources' packs, one after the other (a set's global pack index).

        Raises:
            ShardError: no parts, or parts counted under other rules or EOS ids.
        """
        parts = list(parts)
        if not parts or any(p.rules != parts[0].rules or p.eos_id != parts[0].eos_id for p in parts):
            raise ShardError("trained-token counts to concatenate must exist and share their rules and EOS id",
                             field="trained", actual=[(p.rules, p.eos_id) for p in parts])
        per_pack = np.concatenate([np.diff(p.sequence_offsets) for p in parts])
        return cls(sequence_offsets=np.concatenate(([0], np.cumsum(per_pack))).astype(np.int64),
                   sequence={r: np.concatenate([p.sequence[r] for p in parts]) for r in parts[0].rules},
                   eos_id=parts[0].eos_id)

    def require(self, rule: str, path: Optional[str] = None) -> np.ndarray:
        """The per-sequence counts of ``rule``.

        Raises:
            ShardError: the rule was not counted (Bridge 0.6's needs an EOS id).
        """
        if rule not in self.sequence:
            raise ShardError(f"trained tokens were not counted under the {rule!r} rule", path=path, field="trained",
                             expected=rule, actual=list(self.rules),
                             hint="count them with the EOS id (plan-batches --eos-id) for Megatron-Bridge 0.6")
        return self.sequence[rule]

    def pack(self, rule: str) -> np.ndarray:
        """int64 ``[num_packs]``: the trained positions of each pack under ``rule``."""
        if rule not in self._packs:
            cum = np.concatenate(([0], np.cumsum(self.require(rule), dtype=np.int64)))
            self._packs[rule] = cum[self.sequence_offsets[1:]] - cum[self.sequence_offsets[:-1]]
        return self._packs[rule]

    def pack_sequences(self, rule: str) -> np.ndarray:
        """int64 ``[num_packs]``: how many sequences of each pack train at least one position."""
        cum = np.concatenate(([0], np.cumsum(self.require(rule) > 0, dtype=np.int64)))
        return cum[self.sequence_offsets[1:]] - cum[self.sequence_offsets[:-1]]


def _shards(source):
    """The shards of an ``MMapIndexedDataset`` or a ``MultiShardDataset``, in pack order."""
    shard = getattr(source, "shard", None)
    prefixes = getattr(source, "prefixes", None)
    if shard is not None and prefixes is not None:
        return [shard(k) for k in range(len(prefixes))]
    if getattr(source, "arrays", None) is None:
        raise ShardError(f"cannot read loss masks from a {type(source).__name__}", field="source",
                         hint="give an MMapIndexedDataset or a MultiShardDataset")
    return [source]


def _chunks(shard) -> Iterator[tuple]:
    """Per chunk of whole packs: ``(first pack, tokens, loss, sequence starts and ends relative to
    the chunk, each sequence's pack relative to the chunk, pack starts relative to the chunk)``."""
    a = shard.arrays()
    lengths = np.asarray(a.sequence_lengths, dtype=np.int64)   # (a shard's "sequences" are its packs)
    offsets = np.asarray(a.seq_offsets, dtype=np.int64)
    token_off = np.concatenate(([0], np.cumsum(lengths)))
    lo = 0
    while lo < lengths.shape[0]:
        hi = max(lo + 1, int(np.searchsorted(token_off, token_off[lo] + CHUNK_TOKENS, side="right")) - 1)
        hi = min(hi, lengths.shape[0])
        t0, t1 = int(token_off[lo]), int(token_off[hi])
        counts = np.diff(offsets[lo:hi + 1])
        pack_of = np.repeat(np.arange(hi - lo), counts)
        base = token_off[lo:hi] - t0
        starts = base[pack_of] + np.asarray(a.seq_starts[offsets[lo]:offsets[hi]], dtype=np.int64)
        is_last = np.zeros(starts.shape[0], dtype=bool)
        is_last[np.cumsum(counts)[counts > 0] - 1] = True
        ends = np.where(is_last, (base + lengths[lo:hi])[pack_of], np.append(starts[1:], 0))
        yield lo, np.asarray(a.tokens[t0:t1]), np.asarray(a.loss_mask[t0:t1]), starts, ends, pack_of, base
        shard.release_pages()
        lo = hi


def _read_counts(cum: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per sequence, the sum over its read positions ``[start, end - 1)`` of a 0/1 array with
    cumulative sum ``cum`` (leading 0)."""
    last = np.maximum(ends - 1, starts)
    return (cum[last] - cum[starts]).astype(np.int32)


def trained_counts(source, *, eos_id: Optional[int] = None) -> TrainedCounts:
    """Every sequence's trained positions under :data:`STORED`, and under :data:`BRIDGE_06` with
    ``eos_id`` (module doc), over the packs of a shard or a multi-shard view, in pack order.

    Raises:
        ShardError: a source without loss masks to read (not a shard), an unreadable shard.
    """
    stored_parts, eos_parts, seq_counts = [], [], []
    for shard in _shards(source):
        seq_counts.append(np.diff(np.asarray(shard.arrays().seq_offsets, dtype=np.int64)))
        for _, tokens, loss, starts, ends, _, _ in _chunks(shard):
            kept = loss != 0
            stored_parts.append(_read_counts(np.concatenate(([0], np.cumsum(kept, dtype=np.int64))), starts, ends))
            if eos_id is not None:
                kept &= tokens != eos_id
                eos_parts.append(_read_counts(np.concatenate(([0], np.cumsum(kept, dtype=np.int64))), starts, ends))
    per_pack = np.concatenate(seq_counts) if seq_counts else np.empty(0, np.int64)
    offsets = np.concatenate(([0], np.cumsum(per_pack))).astype(np.int64)
    sequence = {STORED: _joined(stored_parts)}
    if eos_id is not None:
        sequence[BRIDGE_06] = _joined(eos_parts)
    return TrainedCounts(sequence_offsets=offsets, sequence=sequence, eos_id=None if eos_id is None else int(eos_id))


def _joined(parts) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)


def cp_sequence_counts(source, cp: int, *, layout: str, rule: str = STORED, eos_id: Optional[int] = None,
                       seq_length: Optional[int] = None) -> np.ndarray:
    """int32 ``[num_sequences, cp]``: each sequence's trained positions on each context-parallel
    rank, split as the trainer splits it: every segment cut into ``2 * cp`` equal chunks, rank
    ``r`` taking chunks ``r`` and ``2 * cp - 1 - r`` (Transformer Engine's
    ``thd_get_partitioned_indices``, which both megatron-core's and Bridge's packed CP batches use).

    ``layout`` :data:`LAYOUT_MEGATRON`: a segment is a stored sequence, the pack's last one running
    to ``seq_length`` (Megatron-LM's ``cu_seqlens``; default: the pack's own length);
    :data:`LAYOUT_BRIDGE`: a segment is a sequence's ``L - 1`` runtime positions.

    Raises:
        ShardError: ``cp`` below 1, an unknown layout or rule, a rule without ``eos_id``, or a
            segment that is not a multiple of ``2 * cp`` (naming the shard and pack): the trainer
            cannot split it (pad the data for this CP size: ``--pad-seq-to-mult``).
    """
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ShardError("context-parallel size must be an integer >= 1", field="cp", actual=cp)
    if layout not in (LAYOUT_MEGATRON, LAYOUT_BRIDGE) or rule not in RULES or (rule == BRIDGE_06 and eos_id is None):
        raise ShardError("cp_sequence_counts needs a known layout and rule (Bridge 0.6's with an EOS id)",
                         field="layout", actual=(layout, rule, eos_id))
    out = []
    for shard in _shards(source):
        for first, tokens, loss, starts, ends, pack_of, base in _chunks(shard):
            kept = loss != 0
            if rule == BRIDGE_06:
                kept &= tokens != eos_id
            seg = ends - starts - (1 if layout == LAYOUT_BRIDGE else 0)
            if layout == LAYOUT_MEGATRON and seq_length is not None:   # the last segment runs to seq_length
                last = np.append(pack_of[1:] != pack_of[:-1], True)
                seg = np.where(last, base[pack_of] + int(seq_length) - starts, seg)
            bad = np.flatnonzero((seg % (2 * cp) != 0) & (seg > 0))
            if cp > 1 and bad.size:
                s = int(bad[0])
                raise ShardError(f"sequence {s - int(np.searchsorted(pack_of, pack_of[s]))} of pack "
                                 f"{first + int(pack_of[s])} is a segment of {int(seg[s])} positions, not a multiple "
                                 f"of 2 * CP = {2 * cp}: the trainer cannot split it over {cp} context-parallel ranks",
                                 path=getattr(shard, "prefix", None), pack=first + int(pack_of[s]),
                                 field="pad_seq_to_mult", expected=f"a multiple of {2 * cp}", actual=int(seg[s]),
                                 hint="re-pack the data padded for this CP size (--pad-seq-to-mult, and --pad-layout "
                                      f"{'runtime' if layout == LAYOUT_BRIDGE else 'stored'})")
            idx = np.flatnonzero(kept)
            sid = np.searchsorted(starts, idx, side="right") - 1
            read = idx < ends[sid] - 1   # (every trainer reads [start, end - 1) of a sequence)
            idx, sid = idx[read], sid[read]
            if cp == 1:
                rank = np.zeros_like(idx)
            else:   # (every segment is a multiple of 2 * cp here: chunks of at least one position)
                k = (idx - starts[sid]) // (seg[sid] // (2 * cp))
                rank = np.where(k < cp, k, 2 * cp - 1 - k)
            out.append(np.bincount(sid * cp + rank, minlength=starts.shape[0] * cp).reshape(-1, cp).astype(np.int32))
    return np.concatenate(out) if out else np.empty((0, cp), np.int32)


def step_table(stream, values, topology: Topology, start: int = 0) -> np.ndarray:
    """int64 ``[steps, micro-batches, dp]``: per complete step of a sample stream, the sum of
    ``values[pack]`` over each micro-batch of each rank (Megatron's sampler layout, :mod:`.layout`).

    ``stream[t]`` is the pack at global position ``start + t``; steps not wholly inside the stream
    are left out (the samplers drop an incomplete step).
    """
    stream = np.asarray(stream, dtype=np.int64)
    values = np.asarray(values, dtype=np.int64)
    dp, mbs, gbs = topology.data_parallel_size, topology.micro_batch_size, topology.global_batch_size
    first = -(-int(start) // gbs)
    last = (int(start) + stream.shape[0]) // gbs
    steps = max(0, last - first)
    micro = topology.num_microbatches
    if steps == 0:
        return np.zeros((0, micro, dp), dtype=np.int64)
    lo = first * gbs - int(start)
    part = values[stream[lo:lo + steps * gbs]].reshape(steps, micro, dp, mbs)
    return part.sum(axis=3, dtype=np.int64)
