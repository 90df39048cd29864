"""Megatron-Bridge's global-batch packing input: one unpacked sample per stored sequence.

Bridge 0.7.0 documents a fourth packing path, *global-batch online packing*
(``dataset.enable_global_batch_packing``; Bridge PR #6127): Megatron-Core's sequence-packing
scheduler forms the bins once per training step from the whole global batch, so the dataset
hands it unpacked samples, one sequence each, as a list (no stacking). Bridge's API docs
(``megatron.bridge.data.packing.global_batch``) state the sample contract, and this module
produces it from our sequence store or shards. **Built from the documentation only**: no 0.7
wheel and no snapshot holding #6127's code could be read here (docs/TRAINING.md says what to
rerun when one can). What the docs state, and what this module does for each:

* the keys :data:`REQUIRED_SAMPLE_KEYS`; ``tokens``, ``labels``, ``position_ids`` int64 ``[L]``,
  ``loss_mask`` float32 ``[L]``, ``original_seq_len`` and ``padded_seq_len`` int32 ``[1]``;
* ``build_unpacked_sequence_sample`` builds one sample "from an unpadded sequence": here
  :func:`unpacked_sample`, with Bridge's label shift for a stored sequence of ``n`` tokens
  (as its GPT-SFT datasets and our :mod:`.collate`): ``tokens = ids[:-1]``, ``labels = ids[1:]``,
  ``loss_mask`` the stored label-aligned mask ``[:-1]``, ``position_ids = 0 .. n-2``;
  ``original_seq_len = n - 1``;
* alignment for context / sequence parallelism: each sample padded to ``padded_seq_len``, a
  multiple of ``pad_to_multiple_of`` (Bridge's rule ``lcm(2*CP, CP*TP with SP)``:
  :func:`megatron_sft_idx.packing.pad_multiple_for`); what the padding holds is not in the docs:
  here ``pad_id`` as token and label, loss 0, positions running on (Megatron-Core's scheduler
  overwrites tokens, labels and positions past ``original_seq_len`` with 0 and masks them);
* ``fold_alignment_padding`` "reports the padded length as the sequence length so bins carry
  no padding between sequences": ``fold_alignment_padding=True`` sets ``original_seq_len`` to
  ``padded_seq_len`` (the padding, loss 0, becomes part of the sequence).

The consumer, Megatron-Core's scheduler (``megatron/core/datasets/data_schedule*.py`` on its
``main``), is read as code: tests/compat/make_bridge_global_batch_golden.py runs its CPU parts
on these samples (tests/golden/bridge_global_batch/, checked by
tests/training/test_global_batch.py).

Example (a Bridge 0.7 GPT-SFT run with ``enable_global_batch_packing``, CP 2)::

    ds = GlobalBatchSequences(StoreSequences("/data/sft/store"), pad_to_multiple_of=pad_multiple_for(cp=2),
                              pad_id=tok.eos_id)
    loader = DataLoader(ds, batch_size=mbs, collate_fn=collate_samples)
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..errors import ShardError  # noqa: E402

__all__ = ["REQUIRED_SAMPLE_KEYS", "unpacked_sample", "GlobalBatchSequences", "collate_samples"]

#: The keys of one unpacked sample, in the order Bridge's docs list them.
REQUIRED_SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "original_seq_len", "padded_seq_len")


def unpacked_sample(input_ids, loss_mask, *, pad_to_multiple_of: int = 1, pad_id: int = 0,
                    fold_alignment_padding: bool = False, where: str = "the sequence") -> dict:
    """One stored sequence (``input_ids`` and its label-aligned ``loss_mask``) as one sample of
    Bridge's contract (module doc).

    Raises:
        ShardError: fewer than two tokens (no label), a mask of another length, a multiple below 1.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.asarray(loss_mask)
    n = int(ids.shape[0])
    if n < 2 or mask.shape != ids.shape:
        raise ShardError(f"{where} cannot be a training sample: it needs at least 2 tokens and one mask value a token",
                         field="input_ids", expected=">= 2 tokens, mask of the same length",
                         actual=(n, tuple(mask.shape)))
    mult = int(pad_to_multiple_of)
    if mult < 1:
        raise ShardError("pad_to_multiple_of must be at least 1", field="pad_to_multiple_of", actual=pad_to_multiple_of)
    length = n - 1
    padded = -(-length // mult) * mult
    tokens = np.full(padded, pad_id, dtype=np.int64)
    labels = np.full(padded, pad_id, dtype=np.int64)
    loss = np.zeros(padded, dtype=np.float32)
    tokens[:length] = ids[:-1]
    labels[:length] = ids[1:]
    loss[:length] = mask[:-1]
    return {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss),
        "position_ids": torch.arange(padded, dtype=torch.int64),
        "original_seq_len": torch.tensor([padded if fold_alignment_padding else length], dtype=torch.int32),
        "padded_seq_len": torch.tensor([padded], dtype=torch.int32),
    }


