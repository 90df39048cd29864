"""A run's own receipts -- the *intent* (every final file it owns) and the *record* of a
finished run -- and what they say of its outputs.

The intent is written before any final name is touched, the record (``done``: the summary,
every published file with its size and CRC-32, the inputs by digest) once the last output is
published: the run's commit point (:mod:`.driver`). ``--resume`` reads both: the files they name
are the run's own (never "existing outputs"), and a record whose outputs are still there,
complete and identical (:func:`check_outputs`) makes the resumed run a no-op.
"""

from __future__ import annotations

import os
import zlib
from typing import Dict, List, Mapping

from ..errors import RemoteStorageError, ShardError, ShardNotFoundError
from ..format import SEQ_IDX_SUFFIX
from ..jsondoc import HEX, check_int
from .integrity import check_crc
from ..storage.destination import Destination
from .publish import StagedSet, destination_error
from .receipts import REDO_HINT, ReceiptBook
from .summary import check_summary
from .workdir import WorkDir

def _intent_schema(doc) -> None:
    for k, item in enumerate(doc.list("files")):
        if not isinstance(item, str):
            raise doc.fail("must be a string", f"files[{k}]")


def _done_schema(doc) -> None:
    check_summary(doc.doc("summary"))
    record = doc.doc("outputs")
    for path in record.obj:
        entry = record.list(path, length=2)
        check_int(entry[0], doc.path, f"outputs.{path}[0]", lo=0)
        if entry[1] is not None:
            check_int(entry[1], doc.path, f"outputs.{path}[1]", lo=0, hi=0xFFFFFFFF)
    for info in doc.docs("inputs"):
        info.str("name")
        info.str("sha256", pattern=HEX[64])


def _outputs_schema(doc) -> None:
    doc.mapping("outputs", lambda v, f: v)


def run_books(work: WorkDir, key: str) -> Dict[str, ReceiptBook]:
    """The receipts of the run itself: ``intent`` (the files it owns) and ``done`` (its record)."""
    return {"intent": ReceiptBook(work.receipts, "intent", key, work.path, _intent_schema),
            "done": ReceiptBook(work.receipts, "done", key, work.path, _done_schema)}


def owned_files(work: WorkDir, key: str) -> set:
    """Final files an earlier attempt of this run published or meant to (not "existing
    outputs"): its intent, and the outputs of its record if it finished (read for them alone:
    a record whose summary no longer parses still names the run's own outputs)."""
    intent = run_books(work, key)["intent"].read(0)
    done = ReceiptBook(work.receipts, "done", key, work.path, _outputs_schema).read(0)
    return set(intent["files"] if intent else ()) | set(done["outputs"] if done else ())


def record_outputs(staged: StagedSet, receipts: List[dict], work: WorkDir,
                   written: Mapping[str, bytes]) -> Dict[str, list]:
    """``{final file: [size, CRC-32]}`` of everything the run published: the shards' files from
    their metadata and materialize receipts, the manifests and orders from the bytes written
    (``written``, :func:`.publish.publish`'s)."""
    record: Dict[str, list] = {}
    for shard, receipt in zip(staged.shards, receipts):
        for suffix, digest in receipt["metadata"]["files"].items():
            record[shard.final + suffix] = [digest["size"], digest["crc32"]]
        rel = os.path.relpath(shard.staged + SEQ_IDX_SUFFIX, work.path)
        record[shard.final + SEQ_IDX_SUFFIX] = [receipt["artifacts"][rel], receipt.get("crc32", {}).get(rel)]
    for path, data in written.items():
        record[path] = [len(data), zlib.crc32(data)]
    return record


def check_outputs(record: Dict[str, list], destination: Destination) -> None:
    """Raise unless every output of a finished run's record is still there, complete and
    identical: by size (one listing per directory), and by CRC-32 where the destination reads
    whole files cheaply (local files, read once; objects are trusted by their listed size).

    Raises:
        ShardError: a file or object is missing, or differs (naming it); OutputError: the
            destination cannot be listed.
    """
    paths = sorted(record)
    try:
        sizes = destination.sizes(paths) if paths else {}
    except (RemoteStorageError, ShardNotFoundError) as exc:
        raise destination_error(exc, paths[0], "list the outputs", resumable=False) from None
    for path in paths:
        size, crc = record[path]
        actual = sizes.get(path)
        if actual is None:
            raise ShardError("a published file is missing", path=path, field="size", expected=size)
        if actual != size:
            raise ShardError("a published file changed size", path=path, field="size", expected=size, actual=actual)
        if crc is not None and destination.cheap_reads:
            check_crc(path, crc, "a published file", REDO_HINT)
