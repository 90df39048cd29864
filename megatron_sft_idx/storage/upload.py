"""Uploads: the object-store destination is :class:`.destination.ObjectDestination` (one
interface with the local one); :mod:`megatron_sft_idx.publishing` owns the commit rule.

``upload_shard``, ``publish``, ``publish_shard`` and ``local_files`` are kept as names of
:mod:`megatron_sft_idx.publishing`'s functions (looked up on first use).
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["upload_shard", "publish", "publish_shard", "local_files"]


_PUBLISHING = {"upload_shard", "publish", "publish_shard", "local_files"}


def __getattr__(name: str):
    # The shard and set publishers live in megatron_sft_idx.publishing (the one commit rule); these
    # names stay here for code that imported them from this module, looked up on first use so
    # that storage never imports the publisher (which opens datasets).
    if name in _PUBLISHING:
        return getattr(import_module("..publishing", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
