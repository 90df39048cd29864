"""Locating bad input records (the error class itself is ``megatron_sft_idx.errors.InputError``)."""

from __future__ import annotations

from ..errors import InputError

__all__ = ["InputError", "input_error"]


def input_error(message: str, path: str, line: int, field=None, reason: str = "bad_record",
                hint=None) -> InputError:
    """An :class:`InputError` located at ``path:line``; ``reason`` is the skip-count key."""
    err = InputError(message, path=f"{path}:{line}", field=field, hint=hint)
    err.reason = reason
    return err
