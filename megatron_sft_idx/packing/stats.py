"""Summary statistics of a packing (the builder computes the per-shard ones it stores)."""

from __future__ import annotations

import math
from typing import Dict

import numpy as np

from .algorithms import PackAssignment


def packing_summary(assignment: PackAssignment, lengths) -> Dict[str, float]:
    """Bins, fill and how far the packing is from the lower bound ``ceil(sum / capacity)``.

    ``efficiency`` is tokens / (bins * capacity); ``bins_over_lower_bound`` is
    bins / ceil(tokens / capacity) (1.0 is optimal).
    """
    lengths = np.asarray(lengths)
    tokens = int(lengths.sum(dtype=np.int64))  # no int64 copy of the lengths: a planner's memory
    bins = assignment.n_bins
    lower = max(1, math.ceil(tokens / assignment.capacity)) if tokens else 0
    counts = np.diff(assignment.offsets)
    return {
        "sequences": int(lengths.size),
        "bins": bins,
        "tokens": tokens,
        "capacity": assignment.capacity,
        "efficiency": round(tokens / (bins * assignment.capacity), 6) if bins else 0.0,
        "lower_bound_bins": lower,
        "bins_over_lower_bound": round(bins / lower, 6) if lower else 0.0,
        "max_sequences_per_bin": int(counts.max()) if bins else 0,
        "mean_sequences_per_bin": round(float(lengths.size / bins), 6) if bins else 0.0,
    }
