"""Serving planned batches to torch: the order-applying dataset, the dynamic-batch sampler, collates.

* :class:`OrderedDataset` serves ``base[index[i]]``: with a balanced order's sample index it
  is the dataset Megatron's ``MegatronPretrainingSampler`` (``dataloader_type="single"``)
  reads, so every rank gets the packs planned for it (:mod:`.layout`). It forwards Bridge's
  ``collate_fn`` and a negative index (Bridge's padding sample) to ``base``.
* :class:`DynamicBatchSampler` yields one rank's micro-batches of a
  :class:`~.dynamic.DynamicBatchPlan` from a resume point; each index is a ``(sequence id,
  width)`` pair that :class:`SequenceDataset` turns into a sample carrying the planned width.
* :class:`DynamicCollator` pads a micro-batch to that width with the keys each stack's training
  step reads: Megatron-LM's ``GPTDataset`` keys (``tokens``, ``labels``, ``loss_mask`` float32,
  ``position_ids``, and ``attention_mask`` bool ``[b, 1, W, W]``, True = masked, when asked), or
  the training keys of Megatron-Bridge's ``GPTSFTChatDataset.collate_fn`` (``tokens =
  input_ids[:-1]``, ``labels = input_ids[1:]`` padded with EOS, ``loss_mask`` int64, ``position_ids``,
  ``attention_mask`` unless ``get_attention_mask_from_fusion``). Bridge's generation-only keys
  (``contexts``, ``answers``, ``context_lengths``, ``metadata``) come from the rendered turn
  boundary, which a store does not record; they are left out.

Example (one rank of a dynamic-batching run)::

    plan = plan_dynamic(store_lengths, global_batch_size=256, data_parallel_size=dp, ...)
    loader = DataLoader(SequenceDataset(sequences), batch_sampler=DynamicBatchSampler(plan, rank),
                        collate_fn=DynamicCollator("megatron"), num_workers=4)
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..errors import ShardError  # noqa: E402
from .dynamic import DynamicBatchPlan  # noqa: E402
from .layout import Topology  # noqa: E402

__all__ = ["OrderedDataset", "SequenceDataset", "DynamicBatchSampler", "DynamicCollator"]


class OrderedDataset(torch.utils.data.Dataset):
    """``dataset[i] = base[index[i]]`` (see the module doc).

    Args:
        base: any indexable dataset (Bridge's ``PackedSFTDataset``, a shard, ...).
        index: the pack served at each position (e.g. ``order.sample_index(num_samples)``).
        order, topology: when both are given, warn (``TopologyMismatchWarning``) if the order
            was balanced for another topology.

    Raises:
        ShardError: an index outside ``base``.
    """

    def __init__(self, base, index, *, order=None, topology: Optional[Topology] = None) -> None:
        self.base = base
        self.index = np.ascontiguousarray(index, dtype=np.int64)
        if self.index.ndim != 1:
            raise ShardError("the sample index must be one-dimensional", field="index", actual=self.index.shape)
        n = len(base)
        if self.index.size and (self.index.min() < 0 or self.index.max() >= n):
            raise ShardError(f"the sample index points outside the dataset's {n} samples", field="index",
                             expected=f"[0, {n})", actual=(int(self.index.min()), int(self.index.max())),
                             hint="the order was planned for other data; re-plan it")
        if order is not None and topology is not None:
            order.warn_if_mismatch(topology)
        collate = getattr(base, "collate_fn", None)
        if collate is not None:
            self.collate_fn = collate

    @classmethod
    def from_order(cls, base, order, num_samples: int, topology: Optional[Topology] = None) -> "OrderedDataset":
        """The first ``num_samples`` positions of ``order`` (epochs from 0) over ``base``."""
        return cls(base, order.sample_index(num_samples), order=order, topology=topology)

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def __getitem__(self, i):
        i = int(i)
        if i < 0:  # Bridge's padding sample: the base decides what a negative index is
            return self.base[i]
        return self.base[int(self.index[i])]


class SequenceDataset(torch.utils.data.Dataset):
    """Unpacked sequences of a source whose every item is one sequence (a sequence store's
    partitions, or a shard of single-sequence packs): ``dataset[(i, width)]`` is
    ``{"input_ids", "loss_mask", "width"}`` (read-only numpy views; ``width`` from the plan)."""

    def __init__(self, source) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key) -> dict:
        i, width = (key if isinstance(key, tuple) else (key, None))
        item = self.source[int(i)]
        ids, mask = item.input_ids, item.loss_mask
        if width is not None and ids.shape[0] > width:
            raise ShardError(f"sequence {i} has {ids.shape[0]} tokens, more than its micro-batch width {width}",
                             field="width", pack=int(i), hint="the plan was made from other lengths; re-plan it")
        return {"input_ids": ids, "loss_mask": mask, "width": width}


class DynamicBatchSampler:
    """One rank's micro-batches of a :class:`~.dynamic.DynamicBatchPlan`, as index lists.

    Each yielded list is ``[(sequence id, width), ...]``. ``consumed_samples`` (sequences
    consumed by the whole job, as Megatron counts them) resumes at the step it names;
    ``epoch_offset`` is the part of it earlier epochs consumed (their steps times the global
    batch). Duck-types a torch batch sampler.

    Raises:
        ShardError: a rank outside the plan's DP size; a consumed count between steps.
    """

    def __init__(self, plan: DynamicBatchPlan, rank: int, consumed_samples: int = 0, epoch_offset: int = 0) -> None:
        if not 0 <= int(rank) < plan.data_parallel_size:
            raise ShardError(f"rank {rank} is outside the plan's DP size {plan.data_parallel_size}", field="rank",
                             actual=rank)
        self.plan = plan
        self.rank = int(rank)
        self.start_step = plan.step_of(consumed_samples, epoch_offset)

    def __len__(self) -> int:
        offsets = self.plan.mb_offsets
        return int(offsets[-1] - offsets[self.start_step])

    def __iter__(self) -> Iterator[List[Tuple[int, int]]]:
        for _, ids, width in self.plan.iter_rank(self.rank, self.start_step):
            yield [(int(i), width) for i in ids]


class DynamicCollator:
    """Pad a dynamic micro-batch to its planned width, in ``stack``'s batch layout (module doc).

    Args:
        stack: ``"megatron"`` (Megatron-LM ``GPTDataset`` keys) or ``"bridge"`` (Megatron-Bridge's
            ``GPTSFTChatDataset`` training keys).
        pad_id: token for padding positions (Megatron: default 0, as ``GPTDataset`` maps its pad
            to 0; Bridge: the tokenizer's EOS, which Bridge pads with).
        attention_mask: Megatron: add the ``[b, 1, W, W]`` causal mask (``create_attention_mask``).
        get_attention_mask_from_fusion: Bridge: True (its default) leaves the mask out.
    """

    def __init__(self, stack: str = "megatron", *, pad_id: int = 0, attention_mask: bool = False,
                 get_attention_mask_from_fusion: bool = True) -> None:
        if stack not in ("megatron", "bridge"):
            raise ShardError(f"unknown stack {stack!r}", field="stack", expected=["megatron", "bridge"], actual=stack)
        self.stack = stack
        self.pad_id = int(pad_id)
        self.with_mask = bool(attention_mask) if stack == "megatron" else not get_attention_mask_from_fusion

    def __call__(self, samples: List[dict]) -> dict:
        if not samples:
            raise ShardError("an empty micro-batch cannot be collated", field="batch")
        widths = {s["width"] for s in samples}
        width = max(len(s["input_ids"]) for s in samples) if widths == {None} else max(w for w in widths if w)
        b = len(samples)
        tokens = np.full((b, width), self.pad_id, dtype=np.int64)
        labels = np.full((b, width), self.pad_id, dtype=np.int64)
        bridge = self.stack == "bridge"
        loss = np.zeros((b, width), dtype=np.int64 if bridge else np.float32)
        for row, s in enumerate(samples):
            ids, mask = s["input_ids"], s["loss_mask"]
            n = ids.shape[0]
            if bridge:  # the row is input_ids[:-1]; label j is input_ids[j+1]; the stored mask is label-aligned
                tokens[row, :n - 1] = ids[:-1]
                loss[row, :n - 1] = mask[:-1]
            else:
                tokens[row, :n] = ids
                loss[row, :n] = mask
                loss[row, n - 1] = 0  # its label would be padding
            labels[row, :n - 1] = ids[1:]
        out = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
               "loss_mask": torch.from_numpy(loss),
               "position_ids": torch.arange(width, dtype=torch.int64).unsqueeze(0).expand(b, width).contiguous()}
        if self.with_mask:
            causal = torch.tril(torch.ones((width, width))).unsqueeze(0) < 0.5
            out["attention_mask"] = causal.unsqueeze(0).expand(b, 1, width, width).contiguous()
        return out
