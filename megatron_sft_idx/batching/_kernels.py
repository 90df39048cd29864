"""numba kernels of the batch planners (``cache=True``): pack costs, per-step balance, step costs,
and NeMo-RL's dynamic micro-batches. Every loop over packs or sequences is here.

The balance kernels work on one *group* of consecutive positions at a time (a step, or a window
of steps with exchange on): the packs at those positions are re-dealt among the positions so
that the *bins* (a rank in a step) have equal cost, then, inside a bin, so that its micro-batches
have equal cost. Positions never leave their group, so group membership is unchanged.
Ties are broken by index everywhere (stable sorts, lowest bin first): the result is a function of
the inputs only.
"""

from __future__ import annotations

import numpy as np

from .._numba import numba
from ._label_kernels import refine_labels  # (balance_epoch's numba cache misses its edits: clear __pycache__)

_NO_PAD = -1


# ------------------------------------------------------------------ costs


@numba.njit(cache=True, inline="always")
def _seq_cost(length, linear, attention, mult, off):
    k = length - off
    if k < 0:
        k = 0
    if mult > 1:
        k = -(-k // mult) * mult
    kf = float(k)
    return linear * kf + attention * kf * kf, k


@numba.njit(cache=True)
def pack_costs(lengths, offsets, linear, attention, mult, off, pad_to):
    """Cost of each pack from its sequences' lengths (CSR); ``pad_to >= 0`` adds linear padding."""
    n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.float64)
    for p in range(n):
        total = 0.0
        tokens = 0
        for i in range(offsets[p], offsets[p + 1]):
            c, k = _seq_cost(lengths[i], linear, attention, mult, off)
            total += c
            tokens += k
        if pad_to >= 0 and pad_to > tokens:
            total += linear * float(pad_to - tokens)
        out[p] = total
    return out


@numba.njit(cache=True)
def pack_costs_from_starts(starts, offsets, packed_lens, linear, attention, mult, off, pad_to):
    """As :func:`pack_costs`, from a shard's sequence starts: sequence k of pack p ends where the
    next starts, the last at the pack's length."""
    n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.float64)
    for p in range(n):
        total = 0.0
        tokens = 0
        lo, hi = offsets[p], offsets[p + 1]
        for i in range(lo, hi):
            end = starts[i + 1] if i + 1 < hi else packed_lens[p]
            c, k = _seq_cost(end - starts[i], linear, attention, mult, off)
            total += c
            tokens += k
        if pad_to >= 0 and pad_to > tokens:
            total += linear * float(pad_to - tokens)
        out[p] = total
    return out


# ------------------------------------------------------------------ partition with capacities


@numba.njit(cache=True)
def _lpt(costs, caps, bin_of, loads):
    """Longest processing time first: each item, costliest first, to the least-loaded bin with room."""
    nb = caps.shape[0]
    fill = np.zeros(nb, dtype=np.int64)
    loads[:] = 0.0
    order = np.argsort(-costs, kind="mergesort")
    for t in range(order.shape[0]):
        i = order[t]
        best = -1
        for b in range(nb):
            if fill[b] < caps[b] and (best < 0 or loads[b] < loads[best]):
                best = b
        bin_of[i] = best
        fill[best] += 1
        loads[best] += costs[i]


@numba.njit(cache=True)
def _state_before(a, b, spread, top):
    """Heap order of Karmarkar-Karp states: larger spread first, then larger top set, then lower id."""
    if spread[a] != spread[b]:
        return spread[a] > spread[b]
    if top[a] != top[b]:
        return top[a] > top[b]
    return a < b


@numba.njit(cache=True)
def _sift_down(heap, size, pos, spread, top):
    while True:
        c = 2 * pos + 1
        if c >= size:
            return
        if c + 1 < size and _state_before(heap[c + 1], heap[c], spread, top):
            c += 1
        if _state_before(heap[c], heap[pos], spread, top):
            heap[c], heap[pos] = heap[pos], heap[c]
            pos = c
        else:
            return


