"""numba kernels of the bin-packing algorithms (all O(N log N), ``cache=True``), memory-lean.

Bins are numbered in the order they are opened. First fit keeps a segment tree
over bins holding each bin's remaining capacity (a bin never opened has the
full capacity), so "the leftmost bin with room" is one root-to-leaf walk. Best
fit keeps a segment tree over remaining-capacity *values* ``0..C`` marking the
values some open bin has, with a stack of bins per value.

Memory: the per-sequence arrays are the caller's lengths, one int32 order and
one int32 bin id (index arrays are int64 only past 2**31 sequences); everything
else is per *bin* and grows by doubling as bins open, so a packing of N
sequences into B bins needs ~8 N + ~16 B bytes beyond its input. Every kernel releases the GIL
(``nogil``): a planner may pack several sets at once in threads (a mixture packs each source
alone, for its report, beside the global packing). The caller
allocates every per-sequence output with the index dtype it wants.
"""

from __future__ import annotations

import numpy as np

from .._numba import numba


@numba.njit(cache=True, nogil=True)
def _tree_size(n):
    size = 1
    while size < n:
        size *= 2
    return size


@numba.njit(cache=True, nogil=True)
def descending_order(lengths, capacity, order):
    """Fill ``order`` with indices by length descending, ties by index ascending.

    A counting sort over ``[1, capacity]`` (lengths are bounded by the pack size), the
    same order as ``np.argsort(-lengths, kind="stable")`` without its int64 copies.
    """
    start = np.zeros(capacity + 2, dtype=np.int64)
    for i in range(lengths.shape[0]):
        start[capacity - lengths[i] + 1] += 1
    for k in range(1, capacity + 2):
        start[k] += start[k - 1]
    for i in range(lengths.shape[0]):
        key = capacity - lengths[i]
        order[start[key]] = i
        start[key] += 1


@numba.njit(cache=True, nogil=True)
def _grow_tree(tree, leaves, capacity):
    """Double the number of leaves: new bins (never opened) hold the full capacity."""
    new_leaves = 2 * leaves
    grown = np.full(2 * new_leaves, capacity, dtype=tree.dtype)
    grown[new_leaves:new_leaves + leaves] = tree[leaves:2 * leaves]
    for node in range(new_leaves - 1, 0, -1):
        grown[node] = max(grown[2 * node], grown[2 * node + 1])
    return grown, new_leaves


