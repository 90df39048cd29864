"""Publishing the output set: every staged shard under its final name, then the manifests.

Two commit points, one per kind of reader:

* a **shard**: its ``.idx``, removed before its companions are replaced and renamed last, so a
  reader of one prefix sees a whole shard of one generation or no shard;
* a **set** (the shards of one split, when the run writes more than one shard): its manifest
  ``BASE.json`` (``training.multi`` format, readable by ``open_packed`` and as a Megatron
  ``data_path``), removed before the first shard is touched and written after the last one is
  in place, so a reader of the set sees the whole previous set, no set, or the whole new set.

Each shard's move is recorded by a receipt, so a publish interrupted half-way continues where it
stopped under ``--resume``. :func:`publish` is the one function that writes under final names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, Tuple

from .. import _atomic
from ..errors import ShardError
from ..format import IDX_SUFFIX, PUBLISH_ORDER
from .receipts import ReceiptBook


@dataclass(frozen=True)
class StagedShard:
    staged: str     # prefix in the staging directory (a complete shard)
    final: str      # prefix it is published to


@dataclass(frozen=True)
class StagedSet:
    """What one run publishes: its shards and, when it writes several, one manifest per split."""

    shards: Tuple[StagedShard, ...]
    manifests: Tuple[Tuple[str, Tuple[str, ...]], ...]   # (manifest path, final prefixes it lists)


def published_files(staged: StagedSet, book: ReceiptBook) -> set:
    """Final files already published by this run (valid receipts): not "existing outputs"."""
    done = book.completed(range(len(staged.shards)))
    return {staged.shards[i].final + s for i in done for s in PUBLISH_ORDER}


def publish(staged: StagedSet, replaced: Sequence[str], book: ReceiptBook, on_shard=None) -> None:
    """Move every staged shard to its final prefix, then write the manifests.

    ``replaced`` are existing output files of an earlier generation (``--overwrite``); they are
    removed after the manifests and before any shard is moved, ``.idx`` files first.
    ``on_shard()`` is called after each shard (progress).

    Raises:
        ShardError: a staged file is missing (the staging directory was tampered with).
        OSError: the filesystem refused a rename or write (the caller names it).
    """
    for path, _ in staged.manifests:
        _atomic.remove_quietly([path])
        _atomic.clear_stale_temporaries([path])   # (a manifest write an earlier attempt was killed in)
    done = set(book.completed(range(len(staged.shards))))
    keep = {staged.shards[i].final + s for i in done for s in PUBLISH_ORDER}
    for path in sorted((p for p in replaced if p not in keep), key=lambda p: not p.endswith(IDX_SUFFIX)):
        _atomic.remove_quietly([path])
    for i, shard in enumerate(staged.shards):
        if i not in done:
            _move_shard(shard)
            book.write(i, {"final": shard.final}, [shard.final + s for s in PUBLISH_ORDER])
        if on_shard is not None:
            on_shard()
    for path, finals in staged.manifests:
        from ..multi import write_manifest

        write_manifest(path, list(finals), relative=True)


def _move_shard(shard: StagedShard) -> None:
    """Rename the five files, ``.idx`` last; resumable after an interruption at any point."""
    if os.path.exists(shard.staged + IDX_SUFFIX):  # not yet committed: no reader may pair old and new
        _atomic.remove_quietly([shard.final + IDX_SUFFIX])
        _atomic.fsync_dir(shard.final)
    for suffix in PUBLISH_ORDER:
        src, dst = shard.staged + suffix, shard.final + suffix
        if os.path.exists(src):
            os.replace(src, dst)
        elif not os.path.exists(dst):
            raise ShardError("a staged file vanished before it was published", path=src,
                             hint="rerun without --resume to rebuild the output")
    _atomic.fsync_dir(shard.final)
