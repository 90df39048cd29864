"""Where the shard tools put their output: a local path, or ``s3://`` / ``msc://``.

A local output is written in a staging directory beside it and published with the builder's
commit (``.idx`` last, :mod:`megatron_sft_idx.publishing`). An object-storage output is
written the same way into a fresh local temporary directory (``staging_dir``, default the
system's temporary directory), checked by the promotion gate, then uploaded by the same rule
-- data files first, ``.idx`` last, the commit point -- and the local copy removed. So a reader of the
bucket sees the whole new shard or none of it, as locally. An interruption (SIGINT,
SIGTERM) after the ``.idx`` was uploaded is marked on the exception (``published``), so the
command line says the output was published; before, nothing that opens is left there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional

from .. import publishing
from .._signals import INTERRUPTS, raise_if_signalled
from ..errors import ChecksumError, InvariantError, ShardError
from ..format import IDX_SUFFIX
from ..storage._url import ObjectURL, is_remote

__all__ = ["gate_or_refuse", "is_remote", "refuse_existing", "remote_staging", "publish_shard_remotely",
           "upload_file", "refuse_remote_input"]


def gate_or_refuse(staged: str, output: str, level: str) -> None:
    """Check the staged shard; refuse it (nothing published) unless it passes.

    Raises:
        ChecksumError, InvariantError: the shard failed the gate (the first findings named).
    """
    from ..gate import check

    report = check(staged, level=level)
    if report.passed:
        return
    errors = [f for f in report.findings() if f.severity == "error"]
    shown = "; ".join(f"{f.code} {os.path.basename(f.file)}: {f.message}" for f in errors[:3])
    err = ChecksumError if errors and errors[0].code.startswith("CHECKSUM") else InvariantError
    raise err(f"the output failed the gate, so nothing was published: {shown}", path=output,
              field=errors[0].code if errors else None,
              hint="an input is probably corrupt: run check-idx on the inputs and rebuild the bad one")


def _store(url: ObjectURL):
    from ..storage._stores import store_for
    from ..storage.config import StorageConfig

    return store_for(url, StorageConfig.resolve(None))


def refuse_existing(output: str, *, shard: bool = True) -> None:
    """Refuse an output that exists (a shard: its ``.idx``; a file: the file or object).

    Raises:
        ShardExistsError: it exists (pass ``--overwrite`` to replace it).
    """
    if shard:
        found = publishing.existing_shard(output, committed=True)
    else:
        found = [output] if publishing.destination_for(output).exists(output) else []
    publishing.refuse_existing(found)


def refuse_remote_input(path: str, tool: str) -> None:
    """Refuse an ``s3://`` / ``msc://`` input the tool cannot read in place, saying what to do.

    Raises:
        ShardError: ``path`` is a URL.
    """
    if is_remote(path):
        raise ShardError(f"{tool} reads local inputs only", path=path, field="input",
                         hint="copy the input to local disk first (merge-shards reads s3:// and msc:// "
                              "shards, e.g. merge-shards /local/copy s3://bucket/shard)")


@contextlib.contextmanager
def remote_staging(output: str, staging_dir: Optional[str] = None) -> Iterator[str]:
    """A local path named like ``output``'s last component, in a fresh temporary directory that is
    removed (with everything in it) when the block exits."""
    if staging_dir:
        os.makedirs(staging_dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="msi-out-", dir=staging_dir)
    try:
        yield os.path.join(directory, ObjectURL.parse(output).name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def publish_shard_remotely(staged: str, output: str) -> None:
    """Upload the gated local shard ``staged`` to the URL ``output`` (data first, ``.idx`` last),
    replacing what is there. An interruption after the new ``.idx`` landed is marked ``published``."""
    url = ObjectURL.parse(output)
    store = _store(url)
    before = store.head(url.with_suffix(IDX_SUFFIX))
    raise_if_signalled()  # the last point where a signal dropped inside numba stops the upload
    try:
        publishing.upload_shard(staged, output, replace=True)
    except INTERRUPTS as exc:
        after = store.head(url.with_suffix(IDX_SUFFIX))
        if after is not None and (before is None or after.etag != before.etag):
            exc.published = output
        raise


def upload_file(local: str, output: str) -> None:
    """Upload one finished local file (e.g. a Parquet file) to the URL ``output``."""
    url = ObjectURL.parse(output)
    raise_if_signalled()
    try:
        publishing.upload_file(local, output)
    except INTERRUPTS as exc:
        info = _store(url).head(url)
        if info is not None and info.size == os.path.getsize(local):
            exc.published = output
        raise
