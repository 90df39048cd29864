"""Publishing a run's output set, with a receipt per shard so that ``--resume`` continues an
interrupted publish where it stopped.

The commit rule is :mod:`megatron_sft_idx.publishing`'s, for a local output and an ``s3://`` /
``msc://`` one alike (:func:`~megatron_sft_idx.publishing.publish_set`). Two commit points, one
per kind of reader:

* a **shard**: its ``.idx``, removed before its companions are replaced and renamed (or
  uploaded) last, so a reader of one prefix sees a whole shard of one generation or no shard;
* a **set** (the shards of one split, when the run writes more than one shard): its manifest
  ``BASE.json`` (:mod:`megatron_sft_idx.manifest`, readable by ``open_packed`` and as a Megatron
  ``data_path``), removed before the first shard is touched and written after the last one is
  in place, so a reader of the set sees the whole previous set, no set, or the whole new set.

:func:`publish` is the one function of a run that writes under final names (an object-storage
output: :func:`.remote_outputs.publish_remote`, the same with errors that name the URL).
"""

from __future__ import annotations

from typing import Sequence

from .._atomic import clear_stale_temporaries
from ..format import PUBLISH_ORDER
from ..publishing import StagedSet, StagedShard, publish_set
from .receipts import ReceiptBook

__all__ = ["StagedShard", "StagedSet", "published_files", "publish"]


def published_files(staged: StagedSet, book: ReceiptBook) -> set:
    """Final files already published by this run (valid receipts): not "existing outputs"."""
    done = book.completed(range(len(staged.shards)))
    return {staged.shards[i].final + s for i in done for s in PUBLISH_ORDER}


def publish(staged: StagedSet, replaced: Sequence[str], book: ReceiptBook, on_shard=None, on_error=None) -> None:
    """Move every staged shard to its final prefix (or upload it), then write the manifests.

    ``replaced`` are existing output files of an earlier generation (``--overwrite``); they are
    removed after the manifests and before any shard is moved, ``.idx`` files first. Each shard
    committed is recorded in ``book``; ``on_shard()`` is called after each shard (progress).

    Raises:
        ShardError: a staged file is missing (the staging directory was tampered with).
        OSError: the filesystem refused a rename or write (the caller names it).
    """
    # An order write an earlier attempt was killed in leaves its temporary beside the final name
    # (manifests' are cleared by publish_set): a resumed publish removes it before writing again.
    clear_stale_temporaries([order.final for order in staged.orders])
    publish_set(staged, replaced, done=book.completed(range(len(staged.shards))),
                on_commit=lambda i, files: book.write(i, {"final": staged.shards[i].final}, files),
                on_shard=on_shard, on_error=on_error)
