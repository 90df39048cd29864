"""A mixture's packs in an order that keeps the target shares over every window of steps.

A mixture's packs are mixed: pack ``p`` holds ``measures[p, k]`` of source ``k`` (trained tokens,
tokens or sequences: the mixture's unit). A shuffle keeps the shares over a whole epoch only: a
run stopped early, or a window of a few steps, holds whatever the draw put there. :func:`interleave`
orders the packs of one epoch so that every prefix -- hence every window -- stays close to the
target shares ``t``: a greedy low-discrepancy walk (the multi-source analogue of a Bresenham line).

The packs are dealt into one queue per source (the source a pack holds most of, relative to its
target), each queue in a seeded random order; at each position the walk takes the head of the
queue that brings the running totals closest to ``t`` (the sum over sources of
``(C_k - t_k T)^2 / t_k`` after adding the pack, ``C`` the running measure per source and ``T``
its total), the lowest queue on a tie. So each epoch is a permutation of the packs, a function of
its arguments alone, and different epochs (seeds) draw different queue orders. With more than
:data:`CANDIDATES` sources only that many queues -- those of the sources most behind -- are
weighed at each position. Cost: O(P * S * min(S, CANDIDATES)) in numba (``bench/mix_plan.py``).

:func:`~.balance.plan_order` balances the steps of such an order (``base_order=``) without changing
which packs make a step, so the windows keep their shares.
"""

from __future__ import annotations

import numpy as np

from .._numba import numba
from ..errors import ShardError

__all__ = ["interleave", "CANDIDATES"]

#: Queues weighed per position when there are more sources.
CANDIDATES = 16
_TINY = 1e-12


@numba.njit(cache=True)
def _walk(items, queue_starts, measures, target, candidates, out):
    n_src = target.shape[0]
    heads = queue_starts[:-1].copy()
    cum = np.zeros(n_src, dtype=np.float64)
    total = 0.0
    behind = np.empty(n_src, dtype=np.float64)
    order = np.empty(n_src, dtype=np.int64)
    for pos in range(out.shape[0]):
        count = 0
        for q in range(n_src):
            if heads[q] < queue_starts[q + 1]:
                order[count] = q
                behind[count] = (target[q] * total - cum[q]) / target[q]
                count += 1
        if count > candidates:   # the sources most behind: a partial selection by their deficit
            for a in range(candidates):
                best = a
                for b in range(a + 1, count):
                    if behind[b] > behind[best]:
                        best = b
                behind[a], behind[best] = behind[best], behind[a]
                order[a], order[best] = order[best], order[a]
            count = candidates
        chosen, best_score = -1, np.inf
        for c in range(count):
            q = order[c]
            p = items[heads[q]]
            t_p = 0.0
            for k in range(n_src):
                t_p += measures[p, k]
            score = 0.0
            for k in range(n_src):
                d = cum[k] + measures[p, k] - target[k] * (total + t_p)
                score += d * d / target[k]
            if score < best_score or (score == best_score and q < chosen):
                best_score, chosen = score, q
        p = items[heads[chosen]]
        heads[chosen] += 1
        out[pos] = p
        for k in range(n_src):
            cum[k] += measures[p, k]
            total += measures[p, k]


def interleave(measures, target, *, seed: int, epoch: int = 0, candidates: int = CANDIDATES) -> np.ndarray:
    """One epoch of the packs (int64, a permutation) whose every prefix holds close to ``target``
    (module doc).

    Args:
        measures: int or float ``[P, S]``: each pack's measure of each source (>= 0).
        target: ``[S]`` shares (>= 0, summing to about 1; a source at 0 is kept last, as a tie).
        seed, epoch: the queues' random orders (the same numbers, the same order).

    Raises:
        ShardError: measures that are not a 2-D array of finite values >= 0, a target of another
            length or with a negative value.
    """
    m = np.ascontiguousarray(measures, dtype=np.float64)
    t = np.asarray(target, dtype=np.float64)
    if m.ndim != 2 or t.shape != (m.shape[1],) or not np.all(np.isfinite(m)) or (m < 0).any() or (t < 0).any():
        raise ShardError("interleave needs measures [packs, sources] >= 0 and one target share >= 0 per source",
                         field="measures", actual=(m.shape, t.shape))
    packs, sources = m.shape
    if packs == 0:
        return np.empty(0, dtype=np.int64)
    t = np.maximum(t / max(t.sum(), _TINY), _TINY)
    dominant = np.argmax(m / t[None, :], axis=1)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) % (1 << 64), int(epoch), 0x6D6978]))
    perm = rng.permutation(packs)
    items = perm[np.argsort(dominant[perm], kind="stable")].astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(np.bincount(dominant, minlength=sources)))).astype(np.int64)
    out = np.empty(packs, dtype=np.int64)
    _walk(items, starts, m, t, max(1, int(candidates)), out)
    return out
