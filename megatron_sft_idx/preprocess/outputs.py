"""Output names and the run's work directory.

Shards are built under a work directory next to the output (``.<name>.preprocess``) and
moved to their final names only after every shard (and ``--check``) succeeded
(:mod:`.publish`, by the rule of :mod:`megatron_sft_idx.publishing`). The work directory holds the run's lock (its pid), its receipts, the pack
plan, the staged shards and, without ``--store``, the sequence store. A run that is killed
leaves only its work directory: the next run clears it, or continues from it with ``--resume``.
An ``s3://`` / ``msc://`` output prefix works in a local staging directory instead and uploads
the set (:mod:`.remote_outputs`).
"""

from __future__ import annotations

import glob
import os
import re
from typing import List, Sequence

from ..format import ALL_SUFFIXES, ORDER_SUFFIX
from ..manifest import MANIFEST_SUFFIX
from ..publishing import refuse_existing as _refuse
from ..storage._url import is_remote


def split_prefix(output_prefix: str, split: str, splitting: bool) -> str:
    return f"{output_prefix}_{split}" if splitting else output_prefix


def shard_prefix(base: str, index: int, numbered: bool) -> str:
    return f"{base}_{index:06d}" if numbered else base


def manifest_path(base: str) -> str:
    return base + MANIFEST_SUFFIX


def existing_outputs(bases: Sequence[str]) -> List[str]:
    """Files of shards already at ``base`` or ``base_NNNNNN``, manifests ``base.json`` and balanced
    orders ``base.order`` / ``base_NNNNNN.order``, for any base (objects, for bases in object
    storage: :mod:`.remote_outputs`, which lists shards and manifests)."""
    if any(is_remote(b) for b in bases):
        from .remote_outputs import existing_remote_outputs

        return existing_remote_outputs(bases)
    found = []
    for base in bases:
        if os.path.exists(manifest_path(base)):
            found.append(manifest_path(base))
        for suffix in ALL_SUFFIXES + (ORDER_SUFFIX,):
            if os.path.exists(base + suffix):
                found.append(base + suffix)
        numbered = re.compile(re.escape(os.path.basename(base)) + r"_\d{6}(\.|$)")
        for path in glob.glob(glob.escape(base) + "_" + "[0-9]" * 6 + ".*"):
            if numbered.match(os.path.basename(path)) and path.endswith(ALL_SUFFIXES + (ORDER_SUFFIX,)):
                found.append(path)
    return sorted(set(found))


def normal_path(path: str) -> str:
    """A final path as runs compare them: absolute for a local one, a URL as given."""
    return path if is_remote(path) else os.path.abspath(path)


def refuse_existing(bases: Sequence[str], overwrite: bool, ours=frozenset()) -> List[str]:
    """Raise unless no output exists or ``overwrite``; returns what would be replaced.

    ``ours`` are files this run already published (a resumed publish): they do not count.

    Raises:
        ShardExistsError: an output exists and ``overwrite`` is false.
    """
    mine = {normal_path(p) for p in ours}
    found = [p for p in existing_outputs(bases) if normal_path(p) not in mine]
    if not overwrite:
        _refuse(found, replace_with="--overwrite", elsewhere="another --output-prefix")
    return found


