"""Megatron-Bridge's packed batch, built with whole-batch numpy operations.

Input: a list of Bridge packed samples ``{"input_ids", "seq_boundaries",
"loss_mask"}`` (what :class:`~megatron_sft_idx.training.bridge.PackedSFTDataset`
returns). Output: the dict Megatron-Bridge's ``GPTSFTPackedDataset.collate_fn``
returns (tested against the installed Megatron-Bridge 0.6.2, key for key, value,
dtype and shape: ``tests/compat/test_bridge_parity.py``). The rules, as Bridge
applies them:

* a sequence of ``L`` stored tokens ``[b, b+L)`` contributes ``L - 1`` runtime
  positions: input ``ids[b : b+L-1]``, label ``ids[b+1 : b+L]``, loss
  ``loss_mask[b : b+L-1]`` (label-aligned), positions ``0 .. L-2``; so no label
  crosses a sequence boundary and each sequence's last stored position is never read;
* ``eos_id`` is Bridge's tokenizer EOS: rows are padded with it (tokens and labels),
  loss 0 and position 0; and **loss is zeroed wherever the input token is EOS**;
* ``answer_only_loss=False`` trains every position whose input is not EOS;
* ``token_count``: each row's runtime length (a list of ints);
* rows are ``max_seq_length`` long with ``pad_to_max_length``, else the longest row
  rounded up to ``pad_seq_length_to_mult``, capped at ``max_seq_length``;
* ``pad_seq_to_mult == 1``: ``cu_seqlens_q/kv`` are the cumulative runtime lengths,
  plus ``max_length`` when the row is shorter (trailing padding is its own segment);
* ``pad_seq_to_mult > 1`` (context parallelism; Bridge's packer padded every *runtime*
  segment to the multiple): ``cu_seqlens_q/kv_padded`` are the physical boundaries
  (cumulative runtime lengths, then ``max_length``); ``cu_seqlens_q/kv`` the logical
  ones, each sequence ending at its last non-EOS input token (cumulative logical
  lengths; one repeated entry where the padded list is longer);
* ``pad_cu_seqlens`` extends every row with zero-length segments to
  ``max_samples_per_bin + 2`` entries (a static shape for CUDA graphs), and
  ``max_seqlen_q/kv`` become one static value per row, shape ``(B,)``:
  ``max(dataset_max_seqlen, max_length - min_packed_seqlen)`` in Bridge's runtime
  units (:class:`BridgePackingStats`); otherwise ``max_seqlen`` is each row's longest
  (physical) segment, shape ``(B, 1)``;
* rows of one batch are equalised with zero-length segments; ``attention_mask`` is None;
* ``return_cu_seqlen=False``: no boundaries, a dense causal ``attention_mask``
  ``(B, 1, L, L)`` (True = masked) instead;
* not Bridge's: items that carry ``step_trained_tokens`` (a balanced order's step count,
  :mod:`megatron_sft_idx.batching.denominators`) give the batch that key, a 0-d int64 (every
  micro-batch lies in one step).

Three versions of these rules (``bridge_semantics``; default: the installed Megatron-Bridge's,
:func:`installed_bridge_semantics`, which never picks ``"pr5610"``):

* ``"0.6"``: Megatron-Bridge 0.6.x, as above (tested against the installed 0.6.2);
* ``"next"``: Megatron-Bridge ``main`` (0.7.0 in the making; tested against the batches its
  own ``collate_fn`` computed at commit ``067f987d``, ``tests/golden/bridge_next/``): under
  ``answer_only_loss`` the stored mask is used **as is** (no zeroing at EOS inputs; PR
  #5213; ``answer_only_loss=False`` still zeroes them), and every batch carries
  ``padding_mask`` (bool ``(B, max_length)``, True on padding; PR #5470): positions past a
  row's ``token_count``, or, with ``pad_seq_to_mult > 1``, each segment's physical tail past
  its logical length (alignment padding and the trailing segment);
* ``"pr5610"``: ``"next"`` plus Bridge PR #5610 as its head ``8d95ff4c`` (2026-08-17) had it
  (tested against the batches that head's ``collate_fn`` computed, ``tests/golden/bridge_pr5610/``;
  the code finally merged could not be read and may differ): with ``pad_seq_to_mult > 1`` a
  sequence's logical length ends at its last input that is not a zero-loss EOS (the item's
  stored mask: a supervised terminal EOS stays in the sequence), and every batch carries
  ``pad_between_seqs``, a Python bool: whether any row's logical boundaries (after the
  ``pad_cu_seqlens`` extension, before rows are equalised) differ from its physical ones;
  always False with ``pad_seq_to_mult == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import List, Optional, Sequence

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402  (the [train] extra, as torch)

from ..batching.denominators import STEP_TOKENS_KEY
from ..errors import ShardError

__all__ = ["PackedCollator", "BridgePackingStats", "collate_fn", "BRIDGE_SEMANTICS", "installed_bridge_semantics",
           "resolve_bridge_semantics"]

#: The Megatron-Bridge collate versions served: 0.6.x, ``main`` (the next release), and ``main``
#: with PR #5610 as its 2026-08-17 head had it (only ever chosen explicitly).
BRIDGE_06, BRIDGE_NEXT, BRIDGE_PR5610 = "0.6", "next", "pr5610"
BRIDGE_SEMANTICS = (BRIDGE_06, BRIDGE_NEXT, BRIDGE_PR5610)
#: The first Megatron-Bridge version whose packed collate follows ``"next"`` (main's package version).
NEXT_FROM = "0.7.0.dev0"


def installed_bridge_semantics() -> str:
    """``"next"`` when the installed Megatron-Bridge is 0.7 or newer (or a pre-release of it),
    else ``"0.6"`` (also when none is installed). Reads the package metadata; imports nothing.
    Never ``"pr5610"``: no released version is known to carry that collate."""
    try:
        version = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return BRIDGE_06
    try:
        return BRIDGE_NEXT if Version(version) >= Version(NEXT_FROM) else BRIDGE_06
    except InvalidVersion:
        return BRIDGE_06


def resolve_bridge_semantics(value: Optional[str]) -> str:
    """``value`` checked, or the installed Bridge's semantics for None.

    Raises:
        ShardError: a value other than ``"0.6"`` / ``"next"`` / ``"pr5610"``.
    """
    if value is None:
        return installed_bridge_semantics()
    if value not in BRIDGE_SEMANTICS:
        raise ShardError("unknown Megatron-Bridge collate semantics", field="bridge_semantics",
                         expected=" or ".join(repr(v) for v in BRIDGE_SEMANTICS), actual=value,
                         hint="pass \"0.6\" for Megatron-Bridge 0.6.x, \"next\" for its main branch, "
                              "\"pr5610\" for main with PR #5610 as its 2026-08-17 head had it")
    return value


@dataclass(frozen=True)
class BridgePackingStats:
    """The packing statistics Bridge's ``pad_cu_seqlens`` reads, in Bridge's (runtime) units.

    ``dataset_max_seqlen``: the longest sequence minus one; ``min_packed_seqlen``: the
    shortest pack's runtime length (stored length minus its sequence count);
    ``max_samples_per_bin``: the most sequences in one pack. Bridge takes the max/min
    of each over every entry of its metadata file.
    """

    max_samples_per_bin: int
    dataset_max_seqlen: int
    min_packed_seqlen: int

    @classmethod
    def combine(cls, parts) -> "BridgePackingStats":
        parts = list(parts)
        return cls(max(p.max_samples_per_bin for p in parts), max(p.dataset_max_seqlen for p in parts),
                   min(p.min_packed_seqlen for p in parts))

    @classmethod
    def from_bridge_metadata(cls, entries, path: Optional[str] = None) -> "BridgePackingStats":
        """From the list Bridge's ``prepare_gpt_sft_packed_data`` writes to its metadata JSON."""
        keys = ("max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen")
        ok = isinstance(entries, list) and entries and all(
            isinstance(e, dict) and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool)
                                        for k in keys) for e in entries)
        if not ok:
            raise ShardError("not a Megatron-Bridge packing metadata list", path=path, field="metadata",
                             expected=f"[{{{', '.join(keys)}: int, ...}}, ...]",
                             hint="pass the packed_metadata_path JSON Bridge wrote with the packs")
        return cls.combine(cls(*(e[k] for k in keys)) for e in entries)