class GlobalBatchSequences(torch.utils.data.Dataset):
    """Every sequence of a source as a Bridge global-batch sample (:func:`unpacked_sample`).

    Args:
        source: a :class:`~megatron_sft_idx.preprocess.sequences.StoreSequences` (the store's
            sequences, unpadded, in store order), or a local shard
            (:class:`~megatron_sft_idx.reader.MMapIndexedDataset`): its sequences pack by pack.
            Shards written with a pad multiple hold their alignment padding inside each
            sequence, so it counts in ``original_seq_len``; the store has none.
        pad_to_multiple_of, pad_id, fold_alignment_padding: as :func:`unpacked_sample`.

    Raises:
        ShardError: a source that is neither.
    """

    def __init__(self, source, *, pad_to_multiple_of: int = 1, pad_id: int = 0,
                 fold_alignment_padding: bool = False) -> None:
        self.source = source
        self.options = dict(pad_to_multiple_of=int(pad_to_multiple_of), pad_id=int(pad_id),
                            fold_alignment_padding=bool(fold_alignment_padding))
        if hasattr(source, "lengths") and hasattr(source, "store"):   # StoreSequences: one sequence an item
            self._table = None
            self._n = len(source)
        elif hasattr(source, "arrays") and hasattr(source, "seq_offsets"):
            a = source.arrays()
            offsets = np.asarray(a.seq_offsets, dtype=np.int64)
            pack = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))
            starts = np.asarray(a.seq_starts, dtype=np.int64)
            ends = np.append(starts[1:], 0)
            last = offsets[1:] - 1   # each pack's last sequence ends at the pack's length
            ends[last[np.diff(offsets) > 0]] = np.asarray(a.sequence_lengths, dtype=np.int64)[np.diff(offsets) > 0]
            self._table = np.stack([pack, starts, ends], axis=1)
            self._n = int(pack.shape[0])
        else:
            raise ShardError("a global-batch source is a sequence store (StoreSequences) or a local shard",
                             field="source", actual=type(source).__name__,
                             hint="open the store with megatron_sft_idx.preprocess.sequences.StoreSequences, or a "
                                  "shard with MMapIndexedDataset")

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, g) -> dict:
        g = int(g)
        if not 0 <= g < self._n:
            raise ShardError(f"sequence {g} is outside the source's {self._n} sequences", field="sequence", actual=g)
        if self._table is None:
            item = self.source[g]
            ids, mask = item.input_ids, item.loss_mask
        else:
            p, a, b = (int(x) for x in self._table[g])
            pack = self.source[p]
            ids, mask = pack.input_ids[a:b], pack.loss_mask[a:b]
        return unpacked_sample(ids, mask, where=f"sequence {g}", **self.options)


def collate_samples(batch: Sequence[dict]) -> List[dict]:
    """The micro-batch as the scheduler takes it: the samples, as a list (not stacked)."""
    return list(batch)
