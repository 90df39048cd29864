"""The share arithmetic of a mixture: how much of each source each split takes, and which sequences.

Pure numbers (no file is read here; :mod:`.mixplan` feeds it the stores' lengths). Per split
``s`` and source ``k`` the planner knows the kept sequences of ``k`` that fall in ``s`` and each
one's *measure* in the mixture's unit: its trained tokens (``trained_tokens``: loss positions
after truncation, as the pack will train them), its padded length (``tokens``), or 1
(``sequences``, ``epochs``). ``M[s,k]`` is their sum: one epoch of ``k`` in ``s``.

**Targets.** With weights ``w`` in a unit other than ``epochs``, the target shares are
``t = w / sum(w)``; split ``s`` holds a total ``T_s`` (in the unit) and source ``k`` must give
``T_s * t_k``, i.e. ``e[s,k] = T_s * t_k / M[s,k]`` epochs of itself. ``T_s`` is the mixture's
``total`` times the split's weight share, or, without a total, the largest total the caps allow:
``min_k cap_k * M[s,k] / t_k``, where a source's cap (in epochs) is its ``max_epochs`` (default 1
without a total: nothing is repeated unless the file says so; unlimited with one) and its
``max_tokens`` over its tokens of all splits. With the ``epochs`` unit, ``e[s,k] = w_k``.
A target above a cap is refused, saying the largest total the caps allow (:class:`~megatron_sft_idx.errors.InfeasibleMixtureError`).

**Realisation.** ``e = W + r`` (``W`` whole epochs): every sequence ``W`` times, then the
sequences of a seeded permutation (per split and source) in order, as many as bring the
remainder ``r * M`` closest (the shorter on a tie): each source's realised amount is within half
a sequence's measure of its target, and its share within one sequence.

Seeds are derived from the run's seed and the store's id, never the source's position, so adding
a source leaves the other sources' splits and samples unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InfeasibleMixtureError, ShardError

#: Units whose measure of a sequence is 1 (the share arithmetic then counts sequences).
COUNTED_UNITS = ("sequences", "epochs")


def derived_seed(seed: int, content_id: str, *salt: int) -> int:
    """A 64-bit seed from the run's ``seed``, a store's content id (32 hex digits,
    :func:`~.store.content_id`) and ``salt``: the same numbers give the same seed on every machine,
    and a source's draws depend neither on where the source is listed nor on where its files lie."""
    entropy = [int(seed) % (1 << 64), int(content_id[:16], 16), int(content_id[16:32], 16)] + [int(s) for s in salt]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


@dataclass(frozen=True)
class Caps:
    """A source's caps in epochs of itself (``inf``: none)."""

    epochs: float


def source_caps(max_epochs: Sequence[Optional[float]], max_tokens: Sequence[Optional[int]],
                tokens_all: Sequence[int], repeats: bool) -> List[Caps]:
    """Each source's cap in epochs (module doc): ``max_epochs`` (default 1, or unlimited where the
    mixture asks for ``repeats``: it has a total, or its weights are epochs) and
    ``max_tokens / tokens_all`` (its padded tokens over all splits)."""
    out = []
    for me, mt, tok in zip(max_epochs, max_tokens, tokens_all):
        cap = float(me) if me is not None else (math.inf if repeats else 1.0)
        if mt is not None and tok > 0:
            cap = min(cap, mt / tok)
        out.append(Caps(cap))
    return out


