"""The packing kernels as they were before the memory-lean rewrite (commit 126c196), kept verbatim
as the equality reference for tests/packing/test_packing.py: the lean kernels must place every sequence
in the same bin for every algorithm. Not imported by the library."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=False)
def _tree_size(n):
    size = 1
    while size < n:
        size *= 2
    return size


@numba.njit(cache=False)
def first_fit_kernel(lengths, order, capacity, init_remaining):
    """Place ``lengths[order[k]]`` for k = 0.. into the leftmost bin with room.

    ``init_remaining`` lists the remaining capacity of bins that already exist
    (bins ``0..len-1``); new bins open after them. Every length must be in
    ``[0, capacity]``. Returns ``(bin_of int32[N], n_bins)``.
    """
    n = order.shape[0]
    pre = init_remaining.shape[0]
    leaves = _tree_size(max(n + pre, 1))
    tree = np.full(2 * leaves, capacity, dtype=np.int64)
    for b in range(pre):
        tree[leaves + b] = init_remaining[b]
    for node in range(leaves - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bin_of = np.full(lengths.shape[0], -1, dtype=np.int32)
    n_bins = pre
    for k in range(n):
        item = order[k]
        size = lengths[item]
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
    return bin_of, n_bins


@numba.njit(cache=False)
def best_fit_kernel(lengths, order, capacity):
    """Place each item into the open bin whose remaining capacity is the smallest that fits.

    Ties go to the most recently touched bin with that remaining capacity (a
    stack per value), which is deterministic. Returns ``(bin_of, n_bins)``.
    """
    n = order.shape[0]
    leaves = _tree_size(capacity + 1)
    present = np.zeros(2 * leaves, dtype=np.int8)   # subtree holds a value some bin has
    count = np.zeros(capacity + 1, dtype=np.int64)
    head = np.full(capacity + 1, -1, dtype=np.int64)  # stack of bins per remaining value
    nxt = np.full(max(n, 1), -1, dtype=np.int64)
    prv = np.full(max(n, 1), -1, dtype=np.int64)
    remaining = np.zeros(max(n, 1), dtype=np.int64)
    bin_of = np.full(lengths.shape[0], -1, dtype=np.int32)
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
            remaining[b] = capacity
        bin_of[item] = b
        remaining[b] -= size
        _push(b, remaining[b], head, nxt, prv, count, present, leaves)
    return bin_of, n_bins


@numba.njit(cache=False)
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


@numba.njit(cache=False)
def _set_present(value, flag, present, leaves):
    node = leaves + value
    present[node] = flag
    node //= 2
    while node >= 1:
        present[node] = 1 if (present[2 * node] or present[2 * node + 1]) else 0
        node //= 2


@numba.njit(cache=False)
def _push(b, value, head, nxt, prv, count, present, leaves):
    nxt[b] = head[value]
    prv[b] = -1
    if head[value] >= 0:
        prv[head[value]] = b
    head[value] = b
    count[value] += 1
    if count[value] == 1:
        _set_present(value, 1, present, leaves)


@numba.njit(cache=False)
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


@numba.njit(cache=False)
def _find(parent, i):
    """Union-find 'next free slot' lookup with path halving (``parent[i] == i`` means free)."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


@numba.njit(cache=False)
def _largest_fitting(sizes, parent_next, room):
    """Index of the largest unused item of descending ``sizes`` with size <= room, or -1."""
    n = sizes.shape[0]
    lo, hi = 0, n
    while lo < hi:  # first index with sizes[i] <= room
        mid = (lo + hi) // 2
        if sizes[mid] <= room:
            hi = mid
        else:
            lo = mid + 1
    i = _find(parent_next, lo)
    return i if i < n else -1


@numba.njit(cache=False)
def _take(i, parent_next, parent_prev):
    parent_next[i] = i + 1
    parent_prev[i + 1] = i  # parent_prev is offset by one: slot i+1 stands for item i


