"""A dataset with Megatron-Bridge's packed interface, over any packed source.

``PackedSFTDataset(path_or_source)[i]`` returns Bridge's packed sample
``{"input_ids", "seq_boundaries", "loss_mask"}`` (read-only numpy views;
``seq_boundaries = seq_start_id + [packed_len]``), and ``dataset.collate_fn``
turns a list of them into Bridge's packed batch (:mod:`.collate`). Example::

    ds = PackedSFTDataset("/data/sft/train_000", pad_id=tok.eos_id, max_num_samples=100_000,
                          pad_to_max_length=True, pad_cu_seqlens=True)
    loader = DataLoader(ds, batch_size=1, collate_fn=ds.collate_fn, num_workers=4,
                        persistent_workers=True)

Semantics kept from Bridge's ``GPTSFTPackedDataset``:

* a negative index is a *padding sample*: the pack at that (Python-negative)
  position, with an all-zero loss mask, so padding a global batch never adds loss;
* with ``max_num_samples`` the dataset has that many samples, drawn through a
  ``samples_mapping``: one independent permutation of all packs per epoch,
  concatenated and cut to ``max_num_samples`` (sampling without replacement
  within an epoch). The permutations come from a private ``RandomState(seed)``,
  so the mapping is the same in every process and after every restart.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..errors import ShardError
from ._sources import PackSummary, summarize
from .collate import PackedCollator
from .factory import open_packed

__all__ = ["PackedSFTDataset", "build_samples_mapping", "bridge_datasets"]


def build_samples_mapping(num_packs: int, max_num_samples: int, seed: int, order=None,
                          source=None) -> np.ndarray:
    """Epoch-level shuffled pack indices: ``max_num_samples`` entries, each epoch a permutation.

    ``order(source, indices, rng)`` replaces ``rng.permutation`` (e.g.
    :class:`~megatron_sft_idx.locality.BlockLocalOrder` for object storage).

    Raises:
        ShardError: no packs, or a negative sample count.
    """
    if num_packs <= 0 or max_num_samples < 0:
        raise ShardError("samples mapping needs packs and a non-negative sample count",
                         field="max_num_samples", actual=(num_packs, max_num_samples))
    epochs = -(-max_num_samples // num_packs)
    rng = np.random.RandomState(seed)
    dtype = np.int32 if num_packs <= np.iinfo(np.int32).max else np.int64
    mapping = np.empty(epochs * num_packs, dtype=dtype)
    for e in range(epochs):  # one permutation per epoch: O(epochs) Python steps
        mapping[e * num_packs:(e + 1) * num_packs] = (
            rng.permutation(num_packs) if order is None else order(source, np.arange(num_packs), rng))
    out = mapping[:max_num_samples]
    out.flags.writeable = False
    return out


class PackedSFTDataset(torch.utils.data.Dataset):
    """Bridge-style packed SFT dataset over a shard, a multi-shard view, a ``.npy`` or Parquet.

    Args:
        source: a packed source or anything :func:`open_packed` opens.
        max_seq_length: Bridge's ``seq_length`` (defaults to the source's pack size).
        pad_id: padding token for the collate (Bridge uses the tokenizer's EOS id).
        max_num_samples: build a ``samples_mapping`` of this length (None: one pass, in order).
        seed: seed of the samples mapping.
        pad_to_max_length, pad_seq_length_to_mult, pad_cu_seqlens, return_cu_seqlen:
            Bridge's collate options (see :class:`PackedCollator`).
        pad_seq_to_mult: overrides the source's recorded multiple (needed for ``.npy``/Parquet).
        order: index order of each epoch of the samples mapping (default: a full shuffle;
            :class:`~megatron_sft_idx.locality.BlockLocalOrder` reads a bucket block by block).

    Raises:
        ShardError: the source does not open, or options contradict its statistics.
    """

    def __init__(self, source, *, max_seq_length: Optional[int] = None, pad_id: int = 0,
                 max_num_samples: Optional[int] = None, seed: int = 1234,
                 pad_to_max_length: bool = False, pad_seq_length_to_mult: int = 16,
                 pad_seq_to_mult: Optional[int] = None, pad_cu_seqlens: bool = False,
                 return_cu_seqlen: bool = True, order=None) -> None:
        if isinstance(source, (str, list, tuple)) or hasattr(source, "__fspath__"):
            source = open_packed(source, pad_seq_to_mult=pad_seq_to_mult)
        self.source = source
        self.summary: PackSummary = summarize(source)
        self.max_seq_length = int(max_seq_length or self.summary.capacity)
        self.samples_mapping = (None if max_num_samples is None else
                                build_samples_mapping(len(source), int(max_num_samples), seed, order, source))
        self.collate_fn = PackedCollator(
            self.max_seq_length, pad_id=pad_id, pad_to_max_length=pad_to_max_length,
            pad_seq_length_to_mult=pad_seq_length_to_mult,
            pad_seq_to_mult=pad_seq_to_mult or self.summary.pad_seq_to_mult,
            pad_cu_seqlens=pad_cu_seqlens, summary=self.summary, return_cu_seqlen=return_cu_seqlen)

    def __len__(self) -> int:
        return len(self.samples_mapping) if self.samples_mapping is not None else len(self.source)

    def __getitem__(self, idx) -> dict:
        idx = int(idx)
        is_padding = idx < 0
        if self.samples_mapping is not None:
            idx = int(self.samples_mapping[idx])
        pack = self.source[idx]
        loss = pack.loss_mask
        if is_padding:
            loss = np.zeros_like(loss)
        return {"input_ids": pack.input_ids, "seq_boundaries": pack.seq_boundaries, "loss_mask": loss}


def bridge_datasets(context, train=None, valid=None, test=None, **options):
    """``(train, valid, test)`` datasets for a Megatron-Bridge ``DatasetProvider.build_datasets``.

    ``context`` is Bridge's ``DatasetBuildContext`` (``train_samples``,
    ``valid_samples``, ``test_samples``, ``tokenizer``); each split with a path
    gets ``max_num_samples`` from it and ``pad_id`` from the tokenizer's EOS.
    """
    tokenizer = getattr(context, "tokenizer", None)
    if "pad_id" not in options and tokenizer is not None:
        for name in ("eos_id", "eod", "eos"):
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                options["pad_id"] = value
                break
    out = []
    for path, samples in ((train, getattr(context, "train_samples", None)),
                          (valid, getattr(context, "valid_samples", None)),
                          (test, getattr(context, "test_samples", None))):
        out.append(None if path is None or not samples else
                   PackedSFTDataset(path, max_num_samples=samples, **options))
    return tuple(out)
