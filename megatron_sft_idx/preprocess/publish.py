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

:func:`publish` is the one function of a run that writes under final names, for every
destination: a local directory (the staged shards are moved) or ``s3://`` / ``msc://`` (uploaded
from the staging directory, which the run keeps until its record is written). Errors of the
store name the URL and say to rerun with ``--resume``; after the commit, the destination is read
back, and a file missing or different fails the run (``IncompleteDestinationError``).
"""

from __future__ import annotations

from typing import Dict, Sequence

from ..errors import IncompleteDestinationError, OutputError, RemoteStorageError, ShardError, ShardNotFoundError
from ..format import PUBLISH_ORDER
from ..publishing import StagedSet, StagedShard, publish_set
from ..storage.destination import Destination
from .receipts import ReceiptBook

__all__ = ["StagedShard", "StagedSet", "published_files", "publish", "destination_error"]


def published_files(staged: StagedSet, book: ReceiptBook) -> set:
    """Final files already published by this run (valid receipts): not "existing outputs"."""
    done = book.completed(range(len(staged.shards)))
    return {staged.shards[i].final + s for i in done for s in PUBLISH_ORDER}


def destination_error(exc: ShardError, path: str, doing: str, resumable: bool) -> ShardError:
    """One line naming the output, what failed and what to do (never the client's traceback)."""
    then = "; then rerun with --resume to finish the upload" if resumable else ""
    if isinstance(exc, ShardNotFoundError):
        return OutputError(f"cannot {doing}: the bucket (or MSC profile path) does not exist", path=path,
                           hint=f"create the bucket or fix --output-prefix{then}")
    if exc.field == "retries":  # no answer at all, or only failures: the endpoint or the network
        return OutputError(f"cannot {doing}: {exc.message}", path=path,
                           hint="check the endpoint (AWS_ENDPOINT_URL, or the MSC profile) and the network, or "
                                f"raise MEGATRON_SFT_IDX_RETRIES{then}")
    return OutputError(f"cannot {doing}: {exc.message}", path=path,
                       hint=(exc.hint or RemoteStorageError.default_hint) + then)


def publish(staged: StagedSet, replaced: Sequence[str], book: ReceiptBook, destination: Destination,
            on_shard=None) -> Dict[str, bytes]:
    """Publish every staged shard to its final prefix, then the orders and the manifests, and
    read the destination back. Returns ``{final: bytes}`` of the orders and manifests written.

    ``replaced`` are existing output files of an earlier generation (``--overwrite``); they are
    removed after the manifests and before any shard is moved, ``.idx`` files first. Each shard
    committed is recorded in ``book``; ``on_shard()`` is called after each shard (progress).

    Raises:
        ShardError: a staged file is missing (the staging directory was tampered with).
        OutputError: a request failed for good (the URL named; rerun with --resume).
        IncompleteDestinationError: the destination read back lacks a file, or holds one that
            differs (named), or an old file is left.
        OSError: the filesystem refused a rename or write (the caller names it).
    """
    outcome = publish_set(staged, replaced, done=book.completed(range(len(staged.shards))), destination=destination,
                          on_commit=lambda i, files: book.write(i, {"final": staged.shards[i].final}, files),
                          on_shard=on_shard,
                          on_error=lambda exc, path, doing: destination_error(exc, path, doing, resumable=True))
    if not outcome.whole:
        path, why = outcome.problems[0]
        more = f" (and {len(outcome.problems) - 1} more)" if len(outcome.problems) > 1 else ""
        raise IncompleteDestinationError(f"the output, read back after publishing, is not whole: {why}{more}",
                                         path=path, hint="rerun with --resume to publish it again")
    return outcome.written
