"""numba kernel of label-balanced steps (``cache=True``): after the packs of a group are dealt
into bins by cost (:mod:`._kernels`), swaps between bins that even out their *trained tokens*
while every bin's cost stays inside a band around the mean.

A bin's target is its share of the group's trained tokens (``mean per slot * capacity``); its
deviation is its trained tokens minus the target. Each round takes the bin furthest from its
target and looks, among the other bins (the ones deviating the other way first), for the swap
of one pack each that brings the larger of the two deviations below the first bin's, with both
bins' cost per slot inside the band ``mean * (1 -/+ slack)``; a bin already outside the band
may only move towards it. So ``slack`` bounds what label balancing costs in stragglers: on
bench/corpus.py's mixture (DP 64, 8 packs per rank) the overhead goes from 0.03 % (costs alone)
to 0.2 % at ``slack = 0.002`` (the shuffle's: 2.2 %). Counts per bin never change. Ties are
broken by index: the result is a function of the inputs only.
"""

from __future__ import annotations

import numpy as np

from .._numba import numba


@numba.njit(cache=True, inline="always")
def _inside(old, new, cap, lo, hi):
    """A bin's new cost per slot stays in the band ``[lo, hi]``, or no further out than it was."""
    d_new, d_old = new / cap, old / cap
    return min(lo, d_old) <= d_new <= max(hi, d_old)


@numba.njit(cache=True)
def _members(bin_of, caps):
    """Each bin's items (``members[b, :caps[b]]``) and each item's slot there."""
    nb, k = caps.shape[0], bin_of.shape[0]
    width = 0
    for b in range(nb):
        width = max(width, caps[b])
    members = np.full((nb, width), -1, dtype=np.int64)
    slot_of = np.empty(k, dtype=np.int64)
    fill = np.zeros(nb, dtype=np.int64)
    for i in range(k):
        b = bin_of[i]
        members[b, fill[b]] = i
        slot_of[i] = fill[b]
        fill[b] += 1
    return members, slot_of, fill


@numba.njit(cache=True)
def _best_swap(w, p, members, fill, costs, labels, cost_loads, caps, dev, lo, hi):
    """The swap of an item of bin ``w`` with one of bin ``p`` that brings the larger of their two
    deviations lowest, below ``|dev[w]|``, with both costs in the band: ``(a, b)`` or ``(-1, -1)``."""
    best_a, best_b, best = -1, -1, abs(dev[w]) - 1e-9
    for x in range(fill[w]):
        a = members[w, x]
        for y in range(fill[p]):
            b = members[p, y]
            d = labels[a] - labels[b]
            score = max(abs(dev[w] - d), abs(dev[p] + d))
            if score >= best:
                continue
            if not (_inside(cost_loads[w], cost_loads[w] - costs[a] + costs[b], caps[w], lo, hi)
                    and _inside(cost_loads[p], cost_loads[p] - costs[b] + costs[a], caps[p], lo, hi)):
                continue
            best_a, best_b, best = a, b, score
    return best_a, best_b


@numba.njit(cache=True)
def refine_labels(costs, labels, caps, bin_of, cost_loads, slack, max_rounds):
    """Swap items between bins to even the bins' ``labels`` sums (module doc); updates ``bin_of``
    and ``cost_loads`` in place. Returns the number of swaps made."""
    nb = caps.shape[0]
    k = costs.shape[0]
    if nb < 2 or k == 0:
        return 0
    label_loads = np.zeros(nb, dtype=np.float64)
    for i in range(k):
        label_loads[bin_of[i]] += labels[i]
    slots = 0.0
    for b in range(nb):
        slots += caps[b]
    cost_mean = cost_loads.sum() / slots
    lo, hi = cost_mean * (1.0 - slack), cost_mean * (1.0 + slack)
    dev = label_loads - (label_loads.sum() / slots) * caps   # each bin's trained tokens minus its share
    members, slot_of, fill = _members(bin_of, caps)
    swaps = 0
    for _ in range(max_rounds):
        w = 0
        for b in range(1, nb):
            if abs(dev[b]) > abs(dev[w]):
                w = b
        if abs(dev[w]) < 0.5:   # integer counts: nothing left to gain
            break
        partners = np.argsort(dev if dev[w] > 0 else -dev, kind="mergesort")   # the other way first
        a = b = p = -1
        for t in range(nb):
            p = partners[t]
            if p != w:
                a, b = _best_swap(w, p, members, fill, costs, labels, cost_loads, caps, dev, lo, hi)
                if a >= 0:
                    break
        if a < 0:
            break
        bin_of[a], bin_of[b] = p, w
        sa, sb = slot_of[a], slot_of[b]
        members[w, sa], members[p, sb] = b, a
        slot_of[a], slot_of[b] = sb, sa
        dev[w] -= labels[a] - labels[b]
        dev[p] += labels[a] - labels[b]
        cost_loads[w] -= costs[a] - costs[b]
        cost_loads[p] += costs[a] - costs[b]
        swaps += 1
    return swaps
