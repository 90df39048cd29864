"""Dynamic batching with NeMo-RL's semantics, planned from the stored sequence lengths.

NeMo-RL (``BatchedDataDict.shard_by_batch_size`` with ``dynamic_batching_args``) forms
token-budget micro-batches of unpacked, padded sequences at run time. This module plans the
same micro-batches ahead of training, from lengths alone, for every step of an epoch:

1. the epoch's sequences are shuffled as the adapters shuffle packs
   (:func:`~.layout.base_permutation`) and cut into steps of ``global_batch_size`` (NeMo-RL's
   "chunks"; an epoch's last partial step is left out, as a ``drop_last`` sampler does);
2. inside a step, sequences are sorted by length (stable) and dealt to the data-parallel ranks
   by stride: rank ``r`` takes sorted positions ``r, r + dp, r + 2 dp, ...`` — every rank gets
   the same count and a similar spread of lengths ("balanced across ranks");
3. one walk over the shard index ``k`` forms the micro-batches, shared by all ranks: row ``k``
   needs the longest of the ranks' ``k``-th sequences rounded up to ``sequence_length_round``
   (capped at the step's width: its longest sequence rounded up to ``batch_width_multiple``,
   NeMo-RL's padded batch tensor), and a new micro-batch starts when ``rows * width`` would
   exceed ``max_tokens_per_microbatch``. Each micro-batch is padded to its width.

Sorting stays inside a step, so step membership (and the optimisation) is the plain shuffle.
Every rank gets the same number of micro-batches in a step, but the number varies from step
to step: a training loop must take ``microbatches(step)`` from the plan (NeMo-RL's does;
Megatron-LM's and Megatron-Bridge's stock loops fix ``num_microbatches`` per run).

The plan is deterministic (seed, epoch, lengths, settings) and resumable: training that has
consumed ``c`` sequences (a multiple of the global batch) continues at step
``c // global_batch_size`` of the run (:meth:`DynamicBatchPlan.step_of`).

Example::

    plan = plan_dynamic(lengths, global_batch_size=256, data_parallel_size=8,
                        max_tokens_per_microbatch=16384, sequence_length_round=64, seed=1, epoch=0)
    for ids, width in plan.rank_microbatches(step=0, rank=3): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import numpy as np

from ..errors import ShardError
from . import _kernels
from .layout import base_permutation

__all__ = ["DynamicBatchPlan", "plan_dynamic"]


@dataclass
class DynamicBatchPlan:
    """One epoch's dynamic micro-batches (module doc).

    Attributes:
        served: ``[steps * gbs]`` sequence ids (int32; int64 past 2**31 - 2 sequences): step
            ``s``'s ranks in order, each rank's ``gbs / dp`` sequences ascending by length
            (NeMo-RL's ``batch_sorted_indices``).
        mb_offsets: int64[steps + 1]: CSR pointers of each step's micro-batches.
        mb_bounds: int64[M, 2]: ``[start, end)`` of each micro-batch in a rank's share.
        mb_widths: int64[M]: padded width of each micro-batch (tokens per row).
    """

    served: np.ndarray
    mb_offsets: np.ndarray
    mb_bounds: np.ndarray
    mb_widths: np.ndarray
    lengths: np.ndarray
    global_batch_size: int
    data_parallel_size: int
    max_tokens_per_microbatch: int
    sequence_length_round: int
    seed: int
    epoch: int

    @property
    def steps(self) -> int:
        return int(self.mb_offsets.shape[0] - 1)

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    def microbatches(self, step: int) -> int:
        """Micro-batches of step ``step`` of this epoch (the same on every rank)."""
        s = self._step(step)
        return int(self.mb_offsets[s + 1] - self.mb_offsets[s])

    def _step(self, step: int) -> int:
        if not 0 <= int(step) < self.steps:
            raise ShardError(f"step {step} is outside this epoch's {self.steps} steps", field="step", actual=step)
        return int(step)

    def rank_microbatches(self, step: int, rank: int) -> List[Tuple[np.ndarray, int]]:
        """``[(sequence ids, width), ...]``: rank ``rank``'s micro-batches of step ``step``."""
        s = self._step(step)
        if not 0 <= int(rank) < self.data_parallel_size:
            raise ShardError(f"rank {rank} is outside DP {self.data_parallel_size}", field="rank", actual=rank)
        base = s * self.global_batch_size + int(rank) * self.per_rank
        out = []
        for j in range(int(self.mb_offsets[s]), int(self.mb_offsets[s + 1])):
            lo, hi = self.mb_bounds[j]
            out.append((self.served[base + lo:base + hi], int(self.mb_widths[j])))
        return out

    def step_of(self, consumed_samples: int, epoch_offset: int = 0) -> int:
        """The step of this epoch where training that has consumed ``consumed_samples`` sequences
        resumes; ``epoch_offset`` is the sequences consumed by earlier epochs.

        Raises:
            ShardError: the count is not on a step boundary, or lies outside this epoch.
        """
        within = int(consumed_samples) - int(epoch_offset)
        if within < 0 or within % self.global_batch_size or within // self.global_batch_size > self.steps:
            raise ShardError(f"consumed_samples {consumed_samples} is not a step boundary of this epoch",
                             field="consumed_samples", expected=f"{epoch_offset} + k * {self.global_batch_size}, "
                             f"k <= {self.steps}", actual=consumed_samples,
                             hint="resume from a checkpoint's consumed_samples, which counts whole steps")
        return within // self.global_batch_size

    def iter_rank(self, rank: int, start_step: int = 0) -> Iterator[Tuple[int, np.ndarray, int]]:
        """``(step, sequence ids, width)`` for every micro-batch of ``rank`` from ``start_step`` on."""
        for s in range(int(start_step), self.steps):
            for ids, width in self.rank_microbatches(s, rank):
                yield s, ids, width

    def stats(self) -> Dict[str, float]:
        """Micro-batches, tokens, padded tokens and the padding share (1 - tokens / padded)."""
        counts = np.diff(self.mb_offsets)
        rows = self.mb_bounds[:, 1] - self.mb_bounds[:, 0]
        padded = int((rows * self.mb_widths).sum()) * self.data_parallel_size
        tokens = int(self.lengths[self.served].sum()) if self.served.size else 0
        return {"steps": self.steps, "microbatches": int(counts.sum()),
                "microbatches_per_step_mean": float(counts.mean()) if counts.size else 0.0,
                "microbatches_per_step_max": int(counts.max()) if counts.size else 0,
                "tokens": tokens, "padded_tokens": padded,
                "padding_share": float(1 - tokens / padded) if padded else 0.0}


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ShardError(f"{name} must be an integer >= 1", field=name, actual=value)
    return int(value)


def _overlong(order: np.ndarray, lengths: np.ndarray, gbs: int, budget: int, rnd: int,
              width_mult: int) -> ShardError:
    """The error for sequences wider than the budget: how many of the sequences served, the
    longest (its id and length) and the smallest budget that fits them all, in one message.
    A sequence's width is its length rounded up to ``rnd``, capped at its step's width (the
    step's longest rounded up to ``width_mult``), as the kernel computes it."""
    ids = order.reshape(-1, gbs)
    lens = lengths[ids].astype(np.int64)
    step_width = -(-lens.max(axis=1, keepdims=True) // width_mult) * width_mult
    need = np.minimum(-(-lens // rnd) * rnd, step_width)
    over = need > budget
    longest = int(np.argmax(np.where(over, lens, 0)))
    seq, length = int(ids.flat[longest]), int(lens.flat[longest])
    fits = int(need.max())
    rounded = f", rounded up to a multiple of {rnd}" if rnd > 1 else ""
    count = int(over.sum())
    verb = "does" if count == 1 else "do"
    return ShardError(
        f"{count:,} of the {lens.size:,} sequences served {verb} not fit one micro-batch of {budget:,} tokens; "
        f"the longest is sequence {seq} ({length:,} tokens{rounded})", field="max_tokens_per_microbatch",
        pack=None, expected=f">= {fits:,} (fits every sequence)", actual=budget,
        hint=f"raise max_tokens_per_microbatch (--max-tokens-per-microbatch) to {fits} or more, or truncate "
             f"sequences to {budget:,} tokens (preprocess-sft --overlong truncate --pack-size N)")


def plan_dynamic(lengths, *, global_batch_size: int, data_parallel_size: int, max_tokens_per_microbatch: int,
                 sequence_length_round: int = 1, seed: int = 0, epoch: int = 0, batch_width_multiple: int = 1,
                 order=None) -> DynamicBatchPlan:
    """Plan epoch ``epoch``'s dynamic micro-batches of sequences of the given ``lengths``.

    Args:
        lengths: tokens of every sequence (integers >= 1), indexed by sequence id.
        global_batch_size: sequences per step, a multiple of ``data_parallel_size``.
        max_tokens_per_microbatch: the budget ``rows * width`` of every micro-batch.
        sequence_length_round: widths are rounded up to this multiple.
        batch_width_multiple: the step's width (NeMo-RL's batch tensor) is its longest sequence
            rounded up to this multiple; no micro-batch is wider.
        order: the epoch's sequence order to cut into steps (default: the adapters' shuffle).

    Raises:
        ShardError: a bad setting or length; sequences whose rounded length exceeds the budget
            (how many, the longest, and the budget that fits them all): raise the budget or
            truncate such sequences first.
    """
    gbs = _positive("global_batch_size", global_batch_size)
    dp = _positive("data_parallel_size", data_parallel_size)
    budget = _positive("max_tokens_per_microbatch", max_tokens_per_microbatch)
    rnd = _positive("sequence_length_round", sequence_length_round)
    width_mult = _positive("batch_width_multiple", batch_width_multiple)
    if gbs % dp:
        raise ShardError("global_batch_size must be a multiple of data_parallel_size", field="global_batch_size",
                         expected=f"a multiple of {dp}", actual=gbs)
    lengths = np.asarray(lengths)
    if lengths.dtype not in (np.int32, np.int64) or not lengths.flags.c_contiguous:  # else used in place
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
        raise ShardError("sequence lengths must be a 1-D array of integers >= 1", field="lengths")
    n = lengths.shape[0]
    order = base_permutation(n, seed, epoch) if order is None else np.ascontiguousarray(order, dtype=np.int64)
    if order.ndim != 1 or (order.size and (order.min() < 0 or order.max() >= n)):
        raise ShardError("order must hold sequence ids in [0, n)", field="order")
    steps = order.shape[0] // gbs
    order = order[:steps * gbs]
    served = np.empty(steps * gbs, dtype=np.int32 if n < 2**31 - 1 else np.int64)
    mb_offsets = np.zeros(steps + 1, dtype=np.int64)
    worst = steps * (gbs // dp)
    mb_bounds = np.empty((worst, 2), dtype=np.int64)
    mb_widths = np.empty(worst, dtype=np.int64)
    bad = _kernels.dynamic_microbatches(order, lengths, gbs, dp, budget, rnd, width_mult, served, mb_offsets,
                                        mb_bounds, mb_widths)
    if bad >= 0:
        raise _overlong(order, lengths, gbs, budget, rnd, width_mult)
    used = int(mb_offsets[-1])
    return DynamicBatchPlan(served=served, mb_offsets=mb_offsets, mb_bounds=mb_bounds[:used].copy(),
                            mb_widths=mb_widths[:used].copy(), lengths=lengths, global_batch_size=gbs,
                            data_parallel_size=dp, max_tokens_per_microbatch=budget, sequence_length_round=rnd,
                            seed=int(seed), epoch=int(epoch))