def _ceil_to(n: int, mult: int) -> int:
    return -(-n // mult) * mult


class PackedCollator:
    """Callable ``batch -> Bridge packed batch`` with Bridge's options.

    Args:
        max_seq_length: Bridge's ``max_seq_length`` (the packed sequence size).
        eos_id: the tokenizer's EOS id (Bridge pads with it and zeroes loss on it).
        pad_to_max_length, pad_seq_length_to_mult, pad_seq_to_mult, pad_cu_seqlens,
        return_cu_seqlen, answer_only_loss: Bridge's options of the same names.
        stats: :class:`BridgePackingStats`, required with ``pad_cu_seqlens``.
        bridge_semantics: ``"0.6"``, ``"next"`` or ``"pr5610"`` (module doc); None: the
            installed Bridge's (``"0.6"`` or ``"next"``).

    Raises:
        ShardError: inconsistent options, an unknown ``bridge_semantics``, or a row longer
            than ``max_seq_length``.
    """

    def __init__(self, max_seq_length: int, *, eos_id: int, pad_to_max_length: bool = False,
                 pad_seq_length_to_mult: int = 16, pad_seq_to_mult: int = 1,
                 pad_cu_seqlens: bool = False, stats: Optional[BridgePackingStats] = None,
                 return_cu_seqlen: bool = True, answer_only_loss: bool = True,
                 bridge_semantics: Optional[str] = None) -> None:
        if pad_cu_seqlens and not pad_to_max_length:
            raise ShardError("pad_cu_seqlens requires pad_to_max_length=True (as in Megatron-Bridge)",
                             field="pad_cu_seqlens")
        if pad_cu_seqlens and stats is None:
            raise ShardError("pad_cu_seqlens needs the packing statistics of the source",
                             field="pad_cu_seqlens", hint="pass stats=BridgePackingStats(...)")
        if max_seq_length < 1 or pad_seq_to_mult < 1 or pad_seq_length_to_mult < 1:
            raise ShardError("lengths and multiples must be positive", field="max_seq_length",
                             actual=(max_seq_length, pad_seq_to_mult, pad_seq_length_to_mult))
        self.max_seq_length = int(max_seq_length)
        self.eos_id = int(eos_id)
        self.pad_to_max_length = bool(pad_to_max_length)
        self.pad_seq_length_to_mult = int(pad_seq_length_to_mult)
        self.pad_seq_to_mult = int(pad_seq_to_mult)
        self.pad_cu_seqlens = bool(pad_cu_seqlens)
        self.stats = stats
        self.return_cu_seqlen = bool(return_cu_seqlen)
        self.answer_only_loss = bool(answer_only_loss)
        self.bridge_semantics = resolve_bridge_semantics(bridge_semantics)

    def static_max_seqlen(self, max_length: int) -> int:
        """Bridge's ``pad_cu_seqlens`` value: ``max(dataset_max_seqlen, max_length - min_packed_seqlen)``."""
        return max(self.stats.dataset_max_seqlen, max_length - self.stats.min_packed_seqlen)

    def _max_length(self, longest: int) -> int:
        if self.pad_to_max_length:
            max_length = self.max_seq_length
        else:
            max_length = min(self.max_seq_length, _ceil_to(longest, self.pad_seq_length_to_mult))
        if longest > max_length:
            raise ShardError("a pack is longer than max_seq_length", field="max_seq_length",
                             expected=f"<= {max_length} runtime tokens (each sequence drops its last)",
                             actual=longest, hint="raise max_seq_length to the packed sequence size")
        return max_length

    def __call__(self, batch: Sequence[dict]) -> dict:
        if not batch:
            raise ShardError("cannot collate an empty batch", field="batch")
        ids_parts = [np.asarray(item["input_ids"]) for item in batch]
        loss_parts = [np.asarray(item["loss_mask"]) for item in batch]
        bounds = [np.asarray(item["seq_boundaries"], dtype=np.int64) for item in batch]
        n_rows = len(batch)
        pack_len = np.fromiter((p.shape[0] for p in ids_parts), np.int64, n_rows)
        n_seqs = np.fromiter((b.shape[0] - 1 for b in bounds), np.int64, n_rows)
        pack_off = np.concatenate(([0], np.cumsum(pack_len)))

        ids = np.concatenate(ids_parts).astype(np.int64, copy=False)
        loss = np.concatenate(loss_parts).astype(np.int64, copy=False)
        # Every sequence of the batch: global start, stored length, and its row.
        seq_row = np.repeat(np.arange(n_rows), n_seqs)
        starts = np.concatenate([b[:-1] for b in bounds]) + pack_off[seq_row]
        lengths = np.concatenate([np.diff(b) for b in bounds])
        seg = lengths - 1  # runtime positions per sequence
        kept = np.repeat(starts, seg) + _ranges(seg)  # every runtime position, in order
        sid = np.repeat(np.arange(seg.shape[0]), seg)
        local = kept - starts[sid]

        row_count = pack_len - n_seqs  # Bridge's token_count
        max_length = self._max_length(int(row_count.max()))
        row_off = np.concatenate(([0], np.cumsum(row_count)))
        flat = seq_row[sid] * max_length + (np.arange(kept.shape[0]) - row_off[seq_row[sid]])

        tokens = np.full(n_rows * max_length, self.eos_id, dtype=np.int64)
        labels = np.full(n_rows * max_length, self.eos_id, dtype=np.int64)
        loss_out = np.zeros(n_rows * max_length, dtype=np.int64)
        positions = np.zeros(n_rows * max_length, dtype=np.int64)
        tokens[flat] = ids[kept]
        labels[flat] = ids[kept + 1]
        loss_out[flat] = loss[kept] if self.answer_only_loss else 1
        if not self.answer_only_loss or self.bridge_semantics == BRIDGE_06:
            loss_out[tokens == self.eos_id] = 0  # EOS (and padding) inputs carry no loss
        positions[flat] = local

        out = {
            "tokens": torch.from_numpy(tokens.reshape(n_rows, max_length)),
            "labels": torch.from_numpy(labels.reshape(n_rows, max_length)),
            "loss_mask": torch.from_numpy(loss_out.reshape(n_rows, max_length)),
            "position_ids": torch.from_numpy(positions.reshape(n_rows, max_length)),
            "token_count": [int(c) for c in row_count],
        }
        if all(STEP_TOKENS_KEY in item for item in batch):   # served with a balanced order's counts
            out[STEP_TOKENS_KEY] = torch.tensor(max(int(item[STEP_TOKENS_KEY]) for item in batch), dtype=torch.int64)
        if "source_ids" in batch[0]:   # (a mixture's data: each runtime position's source, -1 on padding)
            per_seq = np.concatenate([np.asarray(item["source_ids"], dtype=np.int64) for item in batch])
            if per_seq.shape[0] != seg.shape[0]:
                raise ShardError("source_ids must hold one id per sequence of each row", field="source_ids",
                                 expected=int(seg.shape[0]), actual=int(per_seq.shape[0]))
            sources = np.full(n_rows * max_length, -1, dtype=np.int64)
            sources[flat] = per_seq[sid]
            out["source_ids"] = torch.from_numpy(sources.reshape(n_rows, max_length))
        logical = seg
        if self.pad_seq_to_mult > 1:
            # Logical length: up to the sequence's last input that counts (alignment padding excluded):
            # any non-EOS input; under "pr5610" also an EOS input whose stored loss is not 0.
            logical = np.zeros(seg.shape[0], dtype=np.int64)
            real = ids[kept] != self.eos_id
            if self.bridge_semantics == BRIDGE_PR5610:
                real |= loss[kept] != 0
            np.maximum.at(logical, sid[real], local[real] + 1)
        rows = self._rows(seg, logical, n_seqs, max_length)
        if self.bridge_semantics == BRIDGE_PR5610:
            out["pad_between_seqs"] = bool(self.pad_seq_to_mult > 1 and any(
                not np.array_equal(lg, ph) for lg, ph in zip(*rows)))
        if self.bridge_semantics != BRIDGE_06:
            out["padding_mask"] = torch.from_numpy(self._padding_mask(rows, row_count, max_length))
        if not self.return_cu_seqlen:
            causal = torch.tril(torch.ones((1, max_length, max_length))) < 0.5
            out["attention_mask"] = causal.unsqueeze(0).expand(n_rows, 1, max_length, max_length).clone()
            return out
        return self._add_boundaries(out, rows, n_seqs, max_length)

    def _padding_mask(self, rows, row_count: np.ndarray, max_length: int) -> np.ndarray:
        """Bridge main's ``padding_mask``: True past each row's tokens, or (context parallelism)
        on each physical segment's tail past its logical length."""
        mask = np.zeros((row_count.shape[0], max_length), dtype=bool)
        if self.pad_seq_to_mult == 1:
            mask[np.arange(max_length)[None, :] >= row_count[:, None]] = True
            return mask
        for b, (logical, phys) in enumerate(zip(*rows)):
            tail_start = phys[:-1] + np.diff(logical)
            for start, end in zip(tail_start.tolist(), phys[1:].tolist()):  # segments per row: few
                mask[b, start:end] = True
        return mask

    def _row_boundaries(self, phys: np.ndarray, logical: np.ndarray, max_length: int):
        """One row's (logical, physical-or-None) boundaries with Bridge's appending rules."""
        if self.pad_seq_to_mult > 1:
            if phys[-1] != max_length:
                phys = np.append(phys, max_length)
            if phys.shape[0] > logical.shape[0]:
                logical = np.append(logical, logical[-1])
            if self.pad_cu_seqlens:
                fill = max(self.stats.max_samples_per_bin - phys.shape[0] + 2, 0)
                phys = np.concatenate((phys, np.full(fill, max_length, np.int64)))
                logical = np.concatenate((logical, np.full(fill, logical[-1], np.int64)))
            return logical, phys
        if phys[-1] != max_length:
            phys = np.append(phys, max_length)
        if self.pad_cu_seqlens:
            fill = max(self.stats.max_samples_per_bin - phys.shape[0] + 2, 0)
            phys = np.concatenate((phys, np.full(fill, max_length, np.int64)))
        return phys, None

    def _rows(self, seg, logical_len, n_seqs, max_length: int):
        """Each row's (logical, physical-or-None) boundaries, as two lists."""
        split_at = np.cumsum(n_seqs)[:-1]
        logical_rows: List[np.ndarray] = []
        phys_rows: List[np.ndarray] = []
        for phys_len, log_len in zip(np.split(seg, split_at), np.split(logical_len, split_at)):
            phys = np.concatenate(([0], np.cumsum(phys_len)))
            logical = np.concatenate(([0], np.cumsum(log_len)))
            logical, phys = self._row_boundaries(phys, logical, max_length)
            logical_rows.append(logical)
            if phys is not None:
                phys_rows.append(phys)
        return logical_rows, phys_rows

    def _add_boundaries(self, out: dict, rows, n_seqs, max_length: int) -> dict:
        logical_rows, phys_rows = rows
        matrix = _stack_ragged(logical_rows + phys_rows)
        cu = torch.from_numpy(matrix[: len(logical_rows)].copy())
        cu_padded = torch.from_numpy(matrix[len(logical_rows):].copy()) if phys_rows else None
        if self.pad_cu_seqlens:
            max_seqlen = torch.full((n_seqs.shape[0],), self.static_max_seqlen(max_length), dtype=torch.int32)
        else:
            ref = cu_padded if cu_padded is not None else cu
            max_seqlen = (ref[:, 1:] - ref[:, :-1]).max(dim=1, keepdim=True).values
        out.update({"attention_mask": None, "cu_seqlens_q": cu, "max_seqlen_q": max_seqlen,
                    "max_seqlen_kv": max_seqlen, "cu_seqlens_kv": cu})
        if cu_padded is not None:
            out["cu_seqlens_q_padded"] = cu_padded
            out["cu_seqlens_kv_padded"] = cu_padded
        return out


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(c) for c in counts])`` without a Python loop."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)


def _stack_ragged(rows: List[np.ndarray]) -> np.ndarray:
    """Rows of boundaries as one int32 matrix, short rows extended by zero-length segments."""
    width = max(r.shape[0] for r in rows)
    out = np.empty((len(rows), width), dtype=np.int32)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
        out[b, r.shape[0]:] = r[-1]
    return out


def collate_fn(batch: Sequence[dict], max_seq_length: int, **options) -> dict:
    """Functional form of :class:`PackedCollator` (same arguments)."""
    return PackedCollator(max_seq_length, **options)(batch)
