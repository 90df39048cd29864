"""Output names and what exists under them: the final names a run publishes (split prefixes,
shards, orders, manifests), found through the output's destination, and the refusal of outputs
that exist (unless ``--overwrite``).

The work directory the shards are staged in is :mod:`.workdir`'s (its place: the destination's
:meth:`~megatron_sft_idx.storage.destination.Destination.work_prefix`); publishing them to these
names is :mod:`.publish`'s, by the rule of :mod:`megatron_sft_idx.publishing`.
"""

from __future__ import annotations

import re
from typing import List, Sequence

from ..errors import RemoteStorageError, ShardNotFoundError
from ..format import ALL_SUFFIXES, ORDER_SUFFIX
from ..manifest import MANIFEST_SUFFIX
from ..publishing import refuse_existing as _refuse
from ..storage.destination import Destination, destination_for
from .publish import destination_error


def split_prefix(output_prefix: str, split: str, splitting: bool) -> str:
    return f"{output_prefix}_{split}" if splitting else output_prefix


def shard_prefix(base: str, index: int, numbered: bool) -> str:
    return f"{base}_{index:06d}" if numbered else base


def manifest_path(base: str) -> str:
    return base + MANIFEST_SUFFIX


_FILES = "|".join(re.escape(s) for s in (*ALL_SUFFIXES, MANIFEST_SUFFIX, ORDER_SUFFIX))
#: What follows a base in the names of a run's outputs: a shard's file (``_NNNNNN`` numbered or
#: not), its balanced order, the manifest ``BASE.json`` (never ``BASE_NNNNNN.json``).
_OURS = re.compile(rf"(_\d{{6}})?({_FILES})")


def existing_outputs(bases: Sequence[str], destination: Destination) -> List[str]:
    """Files (or objects) of shards already at ``base`` or ``base_NNNNNN``, manifests ``base.json``
    and balanced orders ``base.order`` / ``base_NNNNNN.order``, for any base: one listing per base.

    Raises:
        OutputError: the bucket is missing or unreachable, or credentials are refused (one
            line naming the URL); MissingExtraError: boto3 / multi-storage-client absent.
    """
    found = []
    for base in bases:
        try:
            listed = destination.listing(base)
        except (RemoteStorageError, ShardNotFoundError) as exc:
            raise destination_error(exc, base, "list the output prefix", resumable=False) from None
        for path in listed:
            rest = destination.name(path)[len(destination.name(base)):]
            if _OURS.fullmatch(rest) and not (rest.startswith("_") and rest.endswith(MANIFEST_SUFFIX)):
                found.append(path)
    return sorted(set(found))


def normal_path(path: str) -> str:
    """A final path as runs compare them: absolute for a local one, a URL normalised."""
    return destination_for(path).normal(path)


def refuse_existing(bases: Sequence[str], overwrite: bool, destination: Destination, ours=frozenset()) -> List[str]:
    """Raise unless no output exists or ``overwrite``; returns what would be replaced.

    ``ours`` are files this run already published (a resumed publish): they do not count.

    Raises:
        ShardExistsError: an output exists and ``overwrite`` is false.
    """
    mine = {destination.normal(p) for p in ours}
    found = [p for p in existing_outputs(bases, destination) if destination.normal(p) not in mine]
    if not overwrite:
        _refuse(found, replace_with="--overwrite", elsewhere="another --output-prefix")
    return found
