"""Conversations (or pre-tokenized samples) in, packed shards out: see :mod:`.cli` and :mod:`.pipeline`."""

from .errors import InputError

__all__ = ["InputError"]
