"""What each batch is handed: its optimizer step's global trained-token count, from the order.

An order planned with the data's counts (:mod:`.trained`, :meth:`~.order.Order.step_trained`)
knows, before training, how many positions every step trains on all ranks together. The
adapters put that number in every sample under :data:`STEP_TOKENS_KEY`, so a loss function can
divide the micro-batch's loss *sum* by the step's global count -- the exact token mean of the
step -- with no all-reduce of counts (docs/TRAINING.md, "The loss the user meant").

Each adapter serves the count under its consumer's rule (:data:`~.trained.CONSUMER_RULES`):
Megatron-LM and TRL / transformers the stored mask, Megatron-Bridge 0.6 the stored mask without
EOS inputs (the order must have been counted with Bridge's EOS id), Bridge ``main`` the stored
mask under ``answer_only_loss``. The count is computed for the run's global batch size (a run
with another one than planned -- warned about -- still gets its own steps' counts), and every
pack an adapter reads is checked against the order's count of it: a pack whose loss mask says
otherwise is refused, naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import ShardError
from .trained import BRIDGE_06, STORED

__all__ = ["STEP_TOKENS_KEY", "ServedCounts", "served_counts", "pack_trained", "DenominatorWarning"]

#: The key of a sample (and of a collated batch) holding its step's global trained-token count.
STEP_TOKENS_KEY = "step_trained_tokens"


class DenominatorWarning(UserWarning):
    """An order is served without step counts (it records none for this consumer's rule)."""


def pack_trained(input_ids, loss_mask, seq_start_id, rule: str = STORED, eos_id: Optional[int] = None) -> int:
    """One pack's trained positions under ``rule`` (:mod:`.trained`): stored 1s at the read
    positions ``[start, end - 1)`` of each sequence, without EOS inputs for Bridge 0.6's."""
    loss = np.asarray(loss_mask) != 0
    n = loss.shape[0]
    if n == 0:
        return 0
    last = np.append(np.asarray(seq_start_id, dtype=np.int64)[1:], n) - 1
    loss = loss.copy()
    loss[last[last >= 0]] = False
    if rule == BRIDGE_06:
        loss &= np.asarray(input_ids) != eos_id
    return int(loss.sum())


@dataclass
class ServedCounts:
    """Per sample position, its step's global count; per pack, the order's count (to check).

    Attributes:
        step_tokens: int64 per step of the served stream (positions ``// global_batch_size``);
            a last incomplete step holds what its served positions hold.
        pack_tokens: int64 per pack, the order's record.
        global_batch_size: the run's samples per step.
        rule, eos_id: what is counted (:mod:`.trained`).
    """

    step_tokens: np.ndarray
    pack_tokens: np.ndarray
    global_batch_size: int
    rule: str
    eos_id: Optional[int] = None
    path: Optional[str] = None

    def at(self, position: int) -> int:
        """The global count of the step sample ``position`` belongs to."""
        return int(self.step_tokens[int(position) // self.global_batch_size])

    def check(self, pack_id: int, input_ids, loss_mask, seq_start_id) -> None:
        """Refuse a pack whose mask trains another number of positions than the order records.

        Raises:
            ShardError: naming the pack, the rule and both counts.
        """
        found = pack_trained(input_ids, loss_mask, seq_start_id, self.rule, self.eos_id)
        want = int(self.pack_tokens[int(pack_id)])
        if found != want:
            raise ShardError(f"pack {pack_id} trains {found} positions ({self.rule!r} rule), but the order's count "
                             f"of it is {want}: the order was planned for other data", path=self.path,
                             pack=int(pack_id), field=f"trained.{self.rule}", expected=want, actual=found,
                             hint="re-plan the order for this data (plan-batches --out, or --balance-for)")


def served_counts(order, sample_index, rule: Optional[str], *, global_batch_size: Optional[int] = None,
                  eos_id: Optional[int] = None, path: Optional[str] = None) -> Optional[ServedCounts]:
    """The counts an adapter serves with ``order`` over its ``sample_index`` (pack per position),
    or None -- with a :class:`DenominatorWarning` saying why -- when the order records none under
    ``rule`` (None: the consumer trains positions no rule counts, e.g. ``answer_only_loss=False``).

    Raises:
        ShardError: Bridge 0.6's rule asked with another EOS id than the order was counted with.
    """
    trained = getattr(order, "trained", None)
    why = ("it was planned without counts (plan-batches --no-counts, or before they existed)" if trained is None else
           "this consumer trains positions no recorded rule counts" if rule is None else
           f"it records no {rule!r} counts (re-plan with --eos-id for Megatron-Bridge 0.6)"
           if rule not in trained.sequence else None)
    if why is not None:
        warnings.warn(f"the balanced order is served without step denominators ({STEP_TOKENS_KEY!r}): {why}",
                      DenominatorWarning, stacklevel=3)
        return None
    if rule == BRIDGE_06 and eos_id is not None and int(eos_id) != trained.eos_id:
        raise ShardError("the order counted Megatron-Bridge 0.6's trained tokens with another EOS id than this "
                         "dataset's", path=path, field="trained.eos_id", expected=trained.eos_id, actual=int(eos_id),
                         hint="re-plan the order with --eos-id set to the tokenizer's EOS")
    gbs = int(global_batch_size or order.topology.global_batch_size)
    packs = trained.pack(rule)
    values = packs[np.asarray(sample_index, dtype=np.int64)]
    cut = np.arange(0, values.shape[0], gbs)
    steps = np.add.reduceat(values, cut) if values.shape[0] else np.zeros(0, np.int64)
    return ServedCounts(step_tokens=steps.astype(np.int64), pack_tokens=packs, global_batch_size=gbs, rule=rule,
                        eos_id=trained.eos_id if rule == BRIDGE_06 else None, path=path)
