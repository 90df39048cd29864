"""Where the shard tools put their output: a local path, or ``s3://`` / ``msc://`` -- one code path.

A tool holds the output's destination (:mod:`megatron_sft_idx.storage.destination`) and writes
into its staging area (beside a local output, on its filesystem; a fresh local temporary
directory, ``staging_dir``, for a URL); a shard is checked by the promotion gate there, then
published by the builder's commit (:func:`megatron_sft_idx.publishing.commit_shard`: data
first, ``.idx`` last, the commit point; renamed locally, uploaded to object storage) and read
back (sizes, headers, metadata). So a reader sees the whole new shard or none of it, wherever
it lives. An interruption (SIGINT, SIGTERM) after the ``.idx`` landed is marked on the
exception (``published``), so the command line says the output was published; before, nothing
that opens is left there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from .. import publishing
from .._signals import INTERRUPTS, raise_if_signalled
from ..errors import ChecksumError, IncompleteDestinationError, InvariantError, ShardError
from ..format import IDX_SUFFIX, PUBLISH_ORDER
from ..storage.destination import Destination, Expect
from ..storage.urls import local_only

__all__ = ["gate_or_refuse", "refuse_existing", "marks_published", "publish_staged", "publish_file",
           "refuse_remote_input"]


def gate_or_refuse(staged: str, output: str, level: str) -> None:
    """Check the staged shard; refuse it (nothing published) unless it passes.

    Raises:
        ChecksumError, InvariantError: the shard failed the gate (the first findings named).
    """
    from ..gate import check   # (start-up: it loads numba; --help and usage errors never need it)

    report = check(staged, level=level)
    if report.passed:
        return
    errors = [f for f in report.findings() if f.severity == "error"]
    shown = "; ".join(f"{f.code} {os.path.basename(f.file)}: {f.message}" for f in errors[:3])
    err = ChecksumError if errors and errors[0].code.startswith("CHECKSUM") else InvariantError
    raise err(f"the output failed the gate, so nothing was published: {shown}", path=output,
              field=errors[0].code if errors else None,
              hint="an input is probably corrupt: run check-idx on the inputs and rebuild the bad one")


def refuse_existing(output: str, destination: Destination, *, shard: bool = True) -> None:
    """Refuse an output that exists (a shard: its ``.idx``; a file: the file or object).

    Raises:
        ShardExistsError: it exists (pass ``--overwrite`` to replace it).
    """
    path = output + IDX_SUFFIX if shard else output
    publishing.refuse_existing([path] if destination.exists(path) else [])


def refuse_remote_input(path: str, tool: str) -> None:
    """Refuse an ``s3://`` / ``msc://`` input the tool cannot read in place, saying what to do.

    Raises:
        ShardError: ``path`` is a URL.
    """
    if local_only([("input", path)]):
        raise ShardError(f"{tool} reads local inputs only", path=path, field="input",
                         hint="copy the input to local disk first (merge-shards reads s3:// and msc:// "
                              "shards, e.g. merge-shards /local/copy s3://bucket/shard)")


@contextlib.contextmanager
def marks_published(output: str, destination: Destination, *, shard: bool = True) -> Iterator[None]:
    """Around everything a tool does to publish ``output``: an interruption (SIGINT, SIGTERM)
    that arrives once the output's commit point (a shard's ``.idx``, a file itself) is a new one
    -- during the read-back or the staging's cleanup -- is marked ``published`` on the exception,
    so the command line says the output is complete."""
    point = output + IDX_SUFFIX if shard else output
    before = destination.stamp(point)
    try:
        yield
    except INTERRUPTS as exc:
        after = destination.stamp(point)
        if after is not None and after != before:
            exc.published = output
        raise


def publish_staged(staged: str, output: str, destination: Destination) -> None:
    """Publish the gated local shard ``staged`` at ``output`` (data first, ``.idx`` last),
    replacing what is there, then read it back (inside :func:`marks_published`).

    Raises:
        IncompleteDestinationError: the shard read back is missing a file or differs (named).
        OSError, RemoteStorageError: a step failed (nothing that opens is left at ``output``).
    """
    files = {s: staged + s for s in PUBLISH_ORDER if os.path.exists(staged + s)}
    expected = publishing.expect_shard(staged, output)
    raise_if_signalled()  # the last point where a signal dropped inside numba stops the publish
    publishing.commit_shard(files, output, destination)
    _read_back(destination, expected)


def publish_file(local: str, output: str, destination: Destination) -> None:
    """Publish one finished local file (e.g. a Parquet file) at ``output``, whole (a rename, or
    one PUT), then read its size back.

    Raises:
        IncompleteDestinationError: the file read back is missing or differs in size.
    """
    expected = [Expect(output, os.path.getsize(local))]
    raise_if_signalled()
    destination.put(local, output)
    _read_back(destination, expected)


def _read_back(destination: Destination, expected) -> None:
    problems = destination.read_back(expected)
    if problems:
        path, why = problems[0]
        raise IncompleteDestinationError(f"the output, read back after publishing, is not whole: {why}", path=path,
                                         hint="publish it again (--overwrite)")
