"""Token-level training flags to the LABEL-ALIGNED mask a shard stores (``mask[j] = trained[j+1]``,
the last position 0): from character spans (:func:`trained_from_offsets`), and for pre-tokenized
records (:func:`encode_tokens`)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .errors import input_error


def label_aligned(trained: np.ndarray, path: str, line: int) -> np.ndarray:
    """``trained`` (token-aligned flags) shifted to label alignment.

    Raises:
        InputError: nothing is trained (reason ``no_trainable_tokens``).
    """
    mask = np.zeros(trained.size, dtype=np.uint8)
    mask[:-1] = trained[1:]
    if not mask.any():
        raise input_error("no token is trained: the loss mask comes out all zero", path, line,
                          field="loss_mask", reason="no_trainable_tokens",
                          hint="the conversation has no assistant turn (or the template hides it)")
    return mask


def label_aligned_all(trained: np.ndarray, offsets: np.ndarray):
    """:func:`label_aligned` of every text of a batch at once (text ``k``'s flags at
    ``offsets[k]:offsets[k + 1]``): ``(masks, untrained)``, the label-aligned masks at the same
    offsets and, per text, whether nothing is trained (:func:`label_aligned` refuses those: the
    caller asks it, for the error)."""
    mask = np.zeros(trained.size, dtype=np.uint8)
    mask[:-1] = trained[1:]
    sizes = np.diff(offsets)
    mask[offsets[1:][sizes > 0] - 1] = 0   # (each text's last position)
    total = np.zeros(trained.size + 1, dtype=np.int64)
    np.cumsum(mask, out=total[1:])
    return mask, total[offsets[1:]] == total[offsets[:-1]]


def trained_from_offsets(starts: np.ndarray, spans) -> np.ndarray:
    """Token-aligned flags: 1 on every token whose start offset lies inside a span (reference rule)."""
    trained = np.zeros(starts.size, dtype=np.uint8)
    for a, b in spans:
        trained[np.searchsorted(starts, a, "left"):np.searchsorted(starts, b, "left")] = 1
    return trained


def encode_tokens(ids, loss_mask, answer_start: Optional[int], vocab_size: Optional[int], path: str, line: int):
    """Pre-tokenized record -> ids and LABEL-ALIGNED mask.

    ``loss_mask`` in the input is token-aligned (1 on each token the model must
    produce); ``answer_start_idx`` trains every token from that index on
    (Megatron-Bridge's convention). Both are shifted to label alignment here.

    Raises:
        InputError: a token id outside ``[0, vocab_size)``, loss values not 0/1, or
            nothing trained.
    """
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # (a Parquet uint64 or a JSON integer past int64: never a token id)
        bad = next(i for i, t in enumerate(ids) if not -(1 << 63) <= t < 1 << 63)
        raise input_error(f"token id {ids[bad]} at position {bad} does not fit int64", path, line,
                          field="input_ids", reason="token_out_of_vocab") from None
    if arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size):
        bad = int(np.flatnonzero((arr < 0) | (arr >= (vocab_size or np.iinfo(np.int64).max)))[0])
        raise input_error(f"token id {int(arr[bad])} at position {bad} is outside the vocabulary "
                          f"[0, {vocab_size})", path, line, field="input_ids", reason="token_out_of_vocab")
    if loss_mask is not None:
        trained = np.asarray(loss_mask)
        if trained.dtype == object or not np.isin(trained, (0, 1)).all():
            raise input_error("'loss_mask' values must be 0 or 1", path, line, field="loss_mask",
                              reason="missing_key")
        trained = trained.astype(np.uint8)
    else:
        trained = np.zeros(arr.size, dtype=np.uint8)
        trained[answer_start:] = 1
    return arr, label_aligned(trained, path, line)