@numba.njit(cache=False)
def mffd_phases(sorted_items, lengths, capacity):
    """Johnson & Garey's modified first fit decreasing, phases 1-4.

    ``sorted_items`` are item indices by length descending. Large items
    (> C/2) get a bin each; a forward pass adds to each large bin the largest
    medium item (C/3, C/2] that fits; a backward pass adds to each large bin the
    smallest small item (C/6, C/3] plus the largest small item that still fits,
    when two fit. Returns ``(bin_of with -1 for items not yet placed, remaining
    capacity per large bin)``; the caller first-fits the rest in descending order.
    """
    n = sorted_items.shape[0]
    bin_of = np.full(lengths.shape[0], -1, dtype=np.int32)
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
    med_sizes = np.empty(med.shape[0], dtype=np.int64)
    for i in range(med.shape[0]):
        med_sizes[i] = lengths[med[i]]
    pn = np.arange(med.shape[0] + 1, dtype=np.int64)
    pp = np.arange(med.shape[0] + 1, dtype=np.int64)
    for b in range(n_large):
        i = _largest_fitting(med_sizes, pn, remaining[b])
        if i >= 0:
            bin_of[med[i]] = b
            remaining[b] -= med_sizes[i]
            _take(i, pn, pp)
    # small items, backward pass: the smallest plus the largest that still fits
    small = sorted_items[m_end:s_end]
    sm_sizes = np.empty(small.shape[0], dtype=np.int64)
    for i in range(small.shape[0]):
        sm_sizes[i] = lengths[small[i]]
    pn = np.arange(small.shape[0] + 1, dtype=np.int64)
    pp = np.arange(small.shape[0] + 1, dtype=np.int64)
    for b in range(n_large - 1, -1, -1):
        last = _find(pp, small.shape[0]) - 1  # smallest unused small item
        if last < 0:
            break
        second = _find(pp, last) - 1
        if second < 0 or sm_sizes[last] + sm_sizes[second] > remaining[b]:
            continue
        _take(last, pn, pp)
        bin_of[small[last]] = b
        remaining[b] -= sm_sizes[last]
        i = _largest_fitting(sm_sizes, pn, remaining[b])
        if i >= 0:
            bin_of[small[i]] = b
            remaining[b] -= sm_sizes[i]
            _take(i, pn, pp)
    return bin_of, remaining


@numba.njit(cache=False)
def group_by_bin(bin_of, n_bins):
    """CSR of items per bin, items ascending inside a bin: ``(offsets int64[B+1], items int64[N])``."""
    counts = np.zeros(n_bins + 1, dtype=np.int64)
    for i in range(bin_of.shape[0]):
        counts[bin_of[i] + 1] += 1
    for b in range(n_bins):
        counts[b + 1] += counts[b]
    fill = counts[:-1].copy()
    items = np.empty(bin_of.shape[0], dtype=np.int64)
    for i in range(bin_of.shape[0]):
        b = bin_of[i]
        items[fill[b]] = i
        fill[b] += 1
    return counts, items


@numba.njit(cache=False)
def bin_loads(bin_of, lengths, n_bins):
    loads = np.zeros(n_bins, dtype=np.int64)
    for i in range(bin_of.shape[0]):
        loads[bin_of[i]] += lengths[i]
    return loads


def _descending(lengths):
    return np.argsort(-lengths, kind="stable")


def legacy_pack(lengths, capacity, algorithm, seed=0):
    """(bin_of, offsets, items, loads) exactly as ``pack_lengths`` computed them at 126c196."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    if algorithm == "first_fit":
        bin_of, n_bins = first_fit_kernel(lengths, np.arange(lengths.size), capacity, empty)
    elif algorithm == "first_fit_shuffle":
        order = np.random.default_rng(seed).permutation(lengths.size)
        bin_of, n_bins = first_fit_kernel(lengths, order, capacity, empty)
    elif algorithm == "first_fit_decreasing":
        bin_of, n_bins = first_fit_kernel(lengths, _descending(lengths), capacity, empty)
    elif algorithm == "best_fit_decreasing":
        bin_of, n_bins = best_fit_kernel(lengths, _descending(lengths), capacity)
    else:
        order = _descending(lengths)
        bin_of, remaining = mffd_phases(order, lengths, capacity)
        rest = order[bin_of[order] < 0]
        placed, n_bins = first_fit_kernel(lengths, rest, capacity, remaining)
        bin_of[rest] = placed[rest]
    offsets, items = group_by_bin(bin_of, n_bins)
    return bin_of, offsets, items, bin_loads(bin_of, lengths, n_bins)
