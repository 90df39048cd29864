"""Hugging Face TRL and transformers padding-free training over packed shards.

:class:`PaddingFreeDataset` serves each pack of a shard, a set, a ``.npy``/Parquet or an
``s3://`` / ``msc://`` URL (anything :func:`megatron_sft_idx.open.open_packed` opens) as the
row TRL's own packer (``pack_dataset``) produces: ``{"input_ids", "labels", "seq_lengths",
"position_ids"}``. :class:`PaddingFreeCollator` flattens a batch of them into one row, the
batch TRL 1.16's ``DataCollatorForLanguageModeling(padding_free=True)`` and transformers'
``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` build
over the same sequences, key for key, value, dtype and shape (tested against the installed
packages: ``tests/training/test_training_hf.py``):

* ``input_ids`` ``(1, T)`` int64: the stored sequences, concatenated;
* ``labels`` ``(1, T)`` int64: ``-100`` at every sequence start; position ``j > 0`` of a
  sequence holds its token when the stored (label-aligned) mask trains predicting it, i.e.
  ``loss_mask[j - 1] == 1``, else ``-100`` (the model shifts labels by one itself);
* ``position_ids`` ``(1, T)`` int64, restarting at 0 per sequence;
* ``cu_seq_lens_q/k`` ``(n + 1,)`` int32, ``max_length_q/k`` Python ints, ``seq_idx`` ``(1, T)`` int32;
* ``pad_to_multiple_of``: as TRL, the row is right-padded with ``pad_token_id`` (labels
  -100, position 0), so every padding position is a segment of its own.

TRL's trainer with these rows (its own collator; no dataset preparation)::

    ds = PaddingFreeDataset("s3://bucket/sft/train_000")
    args = SFTConfig(padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True})
    SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train()

Any transformers ``Trainer``: ``Trainer(model, args, train_dataset=ds,
data_collator=PaddingFreeCollator())`` (``position_ids`` in the rows survives the trainer's
column removal; the collator rebuilds the sequence lengths from it).

A balanced order (docs/BATCHING.md) becomes the dataset's sample order; the trainer must
then read it sequentially (``train_sampling_strategy="sequential"``, checked by
:func:`check_training_args`). accelerate gives rank ``r`` batch ``k * W + r``: each group of
``W`` consecutive micro-batches is one step's data-parallel slice, Megatron's layout. An order
that records trained-token counts adds ``step_trained_tokens`` to every row and batch: the
step's global ``num_items_in_batch``; :class:`StepDenominators` makes the trainer use it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..batching.denominators import STEP_TOKENS_KEY, served_counts
from ..batching.layout import Topology
from ..batching.samples import sample_index, sources_of, token_sources
from ..batching.trained import STORED
from ..errors import ShardError
from ..open import open_packed

__all__ = ["PaddingFreeDataset", "PaddingFreeCollator", "pack_labels", "check_training_args", "flatten_sequences",
           "IGNORE_INDEX", "StepDenominators"]

#: The label value the loss ignores (transformers' and TRL's ``-100``).
IGNORE_INDEX = -100


def pack_labels(input_ids: np.ndarray, loss_mask: np.ndarray, seq_boundaries: np.ndarray,
                answer_only_loss: bool = True) -> np.ndarray:
    """TRL's labels of one pack from its stored label-aligned mask (int64).

    ``labels[j] = input_ids[j]`` where ``loss_mask[j - 1]`` trains it, else -100; -100 at every
    sequence start. ``answer_only_loss=False`` trains every position but the starts.

    Example: ids ``[5, 6, 7]``, mask ``[0, 1, 0]`` -> labels ``[-100, -100, 7]``.
    """
    ids = np.asarray(input_ids).astype(np.int64, copy=False)
    labels = np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64)
    if ids.shape[0] > 1:
        trained = (np.asarray(loss_mask[:-1]) != 0) if answer_only_loss else np.ones(ids.shape[0] - 1, bool)
        labels[1:] = np.where(trained, ids[1:], IGNORE_INDEX)
    labels[np.asarray(seq_boundaries[:-1], dtype=np.int64)] = IGNORE_INDEX
    return labels


class PaddingFreeDataset(torch.utils.data.Dataset):
    """Packs as TRL's packed rows, over any packed source.

    Args:
        source: a packed source or anything :func:`open_packed` opens (local or a URL).
        answer_only_loss: train only where the stored mask trains (default); False trains
            every position but each sequence's first, as TRL's ``completion_only_loss=False``.
        balanced_order: an :class:`~megatron_sft_idx.batching.Order`, an order file, or
            ``"auto"`` (the order beside a one-path ``source``): it becomes the sample order
            (its seed must be ``seed``, its pack costs this data's).
        seed: the run's data seed (checked against the order's).
        max_num_samples: how many samples to serve: with an order, its first ones (default: one
            epoch); without, Bridge's samples mapping (one seeded permutation per epoch,
            :func:`~megatron_sft_idx.batching.samples.sample_index`; default: the packs, in
            stored order).
        topology: a :class:`~megatron_sft_idx.batching.Topology`; warns when the order was
            planned for another.
        return_source_ids: add ``source_ids`` (each position's source) to the rows, which
            :class:`PaddingFreeCollator` flattens with them: data written from a mixture
            (``--mix``); :attr:`sources` names them.

    Raises:
        ShardError: the source does not open; an order of another seed or other packs.
    """

    def __init__(self, source, *, answer_only_loss: bool = True, balanced_order=None, seed: int = 1234,
                 max_num_samples: Optional[int] = None, topology=None, return_source_ids: bool = False) -> None:
        data_path = source if isinstance(source, str) else None
        if isinstance(source, (str, list, tuple)) or hasattr(source, "__fspath__"):
            source = open_packed(source)
        self.source = source
        self.answer_only_loss = bool(answer_only_loss)
        self.return_source_ids = bool(return_source_ids)
        if self.return_source_ids:
            sources_of(source, data_path)   # (refused now, not at the first row)
        self.order = None
        if balanced_order is not None:
            from ..batching.serve import served_order   # (start-up: numba, only with a balanced order)

            self.order = served_order(balanced_order, source, seed=seed, data_path=data_path, topology=topology)
            max_num_samples = self.order.num_packs if max_num_samples is None else max_num_samples
        self.samples_mapping = (None if max_num_samples is None else
                                sample_index(int(max_num_samples), len(source), seed=seed, balanced=self.order,
                                             path=data_path))
        self._served = None if self.order is None else served_counts(
            self.order, self.samples_mapping, STORED if self.answer_only_loss else None, path=data_path,
            global_batch_size=getattr(topology, "global_batch_size", None))

    @property
    def ordered(self) -> bool:
        """True when a balanced order fixes the sample order (serve it sequentially)."""
        return self.order is not None

    def as_iterable_dataset(self):
        """This dataset as a Hugging Face ``datasets.IterableDataset``, for TRL's ``SFTTrainer``.

        TRL 1.16 takes only ``datasets`` objects. The rows stream in this dataset's order (the
        balanced order, the samples mapping, or the packs in stored order): build the dataset
        with ``max_num_samples`` for a shuffled run. On ``W`` ranks accelerate gives rank ``r``
        the ``r``-th micro-batch of each ``W`` consecutive ones, Megatron's layout. Nothing is
        copied: each row is read from the source when the trainer asks for it.
        """
        require_extra("hf", "datasets")
        import datasets   # (the optional [hf] extra, and a slow import: only for TRL's trainer)

        def rows():
            for i in range(len(self)):
                yield self[i]

        return datasets.IterableDataset.from_generator(rows)

    def __len__(self) -> int:
        return len(self.samples_mapping) if self.samples_mapping is not None else len(self.source)

    def __getitem__(self, idx) -> dict:
        """One pack as TRL's packed row; with a balanced order that records counts also
        ``step_trained_tokens`` (int: the global trained positions of the row's step), the pack
        checked against the order first."""
        position = idx = int(idx)
        if self.samples_mapping is not None:
            idx = int(self.samples_mapping[idx])
        pack = self.source[idx]
        bounds = np.asarray(pack.seq_boundaries, dtype=np.int64)
        lengths = np.diff(bounds)
        ids = np.asarray(pack.input_ids).astype(np.int64)
        row = {"input_ids": ids,
               "labels": pack_labels(ids, pack.loss_mask, bounds, self.answer_only_loss),
               "seq_lengths": [int(n) for n in lengths],
               "position_ids": np.arange(ids.shape[0], dtype=np.int64) - np.repeat(bounds[:-1], lengths)}
        if self.return_source_ids:
            row["source_ids"] = token_sources(self.source.source_ids(idx), lengths, ids.shape[0])
        if self._served is not None:
            self._served.check(idx, pack.input_ids, pack.loss_mask, pack.seq_start_id)
            row[STEP_TOKENS_KEY] = self._served.at(position)
        return row

    @property
    def sources(self) -> tuple:
        """The names ``source_ids`` index (data written from a mixture).

        Raises:
            ShardError: the data records no sources."""
        return sources_of(self.source)


class PaddingFreeCollator:
    """Callable ``rows -> one flattened padding-free batch`` (module doc), vectorised.

    Each row is a dict with ``input_ids``, ``labels`` and the sequence lengths as
    ``seq_lengths`` or ``position_ids`` (0 at each sequence start); a row with neither is
    one sequence (transformers' ``DataCollatorWithFlattening`` input).

    Args:
        pad_token_id: id of the padding with ``pad_to_multiple_of``.
        pad_to_multiple_of: right-pad the row to a multiple of this (TRL's option).
        return_flash_attn_kwargs, return_seq_idx: add ``cu_seq_lens_q/k`` and
            ``max_length_q/k``, and ``seq_idx`` (both on by default).

    Raises:
        ShardError: an empty batch, rows of unequal ``input_ids``/``labels`` length, or
            sequence lengths that do not add up to the row.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: Optional[int] = None, *,
                 return_flash_attn_kwargs: bool = True, return_seq_idx: bool = True) -> None:
        if pad_to_multiple_of is not None and int(pad_to_multiple_of) < 1:
            raise ShardError("pad_to_multiple_of must be >= 1", field="pad_to_multiple_of",
                             actual=pad_to_multiple_of)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = None if pad_to_multiple_of is None else int(pad_to_multiple_of)
        self.return_flash_attn_kwargs = bool(return_flash_attn_kwargs)
        self.return_seq_idx = bool(return_seq_idx)

    def __call__(self, rows: Sequence[dict]) -> dict:
        rows = [r for r in rows if len(r["input_ids"]) > 0]
        if not rows:
            raise ShardError("cannot collate an empty batch", field="batch")
        ids = np.concatenate([np.asarray(r["input_ids"], dtype=np.int64) for r in rows])
        labels = np.concatenate([np.asarray(r.get("labels", r["input_ids"]), dtype=np.int64) for r in rows])
        if labels.shape != ids.shape:
            raise ShardError("labels and input_ids differ in length", field="labels",
                             expected=ids.shape[0], actual=labels.shape[0])
        lengths = np.concatenate([_row_lengths(r) for r in rows])
        if int(lengths.sum()) != ids.shape[0] or (lengths < 1).any():
            raise ShardError("sequence lengths do not add up to the rows' tokens", field="seq_lengths",
                             expected=ids.shape[0], actual=int(lengths.sum()),
                             hint="pass the rows of PaddingFreeDataset (or TRL's packed rows) unchanged")
        total = ids.shape[0]
        if self.pad_to_multiple_of:
            pad = -(-total // self.pad_to_multiple_of) * self.pad_to_multiple_of - total
            if pad:
                ids = np.concatenate((ids, np.full(pad, self.pad_token_id, np.int64)))
                labels = np.concatenate((labels, np.full(pad, IGNORE_INDEX, np.int64)))
                lengths = np.concatenate((lengths, np.ones(pad, np.int64)))  # each pad: its own segment
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        labels[starts] = IGNORE_INDEX
        positions = np.arange(ids.shape[0], dtype=np.int64) - np.repeat(starts, lengths)
        out = {"input_ids": torch.from_numpy(ids[None]), "labels": torch.from_numpy(labels[None]),
               "position_ids": torch.from_numpy(positions[None])}
        if self.return_flash_attn_kwargs:
            cu = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            out["max_length_q"] = out["max_length_k"] = int(lengths.max())
        if self.return_seq_idx:
            out["seq_idx"] = torch.from_numpy(np.repeat(np.arange(lengths.shape[0], dtype=np.int32), lengths)[None])
        if all(STEP_TOKENS_KEY in r for r in rows):   # a balanced order's step count (every row: one step)
            out[STEP_TOKENS_KEY] = torch.tensor(max(int(r[STEP_TOKENS_KEY]) for r in rows), dtype=torch.int64)
        if "source_ids" in rows[0]:   # (a mixture's data: each position's source, -1 on padding)
            sources = np.full(ids.shape[0], -1, dtype=np.int64)
            flat = np.concatenate([np.asarray(r["source_ids"], dtype=np.int64) for r in rows])
            sources[:flat.shape[0]] = flat
            out["source_ids"] = torch.from_numpy(sources[None])
        return out


class StepDenominators:
    """Mixin for transformers' ``Trainer`` and TRL's ``SFTTrainer``: ``num_items_in_batch`` is
    the step count the batches carry (``step_trained_tokens``, from a balanced order's counts),
    not a count gathered from every process -- the same number, with no all-reduce.

    ``class Trainer(StepDenominators, SFTTrainer): pass``. The trainer keeps the key through its
    column removal, takes it out of every gradient-accumulation batch before the forward, and
    falls back to its own count when a batch carries none. Needs
    ``average_tokens_across_devices=True`` (the default: the loss is then multiplied by the
    process count and DDP averages, so each token weighs ``1 / N`` of its step). Uses two
    ``Trainer`` hooks (``_set_signature_columns_if_needed``, ``_get_num_items_in_batch``),
    tested with transformers 5.25 and TRL 1.16 (``tests/training/test_step_denominators.py``).

    Raises:
        ShardError: the micro-batches of one step carry different counts (the trainer's steps
            are not the order's: another batch size or world size), or
            ``average_tokens_across_devices=False``.
    """

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        if STEP_TOKENS_KEY not in self._signature_columns:
            self._signature_columns.append(STEP_TOKENS_KEY)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        served = [b.pop(STEP_TOKENS_KEY) for b in batch_samples if isinstance(b, dict) and STEP_TOKENS_KEY in b]
        if not served or len(served) != len(batch_samples):
            return super()._get_num_items_in_batch(batch_samples, device)
        values = {int(v) for v in served}
        if len(values) != 1:
            raise ShardError("the micro-batches of one optimizer step carry different step counts: the trainer's "
                             "steps are not the order's", field=STEP_TOKENS_KEY, actual=sorted(values),
                             hint="train with the topology the order was planned for (check_training_args)")
        if not self.args.average_tokens_across_devices:
            raise ShardError("the served step count is the global one: keep average_tokens_across_devices=True",
                             field="average_tokens_across_devices", expected=True, actual=False)
        return torch.tensor(values.pop(), device=device)


def _row_lengths(row: dict) -> np.ndarray:
    if "seq_lengths" in row:
        return np.asarray(row["seq_lengths"], dtype=np.int64).reshape(-1)
    if "position_ids" in row:
        pos = np.asarray(row["position_ids"]).reshape(-1)
        starts = np.flatnonzero(pos == 0)
        if starts.shape[0] == 0 or starts[0] != 0:
            raise ShardError("position_ids of a row must start at 0", field="position_ids",
                             actual=pos[:1].tolist())
        return np.diff(np.append(starts, pos.shape[0]))
    return np.array([len(row["input_ids"])], dtype=np.int64)


def check_training_args(dataset, args) -> None:
    """Refuse trainer arguments that would not serve ``dataset``'s balanced order as planned.

    ``args`` is a transformers ``TrainingArguments`` (or TRL's ``SFTConfig``). With an order,
    ``train_sampling_strategy`` must be ``"sequential"``; the run's topology
    (``per_device_train_batch_size``, ``world_size``, gradient accumulation) warns when it
    is not the planned one.

    Raises:
        ShardError: a random (or length-grouped) sampler over an ordered dataset.
    """
    if not getattr(dataset, "ordered", False):
        return
    strategy = getattr(args, "train_sampling_strategy", None)
    if strategy != "sequential":
        raise ShardError("a balanced order is served only in its own order", field="train_sampling_strategy",
                         expected="sequential", actual=strategy,
                         hint="pass train_sampling_strategy=\"sequential\" to TrainingArguments/SFTConfig")
    micro = int(args.per_device_train_batch_size)
    world = max(1, int(getattr(args, "world_size", 1)))
    topology = Topology(world, micro, micro * world * int(args.gradient_accumulation_steps))
    order = getattr(dataset, "order", None)
    if order is not None:
        order.warn_if_mismatch(topology)


def flatten_sequences(rows: Sequence[dict]) -> List[dict]:
    """The rows' sequences one per dict (``input_ids``, ``labels``): the per-sequence input of
    transformers' ``DataCollatorWithFlattening`` and TRL's unpacked padding-free path."""
    out = []
    for row in rows:
        bounds = np.concatenate(([0], np.cumsum(_row_lengths(row))))
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row.get("labels", row["input_ids"]))
        out += [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(bounds[:-1], bounds[1:])]
    return out