@numba.njit(cache=True, nogil=True)
def first_fit_into(lengths, order, use_order, capacity, init_remaining, bin_of):
    """Place ``lengths[order[k]]`` (or ``lengths[k]`` without ``use_order``) into the leftmost
    bin with room, writing ``bin_of``; returns the number of bins.

    ``init_remaining`` lists the remaining capacity of bins that already exist
    (bins ``0..len-1``); new bins open after them. Every length must be in
    ``[0, capacity]``. The tree always keeps one never-opened leaf, so the walk
    finds a bin for any length.
    """
    n = order.shape[0] if use_order else lengths.shape[0]
    pre = init_remaining.shape[0]
    leaves = _tree_size(max(pre + 1, 1024))
    tree = np.full(2 * leaves, capacity, dtype=np.int32)
    for b in range(pre):
        tree[leaves + b] = init_remaining[b]
    for node in range(leaves - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    n_bins = pre
    for k in range(n):
        item = order[k] if use_order else k
        size = lengths[item]
        if n_bins >= leaves:
            tree, leaves = _grow_tree(tree, leaves, capacity)
        node = 1
        while node < leaves:  # descend to the leftmost leaf with room
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        b = node - leaves
        bin_of[item] = b
        if b + 1 > n_bins:
            n_bins = b + 1
        tree[node] -= size
        node //= 2
        while node >= 1:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return n_bins


@numba.njit(cache=True, nogil=True)
def _grown(arr, fill):
    out = np.full(2 * arr.shape[0], fill, dtype=arr.dtype)
    out[:arr.shape[0]] = arr
    return out


@numba.njit(cache=True, nogil=True)
def best_fit_into(lengths, order, capacity, bin_of):
    """Place each item into the open bin whose remaining capacity is the smallest that fits.

    Ties go to the most recently touched bin with that remaining capacity (a
    stack per value), which is deterministic. Writes ``bin_of``; returns the bin count.
    """
    n = order.shape[0]
    leaves = _tree_size(capacity + 1)
    present = np.zeros(2 * leaves, dtype=np.int8)   # subtree holds a value some bin has
    count = np.zeros(capacity + 1, dtype=np.int64)
    head = np.full(capacity + 1, -1, dtype=np.int64)  # stack of bins per remaining value
    nxt = np.full(1024, -1, dtype=np.int32)            # per bin, grown as bins open
    prv = np.full(1024, -1, dtype=np.int32)
    remaining = np.zeros(1024, dtype=np.int32)
    n_bins = 0
    for k in range(n):
        item = order[k]
        size = lengths[item]
        b = -1
        if present[1] and size <= capacity:
            found = _leftmost_present_at_least(present, leaves, size)
            if found >= 0:
                b = head[found]
                _unlink(b, found, head, nxt, prv, count, present, leaves)
        if b < 0:
            b = n_bins
            n_bins += 1
            if b >= remaining.shape[0]:
                nxt, prv, remaining = _grown(nxt, -1), _grown(prv, -1), _grown(remaining, 0)
            remaining[b] = capacity
        bin_of[item] = b
        remaining[b] -= size
        _push(b, remaining[b], head, nxt, prv, count, present, leaves)
    return n_bins


@numba.njit(cache=True, nogil=True)
def _leftmost_present_at_least(present, leaves, value):
    """Smallest leaf index >= value whose flag is set, or -1 (O(log C))."""
    node = leaves + value
    if present[node]:
        return value
    found = False
    while node > 1:
        if node % 2 == 0 and present[node + 1]:
            node += 1
            found = True
            break
        node //= 2
    if not found:
        return -1
    while node < leaves:
        node = 2 * node if present[2 * node] else 2 * node + 1
    return node - leaves


@numba.njit(cache=True, nogil=True)
def _set_present(value, flag, present, leaves):
    node = leaves + value
    present[node] = flag
    node //= 2
    while node >= 1:
        present[node] = 1 if (present[2 * node] or present[2 * node + 1]) else 0
        node //= 2


@numba.njit(cache=True, nogil=True)
def _push(b, value, head, nxt, prv, count, present, leaves):
    nxt[b] = head[value]
    prv[b] = -1
    if head[value] >= 0:
        prv[head[value]] = b
    head[value] = b
    count[value] += 1
    if count[value] == 1:
        _set_present(value, 1, present, leaves)


@numba.njit(cache=True, nogil=True)
def _unlink(b, value, head, nxt, prv, count, present, leaves):
    if prv[b] >= 0:
        nxt[prv[b]] = nxt[b]
    else:
        head[value] = nxt[b]
    if nxt[b] >= 0:
        prv[nxt[b]] = prv[b]
    count[value] -= 1
    if count[value] == 0:
        _set_present(value, 0, present, leaves)


@numba.njit(cache=True, nogil=True)
def _find(parent, i):
    """Union-find 'next free slot' lookup with path halving (``parent[i] == i`` means free)."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


@numba.njit(cache=True, nogil=True)
def _largest_fitting(items, lengths, parent_next, room):
    """Index into ``items`` (lengths descending) of the largest unused one with length <= room, or -1."""
    n = items.shape[0]
    lo, hi = 0, n
    while lo < hi:  # first index with length <= room
        mid = (lo + hi) // 2
        if lengths[items[mid]] <= room:
            hi = mid
        else:
            lo = mid + 1
    i = _find(parent_next, lo)
    return i if i < n else -1


@numba.njit(cache=True, nogil=True)
def _take(i, parent_next, parent_prev):
    parent_next[i] = i + 1
    parent_prev[i + 1] = i  # parent_prev is offset by one: slot i+1 stands for item i


@numba.njit(cache=True, nogil=True)
def _free_slots(n, like):
    """Union-find parents ``0..n`` (all free), in the index dtype of ``like``."""
    out = np.empty(n + 1, dtype=like.dtype)
    for i in range(n + 1):
        out[i] = i
    return out


@numba.njit(cache=True, nogil=True)
def mffd_phases(sorted_items, lengths, capacity, bin_of):
    """Johnson & Garey's modified first fit decreasing, phases 1-4.

    ``sorted_items`` are item indices by length descending; ``bin_of`` must be all -1.
    Large items (> C/2) get a bin each; a forward pass adds to each large bin the
    largest medium item (C/3, C/2] that fits; a backward pass adds to each large bin
    the smallest small item (C/6, C/3] plus the largest small item that still fits,
    when two fit. Returns the remaining capacity per large bin (items not placed
    keep -1); the caller first-fits the rest in descending order.
    """
    n = sorted_items.shape[0]
    n_large = 0
    while n_large < n and 2 * lengths[sorted_items[n_large]] > capacity:
        n_large += 1
    remaining = np.empty(n_large, dtype=np.int64)
    for b in range(n_large):
        bin_of[sorted_items[b]] = b
        remaining[b] = capacity - lengths[sorted_items[b]]
    m_end = n_large
    while m_end < n and 3 * lengths[sorted_items[m_end]] > capacity:
        m_end += 1
    s_end = m_end
    while s_end < n and 6 * lengths[sorted_items[s_end]] > capacity:
        s_end += 1
    # medium items, forward pass over the large bins
    med = sorted_items[n_large:m_end]
    pn = _free_slots(med.shape[0], sorted_items)
    pp = _free_slots(med.shape[0], sorted_items)
    for b in range(n_large):
        i = _largest_fitting(med, lengths, pn, remaining[b])
        if i >= 0:
            bin_of[med[i]] = b
            remaining[b] -= lengths[med[i]]
            _take(i, pn, pp)
    # small items, backward pass: the smallest plus the largest that still fits
    small = sorted_items[m_end:s_end]
    pn = _free_slots(small.shape[0], sorted_items)
    pp = _free_slots(small.shape[0], sorted_items)
    for b in range(n_large - 1, -1, -1):
        last = _find(pp, small.shape[0]) - 1  # smallest unused small item
        if last < 0:
            break
        second = _find(pp, last) - 1
        if second < 0 or lengths[small[last]] + lengths[small[second]] > remaining[b]:
            continue
        _take(last, pn, pp)
        bin_of[small[last]] = b
        remaining[b] -= lengths[small[last]]
        i = _largest_fitting(small, lengths, pn, remaining[b])
        if i >= 0:
            bin_of[small[i]] = b
            remaining[b] -= lengths[small[i]]
            _take(i, pn, pp)
    return remaining


@numba.njit(cache=True, nogil=True)
def unplaced_in_order(order, bin_of, out):
    """Copy the items of ``order`` whose bin is still -1 into ``out``; returns how many."""
    k = 0
    for i in range(order.shape[0]):
        if bin_of[order[i]] < 0:
            out[k] = order[i]
            k += 1
    return k


@numba.njit(cache=True, nogil=True)
def group_by_bin(bin_of, n_bins, items):
    """CSR of items per bin, items ascending inside a bin: fills ``items``, returns ``offsets int64[B+1]``."""
    counts = np.zeros(n_bins + 1, dtype=np.int64)
    for i in range(bin_of.shape[0]):
        counts[bin_of[i] + 1] += 1
    for b in range(n_bins):
        counts[b + 1] += counts[b]
    fill = counts[:-1].copy()
    for i in range(bin_of.shape[0]):
        b = bin_of[i]
        items[fill[b]] = i
        fill[b] += 1
    return counts


@numba.njit(cache=True, nogil=True)
def bin_loads(bin_of, lengths, n_bins):
    loads = np.zeros(n_bins, dtype=np.int64)
    for i in range(bin_of.shape[0]):
        loads[bin_of[i]] += lengths[i]
    return loads
