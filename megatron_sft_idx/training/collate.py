"""Megatron-Bridge's packed batch, built with whole-batch numpy operations.

Input: a list of Bridge packed samples ``{"input_ids", "seq_boundaries",
"loss_mask"}`` (what :class:`~megatron_sft_idx.training.bridge.PackedSFTDataset`
returns). Output: the dict Bridge's ``GPTSFTPackedDataset.collate_fn`` returns.

Layout (Bridge's, reproduced): a sequence of ``L`` stored tokens ``[b, b+L)``
contributes ``L - 1`` positions — input ``ids[b : b+L-1]``, label
``ids[b+1 : b+L]``, loss ``loss_mask[b : b+L-1]`` (the stored mask is
label-aligned, so position ``j`` trains predicting ``j+1``), positions
``0 .. L-2``. So no label ever crosses a sequence boundary. Rows are padded to
``max_length`` with ``pad_id`` tokens/labels, loss 0, position 0.

* ``cu_seqlens_q/kv``: the logical boundaries. With ``pad_seq_to_mult == 1`` they
  are the cumulative ``L - 1`` plus ``max_length`` when the row is padded (the
  padding is a segment of its own, so it never attends to a real sequence).
* With ``pad_seq_to_mult > 1`` (sequences were padded for context parallelism):
  ``cu_seqlens_q/kv_padded`` hold the physical boundaries (cumulative ``L - 1``,
  then ``max_length``) and ``cu_seqlens_q/kv`` the logical ones, where each
  sequence's trailing ``pad_id`` tokens with zero loss are alignment padding.
* ``padding_mask[b, t]`` is True on every position that is not a logical token.
* ``max_seqlen_q/kv``: per row, the longest (physical) segment, shape ``(B, 1)``;
  with ``pad_cu_seqlens`` one static value per row, shape ``(B,)``, as Bridge.
* ``pad_cu_seqlens`` pads every row's boundaries to ``max_samples_per_bin + 2``
  entries with zero-length segments (a static shape for CUDA graphs); the
  statistics come from the source's :class:`PackSummary` (shard metadata).

Summary statistics are stored in raw units (sequence lengths including the last
token); Bridge's are one less per sequence. The static ``max_seqlen`` is therefore
``max(dataset_max_seqlen - 1, max_length - (min_packed_seqlen - max_samples_per_bin))``:
the first term is exact, the second an upper bound of Bridge's value (a larger
``max_seqlen`` is always safe for the attention kernels).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..errors import ShardError
from ._sources import PackSummary

__all__ = ["PackedCollator", "collate_fn"]


def _ceil_to(n: int, mult: int) -> int:
    return -(-n // mult) * mult if mult > 1 else n


class PackedCollator:
    """Callable ``batch -> Bridge packed batch`` with Bridge's options.

    Args:
        max_seq_length: the longest row (Bridge's ``seq_length``, the pack size).
        pad_id: token used for padding tokens and labels (Bridge: the tokenizer's EOS).
        pad_to_max_length: pad every row to ``max_seq_length`` (else to the batch's
            longest row rounded up to ``pad_seq_length_to_mult``).
        pad_seq_length_to_mult: rounding multiple when not padding to the max (Bridge: 16).
        pad_seq_to_mult: multiple sequences were padded to for CP (> 1 adds the
            ``*_padded`` boundaries).
        pad_cu_seqlens: static-shape boundaries (requires ``pad_to_max_length`` and ``summary``).
        summary: the source's :class:`PackSummary` (for ``pad_cu_seqlens``).
        return_cu_seqlen: False gives a dense causal ``attention_mask`` instead of boundaries.

    Raises:
        ShardError: inconsistent options, or a pack longer than ``max_seq_length``.
    """

    def __init__(self, max_seq_length: int, *, pad_id: int = 0, pad_to_max_length: bool = False,
                 pad_seq_length_to_mult: int = 16, pad_seq_to_mult: int = 1,
                 pad_cu_seqlens: bool = False, summary: Optional[PackSummary] = None,
                 return_cu_seqlen: bool = True) -> None:
        if pad_cu_seqlens and not pad_to_max_length:
            raise ShardError("pad_cu_seqlens requires pad_to_max_length=True (as in Megatron-Bridge)",
                             field="pad_cu_seqlens")
        if pad_cu_seqlens and summary is None:
            raise ShardError("pad_cu_seqlens needs the packing statistics of the source",
                             field="pad_cu_seqlens", hint="pass summary=summarize(source)")
        if max_seq_length < 1 or pad_seq_to_mult < 1 or pad_seq_length_to_mult < 1:
            raise ShardError("lengths and multiples must be positive", field="max_seq_length",
                             actual=(max_seq_length, pad_seq_to_mult, pad_seq_length_to_mult))
        self.max_seq_length = int(max_seq_length)
        self.pad_id = int(pad_id)
        self.pad_to_max_length = pad_to_max_length
        self.pad_seq_length_to_mult = int(pad_seq_length_to_mult)
        self.pad_seq_to_mult = int(pad_seq_to_mult)
        self.pad_cu_seqlens = pad_cu_seqlens
        self.summary = summary
        self.return_cu_seqlen = return_cu_seqlen

    # ------------------------------------------------------------------ helpers

    def _static_max_seqlen(self, max_length: int) -> int:
        s = self.summary
        bridge_min_packed = max(s.min_packed_seqlen - s.max_samples_per_bin, 0)
        return max(s.dataset_max_seqlen - 1, max_length - bridge_min_packed)

    def _row_boundaries(self, phys: np.ndarray, logical: np.ndarray, max_length: int):
        """One row's (logical, physical-or-None) boundary lists, Bridge's appending rules applied."""
        padded = self.pad_seq_to_mult > 1
        if padded:
            if phys[-1] != max_length:
                phys = np.append(phys, max_length)
            if phys.shape[0] > logical.shape[0]:
                logical = np.append(logical, logical[-1])
        elif logical[-1] != max_length:
            logical = np.append(logical, max_length)
        if self.pad_cu_seqlens:
            target = self.summary.max_samples_per_bin + 2
            have = (phys if padded else logical).shape[0]
            if have > target:
                raise ShardError("a pack holds more sequences than max_samples_per_bin records",
                                 field="max_samples_per_bin", expected=f"<= {target - 2}",
                                 actual=have - 2, hint="the shard statistics are wrong; rebuild it")
            fill = target - have
            if padded:
                phys = np.concatenate((phys, np.full(fill, max_length, phys.dtype)))
                logical = np.concatenate((logical, np.full(fill, logical[-1], logical.dtype)))
            else:
                logical = np.concatenate((logical, np.full(fill, max_length, logical.dtype)))
        return logical, (phys if padded else None)

    @staticmethod
    def _stack_ragged(rows: List[np.ndarray]) -> np.ndarray:
        """Rows of boundaries as one int32 matrix, short rows extended by zero-length segments."""
        width = max(r.shape[0] for r in rows)
        out = np.empty((len(rows), width), dtype=np.int32)
        for b, r in enumerate(rows):
            out[b, : r.shape[0]] = r
            out[b, r.shape[0]:] = r[-1]
        return out

    # ------------------------------------------------------------------ main

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
        # Every sequence of the batch: global start, length, and the row it belongs to.
        seq_row = np.repeat(np.arange(n_rows), n_seqs)
        starts = np.concatenate([b[:-1] for b in bounds]) + pack_off[seq_row]
        lengths = np.concatenate([np.diff(b) for b in bounds])
        keep = np.ones(ids.shape[0], dtype=bool)
        keep[starts + lengths - 1] = False  # a sequence's last token predicts nothing
        kept = np.flatnonzero(keep)
        seq_of_token = np.repeat(np.arange(lengths.shape[0]), lengths)
        sid = seq_of_token[kept]
        local = kept - starts[sid]

        row_count = pack_len - n_seqs  # Bridge's token_count
        longest = int(row_count.max())
        if self.pad_to_max_length:
            max_length = self.max_seq_length
        else:
            max_length = min(self.max_seq_length, _ceil_to(longest, self.pad_seq_length_to_mult))
        if longest > max_length:
            raise ShardError("a pack is longer than max_seq_length", field="max_seq_length",
                             expected=f"<= {max_length} tokens after dropping each sequence's last",
                             actual=longest, hint="raise seq_length to the shard's pack size")
        row = seq_row[sid]
        col = np.arange(kept.shape[0]) - np.repeat(np.concatenate(([0], np.cumsum(row_count)))[:-1], row_count)
        flat = row * max_length + col

        tokens = np.full(n_rows * max_length, self.pad_id, dtype=np.int64)
        labels = np.full(n_rows * max_length, self.pad_id, dtype=np.int64)
        loss_out = np.zeros(n_rows * max_length, dtype=np.int64)
        positions = np.zeros(n_rows * max_length, dtype=np.int64)
        tokens[flat] = ids[kept]
        labels[flat] = ids[kept + 1]
        loss_out[flat] = loss[kept]
        positions[flat] = local

        seg = lengths - 1  # positions each sequence contributes
        if self.pad_seq_to_mult > 1:
            # Alignment padding: a sequence's trailing pad_id tokens that carry no loss.
            real = (ids[kept] != self.pad_id) | (loss[kept] != 0)
            logical_len = np.zeros(seg.shape[0], dtype=np.int64)
            np.maximum.at(logical_len, sid, np.where(real, local + 1, 0))
            is_logical = local < logical_len[sid]
        else:
            logical_len = seg
            is_logical = np.ones(kept.shape[0], dtype=bool)
        padding_mask = np.ones(n_rows * max_length, dtype=bool)
        padding_mask[flat[is_logical]] = False

        out = {
            "tokens": torch.from_numpy(tokens.reshape(n_rows, max_length)),
            "labels": torch.from_numpy(labels.reshape(n_rows, max_length)),
            "loss_mask": torch.from_numpy(loss_out.reshape(n_rows, max_length)),
            "position_ids": torch.from_numpy(positions.reshape(n_rows, max_length)),
            "token_count": [int(c) for c in row_count],
            "padding_mask": torch.from_numpy(padding_mask.reshape(n_rows, max_length)),
        }
        if not self.return_cu_seqlen:
            causal = torch.tril(torch.ones((1, max_length, max_length))) < 0.5
            out["attention_mask"] = causal.expand(n_rows, 1, max_length, max_length).clone()
            return out
        return self._add_boundaries(out, seg, logical_len, n_seqs, max_length)

    def _add_boundaries(self, out: dict, seg, logical_len, n_seqs, max_length: int) -> dict:
        seq_split = np.cumsum(n_seqs)[:-1]
        logical_rows, phys_rows = [], []
        pad_between = False
        for phys_len, log_len in zip(np.split(seg, seq_split), np.split(logical_len, seq_split)):
            phys = np.concatenate(([0], np.cumsum(phys_len)))
            logical = np.concatenate(([0], np.cumsum(log_len)))
            logical, phys = self._row_boundaries(phys, logical, max_length)
            logical_rows.append(logical)
            if phys is not None:
                phys_rows.append(phys)
                pad_between = pad_between or not np.array_equal(logical, phys)
        logical_mat = self._stack_ragged(logical_rows + phys_rows)
        cu = torch.from_numpy(logical_mat[: len(logical_rows)].copy())
        cu_padded = torch.from_numpy(logical_mat[len(logical_rows):].copy()) if phys_rows else None
        reference = cu_padded if cu_padded is not None else cu
        if self.pad_cu_seqlens:
            max_seqlen = torch.full((reference.shape[0],), self._static_max_seqlen(max_length),
                                    dtype=torch.int32)
        else:
            max_seqlen = (reference[:, 1:] - reference[:, :-1]).max(dim=1, keepdim=True).values
        out.update({
            "pad_between_seqs": pad_between,
            "attention_mask": None,
            "cu_seqlens_q": cu,
            "cu_seqlens_kv": cu,
            "max_seqlen_q": max_seqlen,
            "max_seqlen_kv": max_seqlen,
        })
        if cu_padded is not None:
            out["cu_seqlens_q_padded"] = cu_padded
            out["cu_seqlens_kv_padded"] = cu_padded
        return out


def collate_fn(batch: Sequence[dict], max_seq_length: int, **options) -> dict:
    """Functional form of :class:`PackedCollator` (same arguments)."""
    return PackedCollator(max_seq_length, **options)(batch)
