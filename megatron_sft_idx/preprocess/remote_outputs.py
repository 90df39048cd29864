"""Output prefixes in object storage: ``preprocess-sft --output-prefix s3://bucket/sft/ds``
(and ``msc://profile/...``; ``repack-sft`` alike).

The run is the local one, relocated: its work directory (lock, receipts, sequence store,
plan, staged shards) lives in a local staging directory keyed by the URL,
``<staging-dir>/megatron_sft_idx-<digest of the URL>/.<name>.preprocess``, so ``--resume``
after a kill finds it again. The shards are materialized, verified and gated there exactly
as for a local output, then :func:`publish_remote` uploads them by the local publish's rule
(:func:`megatron_sft_idx.publishing.publish_set`):

1. the set's manifests are deleted, then (``--overwrite``) the old shards' objects, every
   ``.idx`` before any data object, so no reader pairs an old index with new data;
2. every shard, data objects first and ``.idx`` last
   (:func:`megatron_sft_idx.publishing.upload_shard`: multipart, parts in parallel), each
   followed by a publish receipt, so a resumed upload sends only the shards without one
   (sending a shard again is idempotent: the same bytes give the same objects);
3. the manifests ``BASE.json`` last, one PUT each: the set's commit point, so a reader of
   the set sees no set or the whole set.

The local copies go with the work directory after success; a failed upload keeps it, and
``--resume`` finishes the upload.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from typing import Dict, List, Optional, Sequence

from ..errors import OutputError, RemoteStorageError, ShardError, ShardNotFoundError
from ..format import ALL_SUFFIXES, ORDER_SUFFIX
from ..manifest import MANIFEST_SUFFIX
from ..storage._url import ObjectURL, is_remote
from .publish import StagedSet, publish
from .receipts import ReceiptBook

__all__ = ["is_remote", "work_prefix", "existing_remote_outputs", "publish_remote", "job_output_key", "remote_sizes"]
_STAGING_TAG = "megatron_sft_idx-"


def _check_prefix(output_prefix: str) -> ObjectURL:
    """The URL of an output prefix that names its shards (``s3://bucket/dir/NAME``).

    Raises:
        ShardError: not a URL, or no name after the last ``/``.
    """
    url = ObjectURL.parse(output_prefix)
    if not url.key or url.key.endswith("/"):
        raise ShardError("an output prefix in object storage must end in the shards' name", path=output_prefix,
                         field="output_prefix", hint="e.g. s3://bucket/sft/ds writes s3://bucket/sft/ds_train_000000...")
    return url


def work_prefix(output_prefix: str, staging_dir: Optional[str]) -> str:
    """The local prefix whose work directory a run writing ``output_prefix`` uses: the prefix
    itself when local; for a URL, ``NAME`` in a directory of ``staging_dir`` (default: the
    system's temporary directory) named by a digest of the URL, so every run writing that URL
    (and only those) shares the lock and the receipts."""
    if not is_remote(output_prefix):
        return output_prefix
    url = _check_prefix(output_prefix)
    digest = hashlib.sha256(str(url).encode("utf-8")).hexdigest()[:16]
    root = os.path.abspath(staging_dir or tempfile.gettempdir())
    return os.path.join(root, _STAGING_TAG + digest, url.name)


def job_output_key(output_prefix: str) -> str:
    """How an output prefix enters the run's settings key (a URL as given, a path absolute)."""
    return str(ObjectURL.parse(output_prefix)) if is_remote(output_prefix) else os.path.abspath(output_prefix)


def _store(url: ObjectURL):
    from ..storage._stores import store_for
    from ..storage.config import StorageConfig

    return store_for(url, StorageConfig.resolve(None))


def _destination_error(exc: ShardError, url: ObjectURL, doing: str, resumable: bool) -> ShardError:
    """One line naming the URL, what failed and what to do (never the client's traceback)."""
    then = "; then rerun with --resume to finish the upload" if resumable else ""
    if isinstance(exc, ShardNotFoundError):
        err = OutputError(f"cannot {doing}: the bucket (or MSC profile path) does not exist", path=str(url),
                          hint=f"create the bucket {url.bucket!r} or fix --output-prefix{then}")
    elif exc.field == "retries":  # no answer at all, or only failures: the endpoint or the network
        err = OutputError(f"cannot {doing}: {exc.message}", path=str(url),
                          hint="check the endpoint (AWS_ENDPOINT_URL, or the MSC profile) and the network, or "
                               f"raise MEGATRON_SFT_IDX_RETRIES{then}")
    else:
        err = OutputError(f"cannot {doing}: {exc.message}", path=str(url),
                          hint=(exc.hint or RemoteStorageError.default_hint) + then)
    return err


def remote_sizes(urls: Sequence[str]) -> Dict[str, int]:
    """``{url: size}`` of those of ``urls`` that exist: one LIST per directory they are in.

    Raises:
        OutputError: the bucket is missing or unreachable, or credentials are refused.
    """
    out: Dict[str, int] = {}
    for parent in sorted({u.rsplit("/", 1)[0] + "/" for u in urls}):
        url = ObjectURL.parse(parent)
        try:
            listed = _store(url).list(url)
        except (RemoteStorageError, ShardNotFoundError) as exc:
            raise _destination_error(exc, url, "list the outputs", resumable=False) from None
        out.update((str(obj), info.size) for obj, info in listed)
    normal = {u: str(ObjectURL.parse(u)) for u in urls}
    return {u: out[normal[u]] for u in urls if normal[u] in out}


def existing_remote_outputs(bases: Sequence[str]) -> List[str]:
    """Objects of shards already at ``base`` or ``base_NNNNNN``, manifests ``base.json`` and
    balanced orders ``base.order``, for any base: one LIST per base (the same names :func:`.outputs.existing_outputs` finds
    on disk).

    Raises:
        OutputError: the bucket is missing or unreachable, or credentials are refused (one
            line naming the URL); MissingExtraError: boto3 / multi-storage-client absent.
    """
    files = "|".join(re.escape(s) for s in (*ALL_SUFFIXES, MANIFEST_SUFFIX, ORDER_SUFFIX))
    ours = re.compile(rf"(_\d{{6}})?({files})")
    found = []
    for base in bases:
        url = _check_prefix(base)
        try:
            listed = _store(url).list(url)
        except (RemoteStorageError, ShardNotFoundError) as exc:
            raise _destination_error(exc, url, "list the output prefix", resumable=False) from None
        for obj, _ in listed:
            rest = obj.key[len(url.key):]
            if ours.fullmatch(rest) and not (rest.startswith("_") and rest.endswith(MANIFEST_SUFFIX)):
                found.append(str(obj))
    return sorted(set(found))


def publish_remote(staged: StagedSet, replaced: Sequence[str], book: ReceiptBook, on_shard=None) -> None:
    """Upload the gated staged set: old manifests and replaced objects removed (``.idx``
    first), each shard data first and ``.idx`` last with a receipt, then the manifests.
    ``on_shard()`` is called after each shard (progress).

    Raises:
        OutputError: a request failed for good (the URL named; the work directory is kept,
            so ``--resume`` finishes the upload); ShardError: a staged shard does not open.
    """
    publish(staged, replaced, book, on_shard,
            on_error=lambda exc, path, doing: _destination_error(exc, ObjectURL.parse(path), doing, resumable=True))
