"""The packs Megatron-LM's ``SFTDataset`` (PR #5017, ``pack_samples``) forms at run time, reproduced.

That dataset packs one-sequence-per-conversation data when it starts, by a variant of
Johnson & Garey's modified first fit decreasing. What it *does* (read from its code at
``97b2c55e``, and checked element by element against it by tests/compat/test_megatron_lm_5017.py)
differs from our ``modified_first_fit_decreasing`` in its last phase and in its orders:

* classes by size ``s`` against the capacity ``C``: large ``s > C/2``, medium ``s > C/3``,
  small ``s > C/6``, tiny the rest (true division);
* one bin per large item, larges by size descending;
* each bin in that order takes the largest medium that fits (a forward pass);
* backwards over the bins, a bin holding no medium takes the two smallest smalls when they fit:
  the smallest, then the largest other small that fits beside it;
* the remaining mediums, smalls and tinies, by size descending, then fill each large bin in
  turn: the largest item that fits, until none fits;
* what is left, by size descending, goes each into the **least-full** bin opened in this
  phase if it fits there (only that one is tried), else into a new bin;
* the result lists the large bins in their order, then this phase's bins by load ascending
  (ties: the one loaded earlier first); documents inside a bin in the order they were added.

Equal sizes keep index order throughout (every sort is stable and classes are formed in index
order). Overlong items are not this module's: like every algorithm here it takes lengths
in ``[1, capacity]`` (``--overlong drop`` removes them first, as #5017 does).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from typing import List

import numpy as np


def megatron_lm_bins(lengths: np.ndarray, capacity: int) -> List[List[int]]:
    """#5017's bins for ``lengths`` (each in ``[1, capacity]``): item indices, in its orders.

    Cost: O(n log n) except removals from the sorted remainder (list deletions, O(n) each in
    the worst case); meant for reproducing #5017's packs, not as a fast default.
    """
    sizes = [int(x) for x in lengths]
    large, medium, small, tiny = [], [], [], []
    for i, s in enumerate(sizes):
        (large if s > capacity / 2 else medium if s > capacity / 3 else small if s > capacity / 6 else tiny).append(i)

    def by_size_descending(items):
        return sorted(items, key=lambda i: -sizes[i])   # stable: equal sizes keep index order

    large, medium = by_size_descending(large), by_size_descending(medium)
    small = sorted(small, key=lambda i: sizes[i])
    bins = [[i] for i in large]
    loads = [sizes[i] for i in large]
    _one_medium_each(bins, loads, medium, sizes, capacity)
    _two_smalls(bins, loads, small, sizes, capacity)
    rest = by_size_descending(medium + small + tiny)
    _fill_large_bins(bins, loads, rest, sizes, capacity)
    return bins + _least_full_bins(rest, sizes, capacity)


def _take_largest_fitting(items: List[int], keys: List[int], room: int):
    """Remove and return the first item of ``items`` (sizes descending; ``keys`` their negated
    sizes) whose size is at most ``room``, or None."""
    j = bisect_left(keys, -room)
    if j == len(items):
        return None
    del keys[j]
    return items.pop(j)


def _one_medium_each(bins, loads, medium, sizes, capacity) -> None:
    keys = [-sizes[i] for i in medium]
    for b in range(len(bins)):
        item = _take_largest_fitting(medium, keys, capacity - loads[b])
        if item is not None:
            bins[b].append(item)
            loads[b] += sizes[item]


def _two_smalls(bins, loads, small, sizes, capacity) -> None:
    for b in reversed(range(len(bins))):
        if len(small) < 2 or any(capacity / 3 < sizes[i] <= capacity / 2 for i in bins[b]):
            continue
        room = capacity - loads[b]
        if sizes[small[0]] + sizes[small[1]] > room:
            continue
        first = small.pop(0)
        # the largest small beside it that fits: found, since the next smallest fits
        j = max(k for k in range(len(small)) if sizes[small[k]] <= room - sizes[first])
        second = small.pop(j)
        bins[b] += [first, second]
        loads[b] += sizes[first] + sizes[second]


def _fill_large_bins(bins, loads, rest, sizes, capacity) -> None:
    keys = [-sizes[i] for i in rest]
    for b in range(len(bins)):
        while rest:
            item = _take_largest_fitting(rest, keys, capacity - loads[b])
            if item is None:
                break
            bins[b].append(item)
            loads[b] += sizes[item]


def _least_full_bins(rest, sizes, capacity) -> List[List[int]]:
    """Each item into the least-full bin of this phase if it fits, else a new one; the bins by
    load ascending, equal loads in the order they reached it."""
    heap = [(0, 0, [])]   # (load, when it reached that load, items): one empty bin to start
    clock = 1
    for i in rest:
        if sizes[i] <= capacity - heap[0][0]:
            load, _, items = heapq.heappop(heap)
        else:
            load, items = 0, []
        items.append(i)
        heapq.heappush(heap, (load + sizes[i], clock, items))
        clock += 1
    return [items for _, _, items in sorted(heap, key=lambda e: (e[0], e[1])) if items]
