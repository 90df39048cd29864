"""NeMo-RL's pre-packed SFT rows (PR #3380's datum spec) straight from our packs, with our masks.

NeMo-RL's ``MegatronSFTPackedDataset`` (PR #3380, open at ``a944f7c8``) turns one JSONL row of
text messages into one fixed-length packed datum (``megatron_sft_packed_preprocessor``) and its
SFT loop trains on that. A JSONL row carries no mask: under its ``identity`` prompt format it
trains every label but padding and each later sequence's first token, and its two other formats
are fixed Nemotron templates. :class:`NemoRLPackedDataset` builds the same datum from a pack
of our shards and keeps the stored mask, for any template: give it to NeMo-RL where its
``MegatronSFTPackedDataset``'s processed rows would go (a ``torch`` dataset of datum dicts; its
collate, ``_collate_megatron_sft_packed``, takes them unchanged).

A datum, ``L`` = ``max_seq_length`` (default: the source's pack size), ``P`` = the pad id:

* ``input_ids`` ``(L,)`` int64: the pack's sequences, each padded to a multiple of ``2·CP``
  when ``context_parallel_size > 1`` (#3380's rule), then ``P`` up to ``L``;
* ``target_ids`` ``(L,)`` int64: the next token (``input_ids`` shifted by one, ``P`` after
  the end) where the stored label-aligned mask trains it or it is padding, else ``-100`` (so
  ``-100`` before each sequence start, #3380's boundary rule: the stored mask is 0 there);
* ``token_mask`` ``(L,)`` float32: the stored mask (0 on padding);
* ``position_ids`` ``(L,)`` int64: from 0 in each sequence, running on through its padding and,
  for the last sequence, through the pack's tail;
* ``packed_cu_seqlens`` ``(n + 1,)`` int32: sequence ends, the last one ``L`` (the tail joins
  the last sequence, as #3380's does); ``packed_max_seqlen`` its largest difference (int);
* ``packed_context_parallel_size``, ``length`` (``L``), ``loss_multiplier`` 1.0, ``idx``,
  ``task_name``, ``message_log`` ``[]``, ``extra_env_info`` None.

Keys, dtypes and shapes are those #3380's own code returns for the same tokens, and
``input_ids``, ``position_ids``, ``packed_cu_seqlens`` are equal element for element
(tests/compat/test_nemo_rl_3380.py, against a golden recorded from its code). Where #3380
would truncate (a row longer than ``L`` after its padding) this refuses the pack: repack with a
smaller ``--pack-size`` or pad for the CP size (``--cp``) so the packs fit.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..errors import ShardError
from ..open import open_packed
from ..packed import summarize

__all__ = ["NemoRLPackedDataset", "IGNORE_INDEX", "TASK_NAME"]

#: #3380's masked-label value.
IGNORE_INDEX = -100
#: #3380's task name for these rows.
TASK_NAME = "megatron_sft_packed"


class NemoRLPackedDataset(torch.utils.data.Dataset):
    """One #3380 datum per pack of ``source`` (module doc).

    Args:
        source: a packed source or anything :func:`~megatron_sft_idx.open.open_packed` opens.
        max_seq_length: ``L``, NeMo-RL's ``max_input_seq_length`` (default: the pack size).
        pad_id: the padding token (default: the one the shard records); NeMo-RL's
            ``megatron_sft_pad_token`` should name the same token.
        context_parallel_size: NeMo-RL's ``megatron_sft_context_parallel_size``.
        task_name: the rows' ``task_name``.

    Raises:
        ShardError: no pad id; ``max_seq_length`` below the pack size; ``context_parallel_size``
            below 1; on read, a pack longer than ``L`` once padded for ``2·CP``.
    """

    def __init__(self, source, *, max_seq_length: Optional[int] = None, pad_id: Optional[int] = None,
                 context_parallel_size: int = 1, task_name: str = TASK_NAME) -> None:
        self.path = source if isinstance(source, str) else getattr(source, "prefix", None)
        if isinstance(source, (str, list, tuple)) or hasattr(source, "__fspath__"):
            source = open_packed(source)
        self.source = source
        capacity = summarize(source).capacity
        self.max_seq_length = int(max_seq_length if max_seq_length is not None else capacity)
        if self.max_seq_length < capacity:
            raise ShardError(f"max_seq_length {self.max_seq_length} is below the packs' size {capacity}",
                             path=self.path, field="max_seq_length", expected=f">= {capacity}",
                             actual=self.max_seq_length, hint="give NeMo-RL max_input_seq_length >= the pack size")
        if pad_id is None:
            pad_id = (getattr(getattr(source, "metadata", None), "tokenizer", None) or {}).get("pad_id")
        if pad_id is None:
            raise ShardError("no pad id: the source records none", path=self.path, field="pad_id",
                             hint="pass pad_id (the id of NeMo-RL's megatron_sft_pad_token)")
        self.pad_id = int(pad_id)
        if int(context_parallel_size) < 1:
            raise ShardError("context_parallel_size must be >= 1", path=self.path, field="context_parallel_size",
                             actual=context_parallel_size)
        self.context_parallel_size = int(context_parallel_size)
        self.task_name = task_name
        # what NeMo-RL's SFT setup reads to recognise its direct-packed path and check the CP size
        # against the policy's (nemo_rl/algorithms/sft.py, _direct_megatron_sft_context_parallel_sizes)
        processor = partial(self.datum, context_parallel_size=self.context_parallel_size)
        self.task_data_processors = {TASK_NAME: (None, processor)}

    def __len__(self) -> int:
        return len(self.source)

    def datum(self, idx, *, context_parallel_size: int) -> dict:
        """``self[idx]``, refused for another CP size than this dataset pads for."""
        if int(context_parallel_size) != self.context_parallel_size:
            raise ShardError("this dataset pads for another context_parallel_size", path=self.path,
                             field="context_parallel_size", expected=self.context_parallel_size,
                             actual=context_parallel_size)
        return self[idx]

    def __getitem__(self, idx) -> dict:
        idx = int(idx)
        pack = self.source[idx]
        ids = np.asarray(pack.input_ids).astype(np.int64)
        mask = np.asarray(pack.loss_mask).astype(np.float32)
        bounds = np.asarray(pack.seq_boundaries, dtype=np.int64)
        lengths = np.diff(bounds)
        mult = 2 * self.context_parallel_size if self.context_parallel_size > 1 else 1
        padded = -(-lengths // mult) * mult
        L = self.max_seq_length
        total = int(padded.sum())
        if total > L:
            raise ShardError(f"the pack is {total} tokens once each sequence is padded to a multiple of {mult}, "
                             f"more than max_seq_length {L} (#3380 would cut it)", path=self.path, pack=idx,
                             field="max_seq_length", expected=f">= {total}", actual=L,
                             hint=f"repack with --cp {self.context_parallel_size} so the padding is planned")
        starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
        tokens = np.full(L + 1, self.pad_id, dtype=np.int64)
        trained = np.zeros(L, dtype=np.float32)
        real = np.zeros(L + 1, dtype=bool)
        positions = np.empty(L + 1, dtype=np.int64)
        for k in range(lengths.shape[0]):
            a, n, s = int(bounds[k]), int(lengths[k]), int(starts[k])
            tokens[s:s + n] = ids[a:a + n]
            trained[s:s + n] = mask[a:a + n]
            real[s:s + n] = True
            positions[s:s + int(padded[k])] = np.arange(int(padded[k]))
        last = int(starts[-1])
        positions[total:] = np.arange(total - last, L + 1 - last)   # the tail runs on in the last sequence
        ends = np.cumsum(padded)
        cu_seqlens = np.concatenate([[0], ends[:-1], [L]]).astype(np.int32)
        targets = tokens[1:].copy()
        # padding labels keep the pad id, as #3380's; no label crosses a sequence start, since
        # the stored mask is 0 at each sequence's last position (docs/FORMAT.md)
        targets[(trained == 0) & real[1:]] = IGNORE_INDEX
        return {
            "message_log": [],
            "input_ids": torch.from_numpy(tokens[:-1].copy()),
            "target_ids": torch.from_numpy(targets),
            "token_mask": torch.from_numpy(trained),
            "position_ids": torch.from_numpy(positions[:-1].copy()),
            "packed_cu_seqlens": torch.from_numpy(cu_seqlens),
            "packed_max_seqlen": int(np.diff(cu_seqlens).max()),
            "packed_context_parallel_size": self.context_parallel_size,
            "length": L,
            "extra_env_info": None,
            "loss_multiplier": 1.0,
            "idx": idx,
            "task_name": self.task_name,
        }
