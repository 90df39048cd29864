"""How Megatron's stock samplers hand a global sample order to data-parallel ranks, and the shuffle
the adapters draw today. Every planner in this package lays its output out by these two rules.

**The sampler.** Megatron-LM's ``MegatronPretrainingSampler`` (``dataloader_type="single"``;
``megatron/training/datasets/data_samplers.py``, and the same class in Megatron-Bridge's
``megatron/bridge/data/samplers.py``) walks the dataset's indices ``consumed_samples,
consumed_samples + 1, ...`` in order, cuts them into groups of ``micro_batch_size * dp``,
and gives rank ``r`` the slice ``[r * mbs, (r + 1) * mbs)`` of each group as one micro-batch.
A training step consumes ``global_batch_size`` indices (``num_micro = gbs / (mbs * dp)``
groups), so global position ``g`` is

    step = g // gbs,  m = (g % gbs) // (mbs * dp),  rank = (g % (mbs * dp)) // mbs,  slot = g % mbs

and the dataset's index ``g`` is served at position ``g``: nothing re-shuffles it. That is what
lets an order baked into the dataset reach the ranks unchanged. The other stock samplers do
re-shuffle, so a planned order needs ``dataloader_type="single"``:

* ``"cyclic"`` (``MegatronPretrainingRandomSampler``, both stacks) draws
  ``torch.randperm`` of the epoch (seeded by the epoch) and deals it to ranks by stride;
* ``"batch"`` (Bridge's ``MegatronPretrainingBatchSampler``, the default of Bridge's
  ``GPTSFTDatasetConfig`` and required by its ``num_epochs``) draws ``torch.randperm`` seeded
  ``seed + epoch`` (its loader does not expose ``shuffle=False``) and deals each global batch
  to ranks by stride ``r, r + dp, ...``.

**The shuffle.** Every adapter (``SFTIndexedDataset`` for Megatron-LM, ``PackedSFTDataset`` for
Bridge, ``PaddingFreeDataset`` for TRL: :func:`~.samples.sample_index`) serves epoch ``e`` of ``n``
packs as the ``(e+1)``-th ``permutation(n)`` drawn from one ``numpy.random.RandomState(seed)``;
epochs follow each other, so epoch ``e`` starts at global position ``e * n`` and, unless ``gbs``
divides ``n``, a step can straddle two epochs.
:func:`base_permutation` draws exactly that, so a balanced order keeps the packs of every
global batch of the run it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from ..errors import ShardError

__all__ = ["Topology", "base_permutation", "position_of", "where"]


@dataclass(frozen=True)
class Topology:
    """The data-parallel shape a plan is laid out for.

    Attributes:
        data_parallel_size: data-parallel ranks (with context parallelism, the DP size alone:
            CP ranks of one DP rank read the same samples).
        micro_batch_size: samples (packs) per micro-batch per rank.
        global_batch_size: samples per optimizer step, a multiple of ``micro_batch_size * dp``.
    """

    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ShardError(f"{name} must be an integer >= 1", field=name, actual=value)
        group = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % group:
            raise ShardError("global_batch_size must be a multiple of micro_batch_size * data_parallel_size",
                             field="global_batch_size", expected=f"a multiple of {group}",
                             actual=self.global_batch_size, hint="Megatron refuses such a batch too")

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """The topology ``--balance-for`` spells ``"DP,MBS,GBS"``.

        Raises:
            ShardError: not three integers, or not a consistent topology (see the class).
        """
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 3:
            raise ShardError(f"expected DP,MBS,GBS (three positive integers), not {text!r}", field="balance_for",
                             actual=text)
        return cls(*values)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def per_rank(self) -> int:
        """Samples each rank trains on per step."""
        return self.global_batch_size // self.data_parallel_size

    def to_dict(self) -> dict:
        return {"data_parallel_size": int(self.data_parallel_size), "micro_batch_size": int(self.micro_batch_size),
                "global_batch_size": int(self.global_batch_size)}

    @classmethod
    def from_dict(cls, data: Mapping, *, path: Optional[str] = None) -> "Topology":
        """Parse :meth:`to_dict`'s output strictly (unknown keys are ignored).

        Raises:
            ShardError: a key missing or not a positive integer; an inconsistent batch.
        """
        if not isinstance(data, Mapping):
            raise ShardError("topology must be an object", path=path, field="topology")
        values = {}
        for key in ("data_parallel_size", "micro_batch_size", "global_batch_size"):
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ShardError(f"topology field {key!r} is missing or not an integer", path=path,
                                 field=f"topology.{key}", actual=value)
            values[key] = value
        try:
            return cls(**values)
        except ShardError as exc:
            raise ShardError(exc.message, path=path, field=f"topology.{exc.field}", expected=exc.expected,
                             actual=exc.actual) from None

    def describe(self) -> str:
        return (f"DP {self.data_parallel_size}, micro-batch {self.micro_batch_size}, "
                f"global batch {self.global_batch_size}")


def where(positions, topology: Topology):
    """``(step, micro_batch, rank, slot)`` arrays of global positions under Megatron's sampler."""
    g = np.asarray(positions, dtype=np.int64)
    dp, mbs, gbs = topology.data_parallel_size, topology.micro_batch_size, topology.global_batch_size
    q = g % gbs
    w = q % (mbs * dp)
    return g // gbs, q // (mbs * dp), w // mbs, w % mbs


def position_of(step, micro_batch, rank, slot, topology: Topology):
    """The global position of ``(step, micro_batch, rank, slot)`` (inverse of :func:`where`)."""
    dp, mbs, gbs = topology.data_parallel_size, topology.micro_batch_size, topology.global_batch_size
    return (np.asarray(step, dtype=np.int64) * gbs + np.asarray(micro_batch, dtype=np.int64) * mbs * dp
            + np.asarray(rank, dtype=np.int64) * mbs + np.asarray(slot, dtype=np.int64))


def base_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s shuffle of ``n`` items, as the adapters draw it (module doc): the
    ``(epoch+1)``-th ``RandomState(seed).permutation(n)``. int64[n].

    Raises:
        ShardError: a negative epoch or size, or a seed numpy's RandomState refuses.
    """
    if n < 0 or epoch < 0:
        raise ShardError("the shuffle needs n >= 0 and epoch >= 0", field="epoch", actual=(n, epoch))
    try:
        rng = np.random.RandomState(seed)
    except (ValueError, TypeError) as exc:
        raise ShardError(f"seed {seed!r} is not a valid numpy seed ({exc})", field="seed", actual=seed) from None
    for _ in range(epoch):  # earlier epochs' draws, discarded: the stream is shared across epochs
        rng.shuffle(np.arange(n))
    return rng.permutation(n).astype(np.int64, copy=False)
