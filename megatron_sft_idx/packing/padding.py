"""Per-sequence padding multiples for context/tensor/sequence parallelism, in both layouts.

Context parallelism splits every sequence into ``2*CP`` chunks (two per rank,
for causal load balance), so each sequence the attention kernel sees must be a
multiple of ``2*CP`` tokens; with sequence parallelism each of those chunks is
further split over the TP ranks, so the length must also be a multiple of ``CP*TP``.

*Which* length the kernel sees depends on the consumer, so a shard records its
``pad_layout`` (:data:`~megatron_sft_idx.format.PAD_LAYOUTS`):

* ``"stored"`` (Megatron-LM's SFT datasets): the stored sequence itself, ``L``;
* ``"runtime"`` (Megatron-Bridge): the runtime segment after the label shift, ``L - 1``.

FP8 training adds a block alignment (:data:`FP8_BLOCK`): NeMo-RL's Megatron path
(``nemo_rl/models/megatron/data.py``, ``_get_pack_sequence_parameters_for_megatron``) pads
each packed row so that, once split over the CP ranks (``2*CP`` chunks) and, with SP, over
the TP ranks, every rank's share is a multiple of the recipe's block: 16 tokens, 32 for
MXFP8, 128 for blockwise FP8 -- a row multiple of ``block * 2*CP * TP(SP)``. Padding each
sequence to that multiple makes every pack's sequences sum to one, whatever a pack holds
(docs/FORMAT.md "FP8 alignment").

:func:`padded_length` is the one rule for both; :func:`truncation_length` the longest
sequence that still fits a pack once padded.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..errors import ShardError
from ..format import PAD_LAYOUT_RUNTIME, PAD_LAYOUT_STORED, PAD_LAYOUTS

__all__ = ["FP8_BLOCK", "pad_multiple_for", "pad_offset", "padded_length", "padded_lengths", "truncation_length",
           "is_padded"]


#: Tokens per FP8 scaling block, by Megatron's ``--fp8-recipe`` name: what every rank's share of
#: a packed row must be a multiple of (NeMo-RL's divisor for the recipe).
FP8_BLOCK = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}


def pad_multiple_for(cp: int = 1, tp: int = 1, sp: bool = False, fp8: Optional[str] = None) -> int:
    """The multiple every sequence length must have: ``lcm(2*CP, CP*TP)`` with SP, ``2*CP`` without;
    with an FP8 recipe also ``FP8_BLOCK[fp8] * (2*CP if CP > 1) * (TP if SP)``.

    With ``CP == 1`` there is no chunking, so the multiple is 1 (or TP with SP), or the FP8 block.

    >>> pad_multiple_for(2, 4, True), pad_multiple_for(fp8="mxfp8"), pad_multiple_for(2, 4, True, "mxfp8")
    (8, 32, 512)

    Raises:
        ShardError: CP or TP below 1; an FP8 recipe that is not a key of :data:`FP8_BLOCK`.
    """
    for name, value in (("cp", cp), ("tp", tp)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ShardError(f"--{name} must be an integer >= 1", field=name, actual=value)
    cp_mult = 2 * cp if cp > 1 else 1
    mult = math.lcm(cp_mult, cp * tp) if sp else cp_mult
    if fp8 is None:
        return mult
    if fp8 not in FP8_BLOCK:
        raise ShardError("unknown FP8 recipe", field="fp8", expected=sorted(FP8_BLOCK), actual=fp8,
                         hint="give Megatron's --fp8-recipe name, or no --fp8 for BF16 training")
    return math.lcm(mult, FP8_BLOCK[fp8] * cp_mult * (tp if sp else 1))


def pad_offset(layout: str) -> int:
    """How many stored tokens of a sequence the padded segment leaves out: 0 stored, 1 runtime.

    Raises:
        ShardError: an unknown layout.
    """
    if layout == PAD_LAYOUT_STORED:
        return 0
    if layout == PAD_LAYOUT_RUNTIME:
        return 1
    raise ShardError("unknown padding layout", field="pad_layout", expected=list(PAD_LAYOUTS), actual=layout)


def padded_length(lengths, multiple: int, layout: str = PAD_LAYOUT_STORED) -> np.ndarray:
    """Each stored length padded so its segment in ``layout`` is a multiple of ``multiple`` (int64).

    ``"stored"``: ``ceil(L / m) * m``. ``"runtime"``: ``ceil((L - 1) / m) * m + 1`` (a
    1-token sequence stays 1 token: its runtime segment is empty). Lengths are >= 1.

    >>> padded_length([1, 5, 8, 9], 4).tolist(), padded_length([1, 5, 8, 9], 4, "runtime").tolist()
    ([4, 8, 8, 12], [1, 5, 9, 9])
    """
    off = pad_offset(layout)
    lengths = np.asarray(lengths, dtype=np.int64)
    if multiple <= 1:
        return lengths.copy()
    return -(-(lengths - off) // multiple) * multiple + off


def padded_lengths(lengths, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple`` (the stored layout; int64)."""
    return padded_length(lengths, multiple, PAD_LAYOUT_STORED)


def is_padded(lengths, multiple: int, layout: str = PAD_LAYOUT_STORED) -> np.ndarray:
    """True where a stored length already satisfies ``layout``'s rule for ``multiple``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return (lengths - pad_offset(layout)) % max(int(multiple), 1) == 0


def truncation_length(pack_size: int, multiple: int, layout: str = PAD_LAYOUT_STORED) -> int:
    """The longest stored sequence that fits ``pack_size`` and already satisfies ``layout``."""
    off = pad_offset(layout)
    return ((pack_size - off) // multiple) * multiple + off
