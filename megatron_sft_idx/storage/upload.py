"""Uploads: the object-store destination is :class:`.destination.ObjectDestination` (one
interface with the local one); :mod:`megatron_sft_idx.publishing` owns the commit rule.

``upload_shard``, ``publish``, ``publish_shard`` and ``local_files`` live in
:mod:`megatron_sft_idx.publishing`; their old names here warn and fail (:mod:`megatron_sft_idx._moved`).
"""

from __future__ import annotations

from .._moved import moved_getattr

__all__: list = []


# The shard and set publishers live in megatron_sft_idx.publishing (the one commit rule): their
# old names here name that home and fail; storage never imports the publisher.
__getattr__ = moved_getattr(__name__)