@numba.njit(cache=True)
def _kk_equal(costs, nb, bin_of, loads):
    """Karmarkar-Karp's largest differencing method, equal-size variant (as verl's): items sorted
    ascending, each run of ``nb`` consecutive items a state of ``nb`` one-item sets; the two states
    of largest spread merge, the largest set of one with the smallest of the other. Needs
    ``len(costs) % nb == 0``; every bin gets ``len(costs) / nb`` items."""
    k = costs.shape[0]
    ns = k // nb
    order = np.argsort(costs, kind="mergesort")
    sums = np.zeros((ns, nb), dtype=np.float64)    # per state, its sets by sum descending
    head = np.full((ns, nb), -1, dtype=np.int64)
    tail = np.full((ns, nb), -1, dtype=np.int64)
    nxt = np.full(k, -1, dtype=np.int64)
    spread = np.zeros(ns, dtype=np.float64)
    top = np.zeros(ns, dtype=np.float64)
    for s in range(ns):
        for j in range(nb):  # ascending run: the largest item is set 0
            item = order[s * nb + nb - 1 - j]
            sums[s, j] = costs[item]
            head[s, j] = item
            tail[s, j] = item
        spread[s] = sums[s, 0] - sums[s, nb - 1]
        top[s] = sums[s, 0]
    heap = np.arange(ns)
    for pos in range(ns // 2 - 1, -1, -1):
        _sift_down(heap, ns, pos, spread, top)
    size = ns
    new_sums = np.empty(nb, dtype=np.float64)
    new_head = np.empty(nb, dtype=np.int64)
    new_tail = np.empty(nb, dtype=np.int64)
    while size > 1:
        a = heap[0]
        heap[0] = heap[size - 1]
        size -= 1
        _sift_down(heap, size, 0, spread, top)
        b = heap[0]
        for j in range(nb):  # a's set j (j-th largest) takes b's (nb-1-j)-th largest
            bj = nb - 1 - j
            new_sums[j] = sums[a, j] + sums[b, bj]
            if head[a, j] < 0:
                new_head[j], new_tail[j] = head[b, bj], tail[b, bj]
            elif head[b, bj] < 0:
                new_head[j], new_tail[j] = head[a, j], tail[a, j]
            else:
                nxt[tail[a, j]] = head[b, bj]
                new_head[j], new_tail[j] = head[a, j], tail[b, bj]
        rank = np.argsort(-new_sums, kind="mergesort")
        for j in range(nb):
            sums[b, j] = new_sums[rank[j]]
            head[b, j] = new_head[rank[j]]
            tail[b, j] = new_tail[rank[j]]
        spread[b] = sums[b, 0] - sums[b, nb - 1]
        top[b] = sums[b, 0]
        _sift_down(heap, size, 0, spread, top)
    final = heap[0]
    loads[:] = 0.0
    for j in range(nb):
        item = head[final, j]
        while item >= 0:
            bin_of[item] = j
            loads[j] += costs[item]
            item = nxt[item]


@numba.njit(cache=True)
def _refine(costs, bin_of, loads, max_rounds):
    """Pairwise swaps that lower the costliest bin: swap one of its items with a cheaper item of
    another bin (the pair whose difference is nearest half the gap), lightest bin first, until no
    swap lowers it. Counts per bin are unchanged. Returns the number of swaps made."""
    nb = loads.shape[0]
    k = costs.shape[0]
    swaps = 0
    a_items = np.empty(k, dtype=np.int64)
    b_items = np.empty(k, dtype=np.int64)
    for _ in range(max_rounds):
        top = 0
        for b in range(1, nb):
            if loads[b] > loads[top]:
                top = b
        na = 0
        for i in range(k):
            if bin_of[i] == top:
                a_items[na] = i
                na += 1
        bins_by_load = np.argsort(loads, kind="mergesort")
        done = False
        for t in range(nb):
            other = bins_by_load[t]
            if other == top:
                continue
            gap = loads[top] - loads[other]
            if gap <= 0.0:
                break
            nbb = 0
            for i in range(k):
                if bin_of[i] == other:
                    b_items[nbb] = i
                    nbb += 1
            best_a, best_b, best_max = -1, -1, loads[top]
            for x in range(na):
                ia = a_items[x]
                for y in range(nbb):
                    ib = b_items[y]
                    d = costs[ia] - costs[ib]
                    if d <= 0.0 or d >= gap:
                        continue
                    new_max = max(loads[top] - d, loads[other] + d)
                    if new_max < best_max:
                        best_a, best_b, best_max = ia, ib, new_max
            if best_a >= 0:
                d = costs[best_a] - costs[best_b]
                bin_of[best_a], bin_of[best_b] = other, top
                loads[top] -= d
                loads[other] += d
                swaps += 1
                done = True
                break
        if not done:
            break
    return swaps


@numba.njit(cache=True)
def partition(costs, caps, algorithm, refine_rounds, bin_of, loads):
    """Deal items into bins of the given capacities (``sum(caps) == len(costs)``) minimising the
    costliest bin: 0 = LPT, 1 = Karmarkar-Karp (equal capacities only; LPT otherwise), then
    :func:`_refine`. Returns the number of refining swaps."""
    nb = caps.shape[0]
    equal = True
    for b in range(1, nb):
        if caps[b] != caps[0]:
            equal = False
    if algorithm == 1 and equal and nb > 1:
        _kk_equal(costs, nb, bin_of, loads)
    else:
        _lpt(costs, caps, bin_of, loads)
    if refine_rounds > 0 and nb > 1:
        return _refine(costs, bin_of, loads, refine_rounds)
    return 0


# ------------------------------------------------------------------ Megatron's sampler layout


@numba.njit(cache=True, inline="always")
def _where(g, dp, mbs, gbs):
    """Global position -> (step, micro-batch, rank, slot) under Megatron's pretraining sampler."""
    step = g // gbs
    q = g - step * gbs
    group = mbs * dp
    m = q // group
    w = q - m * group
    return step, m, w // mbs, w - (w // mbs) * mbs


@numba.njit(cache=True)
def balance_epoch(base, costs, labels, slack, g0, dp, mbs, gbs, window, algorithm, refine_rounds, out):
    """Re-deal the packs of ``base`` (pack ids at epoch positions; epoch position i is global
    position ``g0 + i``) inside each group of ``window`` steps, writing ``out``.

    A group's bins are (step in the group, rank); a bin's capacity is the number of its
    positions in the group (fewer at the epoch's edges). Inside a bin, the packs go to its
    micro-batches by LPT (equal cost), the costliest micro-batch to the earliest position, and
    inside a micro-batch the costliest pack first. With ``labels`` (per pack; empty: off), the
    bins, then each bin's micro-batches, are evened in labels within a cost band of ``slack``
    (:func:`._label_kernels.refine_labels`). Returns (groups, refining swaps).
    """
    n = base.shape[0]
    span = window * gbs
    nb_max = window * dp
    num_micro = gbs // (mbs * dp)
    caps = np.zeros(nb_max, dtype=np.int64)
    bin_of = np.empty(span, dtype=np.int64)
    loads = np.zeros(nb_max, dtype=np.float64)
    local_costs = np.empty(span, dtype=np.float64)
    local_labels = np.zeros(span, dtype=np.float64)
    with_labels = labels.shape[0] > 0
    pos_bin = np.empty(span, dtype=np.int64)
    pos_m = np.empty(span, dtype=np.int64)
    groups, swaps = 0, 0
    lo = 0
    while lo < n:
        g = g0 + lo
        hi = min(n, lo + span - (g % span))
        k = hi - lo
        first_step = (g0 + lo) // gbs
        caps[:] = 0
        for t in range(k):
            step, m, r, _ = _where(g0 + lo + t, dp, mbs, gbs)
            b = (step - first_step) * dp + r
            pos_bin[t] = b
            pos_m[t] = m
            caps[b] += 1
            local_costs[t] = costs[base[lo + t]]
            if with_labels:
                local_labels[t] = labels[base[lo + t]]
        nb = (((g0 + hi - 1) // gbs) - first_step + 1) * dp
        swaps += partition(local_costs[:k], caps[:nb], algorithm, refine_rounds, bin_of[:k], loads[:nb])
        if with_labels:
            swaps += refine_labels(local_costs[:k], local_labels[:k], caps[:nb], bin_of[:k], loads[:nb], slack,
                                   8 * nb)
        _place_bins(base, lo, k, local_costs, local_labels, with_labels, slack, bin_of, pos_bin, pos_m, nb,
                    num_micro, mbs, out)
        groups += 1
        lo = hi
    return groups, swaps


@numba.njit(cache=True)
def _place_bins(base, lo, k, costs, labels, with_labels, slack, bin_of, pos_bin, pos_m, nb, num_micro, mbs, out):
    """Inside each bin: LPT of its packs over its micro-batches (then evened in labels, with
    ``with_labels``), then write them to its positions."""
    items = np.empty(k, dtype=np.int64)
    slots = np.empty(k, dtype=np.int64)
    mcaps = np.zeros(num_micro, dtype=np.int64)
    mloads = np.zeros(num_micro, dtype=np.float64)
    mb_of = np.empty(k, dtype=np.int64)
    for b in range(nb):
        ni, ns = 0, 0
        for t in range(k):
            if bin_of[t] == b:
                items[ni] = t
                ni += 1
            if pos_bin[t] == b:
                slots[ns] = t
                ns += 1
        if ni == 0:
            continue
        # the bin's micro-batches present in this group, in position order
        mcaps[:] = 0
        first_m = pos_m[slots[0]]
        for s in range(ns):
            mcaps[pos_m[slots[s]] - first_m] += 1
        nm = pos_m[slots[ns - 1]] - first_m + 1
        sub = costs[items[:ni]].copy()
        partition(sub, mcaps[:nm], 0, 0, mb_of[:ni], mloads[:nm])
        if with_labels and mbs > 1:
            refine_labels(sub, labels[items[:ni]].copy(), mcaps[:nm], mb_of[:ni], mloads[:nm], slack, 8 * nm)
        # micro-batches of equal capacity take positions costliest first; unequal ones keep theirs
        target = np.arange(nm)
        _costliest_first(mcaps[:nm], mloads[:nm], target)
        by_cost = np.argsort(-sub, kind="mergesort")
        fill = np.zeros(nm, dtype=np.int64)
        start = np.zeros(nm + 1, dtype=np.int64)
        for j in range(nm):
            start[j + 1] = start[j] + mcaps[j]
        for x in range(ni):
            i = by_cost[x]
            j = target[mb_of[i]]
            out[lo + slots[start[j] + fill[j]]] = base[lo + items[i]]
            fill[j] += 1


@numba.njit(cache=True)
def _costliest_first(mcaps, mloads, target):
    """Map each LPT micro-batch to a position micro-batch: among micro-batches of the same
    capacity, the costliest to the earliest. ``target[lpt_index] = position_index``."""
    nm = mcaps.shape[0]
    used = np.zeros(nm, dtype=np.bool_)
    for j in range(nm):  # position micro-batches in order
        best = -1
        for c in range(nm):
            if used[c] or mcaps[c] != mcaps[j]:
                continue
            if best < 0 or mloads[c] > mloads[best]:
                best = c
        used[best] = True
        target[best] = j


@numba.njit(cache=True)
def step_rank_costs(stream, costs, g0, dp, mbs, gbs, out):
    """Per complete step and rank, the summed cost of its packs (``out[step, rank]``); the stream
    starts at global position ``g0``; steps not wholly inside it are left out. Returns the
    first step written."""
    first = -(-g0 // gbs)
    n_steps = out.shape[0]
    out[:, :] = 0.0
    for t in range(stream.shape[0]):
        step, _, r, _ = _where(g0 + t, dp, mbs, gbs)
        s = step - first
        if 0 <= s < n_steps:
            out[s, r] += costs[stream[t]]
    return first


@numba.njit(cache=True)
def is_permutation(perm):
    """True when ``perm`` holds each of ``0..len-1`` exactly once."""
    n = perm.shape[0]
    seen = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        v = perm[i]
        if v < 0 or v >= n or seen[v]:
            return False
        seen[v] = True
    return True


# ------------------------------------------------------------------ dynamic batching (NeMo-RL)


@numba.njit(cache=True)
def dynamic_microbatches(order, lengths, gbs, dp, budget, rnd, width_mult, served, mb_offsets, mb_bounds,
                         mb_widths):
    """NeMo-RL's dynamic batching of each step (``gbs`` consecutive sequences of ``order``).

    Per step: sequences sorted by length (stable), dealt to ranks by stride (rank r takes
    sorted positions r, r+dp, ...; ``served`` holds them rank-major); then one walk over the
    shard index k, whose length is the longest of the ranks' k-th sequences rounded up to
    ``rnd`` (capped at the step's width, its longest sequence rounded up to ``width_mult``),
    opens a new micro-batch when ``rows * width`` would pass ``budget``. Boundaries are shared by
    every rank. Returns -1, or the first sequence (position in ``order``) whose rounded length
    exceeds the budget.
    """
    shard = gbs // dp
    n_steps = order.shape[0] // gbs
    count = 0
    mb_offsets[0] = 0
    lens = np.empty(gbs, dtype=np.int64)
    for s in range(n_steps):
        base = s * gbs
        widest = 0
        for t in range(gbs):
            lens[t] = lengths[order[base + t]]
            if lens[t] > widest:
                widest = lens[t]
        width = -(-widest // width_mult) * width_mult
        srt = np.argsort(lens, kind="mergesort")
        for r in range(dp):
            for k in range(shard):
                served[base + r * shard + k] = order[base + srt[k * dp + r]]
        mb_max = 0
        start = 0
        for k in range(shard):
            longest = lens[srt[k * dp + dp - 1]]  # ascending: the last of the k-th stride block
            w = min(-(-longest // rnd) * rnd, width)
            if w > budget:
                return base + srt[k * dp + dp - 1]
            wider = max(mb_max, w)
            if k > start and (k - start + 1) * wider > budget:
                mb_bounds[count, 0] = start
                mb_bounds[count, 1] = k
                mb_widths[count] = mb_max
                count += 1
                start = k
                mb_max = w
            else:
                mb_max = wider
        mb_bounds[count, 0] = start
        mb_bounds[count, 1] = shard
        mb_widths[count] = mb_max
        count += 1
        mb_offsets[s + 1] = count
    return -1