def split_epochs(unit: str, weights: Sequence[float], names: Sequence[str], amounts: np.ndarray,
                 caps: Sequence[Caps], total: Optional[float], split: str, path: Optional[str] = None) -> np.ndarray:
    """``e[k]``: the epochs of each source split ``split`` takes (module doc), float64.

    Args:
        amounts: ``M[k]``, one epoch of each source in this split, in the unit (> 0 each).
        total: this split's total in the unit, or None for the largest the caps allow.

    Raises:
        InfeasibleMixtureError: a target above a cap (saying the largest total the caps allow), or a source
            with nothing in this split.
    """
    amounts = np.asarray(amounts, dtype=np.float64)
    for k, name in enumerate(names):
        if not amounts[k] > 0:
            raise InfeasibleMixtureError(f"source {name!r} has no sequence in split {split!r}: its share cannot be realised "
                             "there", path=path, field=f"sources[{k}]",
                             hint="give that split more weight (--split), or leave the source out")
    cap = np.array([c.epochs for c in caps], dtype=np.float64)
    if unit == "epochs":
        e = np.asarray(weights, dtype=np.float64)
        over = np.flatnonzero(e > cap * (1 + 1e-12))
        if over.size:
            k = int(over[0])
            raise InfeasibleMixtureError(f"source {names[k]!r} is asked for {e[k]:g} epochs, but its max_tokens allows "
                             f"{cap[k]:.4g}", path=path, field=f"sources[{k}].weight", expected=f"<= {cap[k]:.6g}",
                             actual=e[k], hint="lower the weight or raise max_tokens")
        return e
    t = np.asarray(weights, dtype=np.float64)
    t = t / t.sum()
    best = float(np.min(cap * amounts / t))   # the largest total every cap allows
    if total is None:
        if not math.isfinite(best):   # (cannot happen: without a total every cap is finite)
            raise InfeasibleMixtureError("the mixture has no total and no source is capped", path=path, field="total")
        total = best
    e = total * t / amounts
    over = np.flatnonzero(e > cap * (1 + 1e-9))
    if over.size:
        k = int(over[0])
        raise InfeasibleMixtureError(f"targets are infeasible under the caps in split {split!r}: source {names[k]!r} would "
                         f"need {e[k]:.4g} epochs of itself, its cap is {cap[k]:.4g}; the largest total the caps "
                         f"allow there is {best:.6g} {unit.replace('_', ' ')}", path=path, field="total",
                         expected=f"<= {best:.6g}", actual=total,
                         hint="lower the total, raise that source's max_epochs / max_tokens, or change the weights")
    return e


def remainder_count(cum: np.ndarray, target: float) -> int:
    """How many sequences of a permutation (``cum``: its cumulative measure, with a leading 0) bring
    the remainder ``target`` closest (the fewer on a tie)."""
    n = cum.size - 1
    j = int(np.searchsorted(cum, target, side="right")) - 1   # cum[j] <= target
    j = min(max(j, 0), n)
    if j < n and (cum[j + 1] - target) < (target - cum[j]):
        j += 1
    return j


@dataclass(frozen=True)
class Realised:
    """One source in one split: ``whole`` epochs of every member, then ``extra`` (member positions,
    ascending) once more."""

    whole: int
    extra: np.ndarray

    def count(self, members: int) -> int:
        return self.whole * members + int(self.extra.size)


def realise(measure: np.ndarray, epochs: float, seed: int) -> Realised:
    """The sequences a source gives a split (module doc): ``measure`` per member (in member order),
    ``epochs`` of them, the remainder drawn by a permutation seeded with ``seed``.

    Raises:
        ShardError: negative or non-finite epochs.
    """
    if not (math.isfinite(epochs) and epochs >= 0):
        raise ShardError("epochs must be finite and >= 0", field="epochs", actual=epochs)
    n = measure.size
    whole = int(math.floor(epochs + 1e-12))
    rest = max(0.0, epochs - whole)
    if n == 0 or rest <= 0:
        return Realised(whole, np.empty(0, dtype=np.int64))
    perm = np.random.default_rng(seed).permutation(n)
    cum = np.zeros(n + 1, dtype=np.float64)
    np.cumsum(measure[perm], out=cum[1:])
    j = remainder_count(cum, rest * float(cum[-1]))
    if j == n:   # a full extra epoch: every member once more
        return Realised(whole + 1, np.empty(0, dtype=np.int64))
    return Realised(whole, np.sort(perm[:j]).astype(np.int64))


def shares(amounts: np.ndarray) -> np.ndarray:
    """Each amount's share of their sum (zeros when the sum is 0)."""
    amounts = np.asarray(amounts, dtype=np.float64)
    total = amounts.sum()
    return amounts / total if total > 0 else np.zeros_like(amounts)


def target_shares(unit: str, weights: Sequence[float], epochs: np.ndarray, amounts: np.ndarray) -> np.ndarray:
    """The target share of each source in the unit: the normalised weights, or (``epochs`` unit)
    the shares its epochs give."""
    if unit == "epochs":
        return shares(np.asarray(epochs, dtype=np.float64) * np.asarray(amounts, dtype=np.float64))
    return shares(np.asarray(weights, dtype=np.float64))


__all__ = ["Caps", "Realised", "derived_seed", "source_caps", "split_epochs", "realise",
           "remainder_count", "shares", "target_shares", "COUNTED_UNITS"]
