"""Deterministic partitions of the inputs, and reading one partition's records with bounded memory.

The *index* pass reads each input file once: its sha256 (recorded in every shard's metadata),
and its partitions, which depend only on the file's bytes and ``partition_bytes``:

============  ==================================================  ===============================
kind          inputs                                              unit of work
============  ==================================================  ===============================
lines         uncompressed JSON Lines (``.jsonl``, a ``.json``    byte range ``[start, end)`` cut
              holding lines, any name given directly)             at the first line start at or
                                                                  after each multiple of
                                                                  partition_bytes
array         an uncompressed ``.json`` holding one JSON array    byte range cut at element starts
                                                                  the same way (:mod:`.json_array`)
stream        ``.jsonl.gz``, ``.jsonl.zst`` (and such ``.json``)  the whole file (not seekable)
array_stream  ``.json.gz``, ``.json.zst`` holding an array        the whole file
rows          ``.parquet``                                        row groups ``[start, end)``,
                                                                  grouped up to partition_bytes
arrow         ``.arrow`` (Arrow IPC; a saved Hugging Face         record batches ``[start, end)``,
              dataset's data files)                               grouped the same way
============  ==================================================  ===============================

A file that is not Parquet or Arrow is a JSON array when its first character is ``[`` (whatever
its name: ``.json``, or an array saved as ``.jsonl``), else JSON Lines.

Each partition carries the 1-based number of its first record -- its line in JSON Lines, its
position in an array, its row in Parquet and Arrow -- so every error names ``file:N`` whichever
machine reads it, and concatenating the partitions in order gives the records in input order.
A run on one machine and a run on a cluster cut the same partitions.

Reading never buffers more than one block plus ``max_record_bytes``: a longer line is skipped
to its end without being kept, and reported as an :class:`OversizedRecord`.

An input in object storage is read through the same code (its :class:`.sources.ObjectInput`:
ranged GETs through a bounded read-ahead buffer), so it is cut into the same partitions as a
local copy of its bytes. Every read of it is pinned to one version: the index records the ETag it
read (``etag``), and the partitions are read with ``If-Match`` on it, so an object replaced
since it was indexed fails (ObjectChangedError) instead of mixing two generations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

from ..._extras import require_extra
from ...errors import MetadataError
from ...jsondoc import check_int
from . import arrow_stream, json_array
from .inputs import (ARROW_SUFFIXES, BLOCK, COMPRESSED_SUFFIXES, PARQUET_SUFFIXES, OversizedRecord, open_text_bytes,
                     read_blocks)
from .sources import InputSource, input_source

DEFAULT_PARTITION_BYTES = 64 << 20   # the largest unit --partition-bytes auto cuts
MIN_PARTITION_BYTES = 8 << 20        # the smallest (see auto_partition_bytes)
AUTO_UNITS = 64                      # --partition-bytes auto aims at this many units of input


def auto_partition_bytes(total_bytes: int) -> int:
    """``--partition-bytes auto``: the inputs' bytes cut into :data:`AUTO_UNITS` equal units, or
    fewer so that none is under :data:`MIN_PARTITION_BYTES` (the units are then equal, between 8
    and 16 MiB: a 47.5 MiB file gives 5 units of 9.5 MiB, not 48 of 1 MiB), and none over
    :data:`DEFAULT_PARTITION_BYTES`. Enough units to keep a machine's workers busy and to resume
    close to where a run stopped; few enough that each unit's fixed cost (its store shard's files,
    receipt and syncs: ~10 ms of CPU and a few sync waits) stays ~2% of its work (8 MiB of chat is
    ~0.6 CPU-s to tokenize; 1 MiB units made it ~15%, issue 45). It follows the input size alone,
    not ``--workers``: a run resumed with another worker count cuts the same partitions, so its
    tokenized ones are kept (the partitions never change the output's bytes, only how the work is
    shared).
    """
    units = max(1, min(AUTO_UNITS, total_bytes // MIN_PARTITION_BYTES))
    return int(min(DEFAULT_PARTITION_BYTES, max(MIN_PARTITION_BYTES, -(-total_bytes // units))))
DEFAULT_MAX_RECORD_BYTES = 2 << 20
KINDS = ("lines", "array", "stream", "array_stream", "rows", "arrow")


@dataclass(frozen=True)
class Partition:
    """One unit of tokenization: part of one input file."""

    file: int          # index into the input list
    kind: str          # lines | array | stream | array_stream | rows | arrow
    start: int         # byte offset (lines), 0 (stream), first row group (rows)
    end: int           # byte end, exclusive (lines), -1 (stream), row group end, exclusive (rows)
    first_line: int    # 1-based line (row) number of the partition's first line (row)

    def to_list(self) -> list:
        return [self.file, self.kind, self.start, self.end, self.first_line]

    @classmethod
    def from_list(cls, item, path: str = "", field: str = "partition") -> "Partition":
        """A partition from its ``[file, kind, start, end, first_line]`` record, checked field by field.

        Raises:
            MetadataError: not a list of five, a kind that does not exist, a non-integer
                (naming ``path`` and ``field``).
        """
        if not isinstance(item, list) or len(item) != 5:
            raise MetadataError("a partition is [file, kind, start, end, first_line]", path=path, field=field,
                                actual=item if not isinstance(item, list) else f"{len(item)} items")
        if item[1] not in KINDS:
            raise MetadataError("unknown partition kind", path=path, field=f"{field}[1]", expected=list(KINDS),
                                actual=item[1])
        file, start, end, line = (check_int(item[i], path, f"{field}[{i}]", lo=-1) for i in (0, 2, 3, 4))
        return cls(file, item[1], start, end, line)


def file_kind(source: InputSource, version: str = "") -> str:
    """The partition kind of input ``source``; a JSON file's is decided by its first character
    (``[``: an array), read from the (decompressed) stream.

    Raises:
        OSError, EOFError, ValueError: the file cannot be read.
    """
    if source.name.endswith(PARQUET_SUFFIXES):
        return "rows"
    if source.name.endswith(ARROW_SUFFIXES):
        return "arrow"
    compressed = source.name.endswith(COMPRESSED_SUFFIXES)
    with open_text_bytes(source, version, stop=_SNIFF_BYTES) as stream:
        first = b""
        while not first:
            block = stream.read(4096)
            if not block:
                break
            first = block.lstrip()[:1]
        if first == b"{":
            _refuse_spread_object(block.lstrip() + stream.read(BLOCK))
    if first == b"[":
        return "array_stream" if compressed else "array"
    return "stream" if compressed else "lines"


#: About what :func:`file_kind` reads of a file's start (an object's read-ahead stops there).
_SNIFF_BYTES = BLOCK + 8192


def _refuse_spread_object(head: bytes) -> None:
    """Raise when ``head`` (a file's start, from its first ``{``) is one JSON object written over
    several lines -- a pretty-printed record: read as JSON Lines, each of its lines would be a
    malformed record. JSON Lines' first line closes its object; a pretty-printed one's does not
    and its next line is indented.

    Raises:
        ValueError: the file is one object spread over lines (the caller names the file).
    """
    first, sep, rest = head.partition(b"\n")
    if not sep or first.rstrip().endswith(b"}"):
        return
    second = rest.lstrip(b"\r\n")
    if second[:1] in (b" ", b"\t", b'"', b"}"):
        raise ValueError("the file holds one JSON object written over several lines, not JSON Lines (one object "
                         "a line) or a JSON array: write each record on one line, or wrap the object in [ ]")


#: Kinds read as one stream from the start: a compressed file is one partition ``[0, -1)``.
_WHOLE_FILE_KINDS = ("stream", "array_stream")


def _suffix_kinds(name: str) -> Tuple[str, ...]:
    """The kinds :func:`file_kind` can give a file of this name (JSON Lines or a JSON array is
    told by the content, which a store's reader may not have: its inputs may be elsewhere)."""
    if name.endswith(PARQUET_SUFFIXES):
        return ("rows",)
    if name.endswith(ARROW_SUFFIXES):
        return ("arrow",)
    return ("stream", "array_stream") if name.endswith(COMPRESSED_SUFFIXES) else ("lines", "array")


def check_cover(parts: List[Partition], names: List[str], sizes: List[int], path: str,
                field: str = "partitions") -> None:
    """Raise unless ``parts`` are what :func:`index_file` cuts from inputs of these names and
    byte sizes: by file in input order, each file's kind one its suffix allows, ``lines``,
    ``array``, ``rows`` and ``arrow`` contiguous from 0 (``lines`` and ``array`` ending at the
    file's size), one ``stream`` or ``array_stream`` ``[0, -1)`` per compressed file, first lines
    (elements, rows) rising from 1.

    Raises:
        MetadataError: the first partition that breaks a rule (naming ``path`` and ``field[k]``).
    """
    prev = None
    for k, p in enumerate(parts):
        def bad(rule: str, expected=None, actual=None):
            return MetadataError(f"partition {k} breaks the partition layout: {rule}", path=path,
                                 field=f"{field}[{k}]", expected=expected, actual=actual)

        if not 0 <= p.file < len(names) or (prev is not None and p.file < prev.file):
            raise bad("files in input order", f"{prev.file if prev else 0}..{len(names) - 1}", p.file)
        allowed = _suffix_kinds(names[p.file])
        if p.kind not in allowed:
            raise bad("a kind its input's suffix allows", list(allowed), p.kind)
        first = prev is None or prev.file != p.file
        if p.kind in _WHOLE_FILE_KINDS:
            if not first or (p.start, p.end, p.first_line) != (0, -1, 1):
                raise bad("one [0, -1) partition per compressed file", [p.file, p.kind, 0, -1, 1], p.to_list())
        elif (p.start != (0 if first else prev.end) or p.end <= p.start
              or (p.first_line != 1 if first else p.first_line <= prev.first_line)):
            raise bad("contiguous from 0, non-empty, first lines rising from 1", actual=p.to_list())
        last = k + 1 == len(parts) or parts[k + 1].file != p.file
        if p.kind in ("lines", "array") and last and p.end != sizes[p.file]:
            raise bad("the last partition of a file ends at its size", sizes[p.file], p.end)
        prev = p


# --------------------------------------------------------------------------- index


def index_file(path: Union[str, InputSource], file_index: int, partition_bytes: int) -> dict:
    """sha256, size, mtime (an object's ETag) and the partitions of one input file (local or
    in object storage: the same bytes give the same partitions). ``path``: the input's path or
    URL (or its source, :func:`.sources.input_source`).

    Raises:
        OSError: the file cannot be read (the caller names it); ObjectChangedError: an object
        was replaced while it was indexed; RemoteStorageError: the store failed.
    """
    source = input_source(path)
    size, version = source.stat()   # (an object's every read below is pinned to this version)
    stamp = source.stamp(version)
    kind = file_kind(source, version)
    if kind in ("lines", "array"):
        digest, cuts = (_hash_and_cut_lines if kind == "lines" else _hash_and_cut_array)(source, partition_bytes,
                                                                                          version)
        parts = [Partition(file_index, kind, a, b, line) for (a, line), (b, _) in zip(cuts, cuts[1:])]
    elif kind == "array_stream":
        digest = sha256_file(source, version=version)
        with open_text_bytes(source, version) as stream:  # checks the array is whole before any work is planned
            json_array.cut_points(iter(lambda: stream.read(BLOCK), b""), 1 << 62)
        parts = [Partition(file_index, kind, 0, -1, 1)]
    else:
        digest = sha256_file(source, version=version)
        parts = {"rows": _row_partitions, "arrow": _arrow_partitions}[kind](source, file_index, partition_bytes,
                                                                            version) \
            if kind in ("rows", "arrow") else [Partition(file_index, kind, 0, -1, 1)]
    return {"file": file_index, "name": source.name, "bytes": size, **stamp,
            "sha256": digest, "partitions": [p.to_list() for p in parts]}


def sha256_file(path: Union[str, InputSource], stop=None, version: str = "") -> Optional[str]:
    """sha256 (hex) of a whole file (or object, streamed: ``version`` as
    :meth:`.sources.InputSource.open` takes it), read in blocks; None as soon as ``stop`` (a
    ``threading.Event``) is set, so a hash in a thread ends within a block when the run is
    interrupted. ``path``: the input's path or URL (or its source).

    Raises:
        OSError: the file cannot be read (the caller names it); RemoteStorageError and its
        kin: the store failed (ObjectChangedError: the object is not ``version``).
    """
    h = hashlib.sha256()
    with input_source(path).open(version) as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            if stop is not None and stop.is_set():
                return None
            h.update(block)
    return h.hexdigest()


def _hash_and_cut_lines(source: InputSource, partition_bytes: int,
                        version: str = "") -> Tuple[str, List[Tuple[int, int]]]:
    """sha256 and the cut points ``[(byte offset, line number)]``, from 0 to the file size."""
    h = hashlib.sha256()
    cuts = [(0, 1)]
    offset, newlines, target = 0, 0, partition_bytes
    seeking = False  # looking for the first line start at or after ``target``
    with source.open(version) as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
            pos, counted = 0, 0  # newlines in block[:counted] are already in ``newlines``
            while True:
                if not seeking and offset + len(block) > target:
                    seeking, pos = True, max(pos, target - offset)
                if not seeking:
                    break
                nl = block.find(b"\n", pos)
                if nl < 0:
                    break
                newlines += block.count(b"\n", counted, nl + 1)
                counted = nl + 1
                cut = offset + nl + 1
                cuts.append((cut, newlines + 1))
                seeking, pos = False, nl + 1
                target = cut + partition_bytes
            newlines += block.count(b"\n", counted)
            offset += len(block)
    if cuts[-1][0] != offset:
        cuts.append((offset, newlines + 1))
    return h.hexdigest(), cuts


def _hash_and_cut_array(source: InputSource, partition_bytes: int,
                        version: str = "") -> Tuple[str, List[Tuple[int, int]]]:
    """sha256 and the cut points ``[(byte offset, element number)]`` of a JSON array file."""
    h = hashlib.sha256()

    def blocks():
        with source.open(version) as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
                yield block

    cuts = json_array.cut_points(blocks(), partition_bytes)
    return h.hexdigest(), cuts


def _grouped(sizes: List[Tuple[int, int]], kind: str, file_index: int, partition_bytes: int) -> List[Partition]:
    """Partitions of consecutive groups (row groups, record batches) ``[(rows, bytes)]``, each up to
    ``partition_bytes`` (and at least one group)."""
    parts, start, row, first_row, size = [], 0, 1, 1, 0
    for g, (rows, nbytes) in enumerate(sizes):
        if g > start and size + nbytes > partition_bytes:
            parts.append(Partition(file_index, kind, start, g, first_row))
            start, first_row, size = g, row, 0
        size += nbytes
        row += rows
    if len(sizes) > start:
        parts.append(Partition(file_index, kind, start, len(sizes), first_row))
    return parts


def _arrow_partitions(source: InputSource, file_index: int, partition_bytes: int,
                      version: str = "") -> List[Partition]:
    with source.arrow_file(version) as f:
        sizes = [(b.num_rows, b.nbytes) for _, b in _arrow_reader(f)]
    return _grouped(sizes, "arrow", file_index, partition_bytes)


def _arrow_reader(source, start: int = 0, end: Optional[int] = None) -> Iterator[tuple]:
    """``(g, batch)`` for the record batches ``[start, end)`` (``end`` None: to the last) of an
    Arrow IPC stream (what ``datasets.save_to_disk`` writes: read in order, batch ``end`` never
    read) or file (told by its magic, as a stream reader would take it for a length and read on;
    its batches read by its footer, only those asked for)."""
    import pyarrow as pa   # (an optional, heavy dependency: Arrow inputs only; the source checked it is there)

    magic = source.read(6)
    source.seek(0)
    if magic != b"ARROW1":
        try:
            stream = iter(pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            source.seek(0)
        else:
            g = 0
            while end is None or g < end:
                batch = next(stream, None)
                if batch is None:
                    return
                if g >= start:
                    yield g, batch
                g += 1
            return
    reader = pa.ipc.open_file(source)
    for g in range(start, reader.num_record_batches if end is None else min(end, reader.num_record_batches)):
        yield g, reader.get_batch(g)


def _row_partitions(source: InputSource, file_index: int, partition_bytes: int,
                    version: str = "") -> List[Partition]:
    require_extra("preprocess", "pyarrow")
    import pyarrow.parquet as pq   # (an optional, heavy dependency: Parquet inputs only)

    with source.parquet_file(version) as f:
        meta = pq.ParquetFile(f).metadata
    sizes = [(meta.row_group(g).num_rows, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
    return _grouped(sizes, "rows", file_index, partition_bytes)


# --------------------------------------------------------------------------- reading


def read_batches(path: Union[str, InputSource], part: Partition, batch_size: int, max_record_bytes: int,
                 version: str = "") -> Iterator[list]:
    """Records of one partition of input ``path`` (its path or URL, or its source) as lists of up
    to ``batch_size`` ``(line, raw)`` pairs (``version``: the object version the index read, see
    :meth:`.sources.InputSource.open`).

    ``raw`` is the line's bytes (JSONL; blank lines are skipped but counted), an
    :class:`OversizedRecord` for a line longer than ``max_record_bytes``, or a dict (Parquet).

    Raises:
        OSError, EOFError, ValueError: the file cannot be read or decompressed (the caller names it).
    """
    source = input_source(path)
    if part.kind == "rows":
        yield from _parquet_batches(source, part, batch_size, version)
        return
    if part.kind == "arrow":
        yield from _arrow_batches(source, part, batch_size, version)
        return
    batch: list = []
    with open_text_bytes(source, version, stop=part.end if part.kind in ("lines", "array") else None) as stream:
        if part.kind in ("lines", "array"):
            stream.seek(part.start)
        if part.kind in ("array", "array_stream"):
            records = json_array.read_elements(stream, part.start, part.end, part.first_line, max_record_bytes)
        else:
            limit = part.end - part.start if part.kind == "lines" else -1
            records = _bounded_lines(stream, limit, part.first_line, max_record_bytes)
        for line, raw in records:
            batch.append((line, raw))
            if len(batch) >= batch_size:
                yield batch
                batch = []
    if batch:
        yield batch


def _bounded_lines(stream, limit: int, first_line: int, max_bytes: int) -> Iterator[tuple]:
    """``(line number, bytes | OversizedRecord)`` for every non-blank line, holding at most one
    block plus ``max_bytes`` of it."""
    number = first_line
    pending: List[bytes] = []
    held = 0          # bytes in ``pending``
    skipped = -1      # >= 0 while discarding an oversized line: its bytes so far
    for block in read_blocks(stream, limit):
        pos = 0
        while True:
            nl = block.find(b"\n", pos)
            end = len(block) if nl < 0 else nl + 1
            size = end - pos
            if skipped >= 0:
                skipped += size
            elif held + size > max_bytes:
                skipped, pending, held = held + size, [], 0
            elif nl >= 0 and not pending:
                piece = block[pos:end]
                if piece.strip():
                    yield number, piece
            else:
                pending.append(block[pos:end])
                held += size
            if nl < 0:
                break
            if skipped >= 0:
                yield number, OversizedRecord(skipped)
                skipped = -1
            elif pending:
                line = b"".join(pending)
                pending, held = [], 0
                if line.strip():
                    yield number, line
            number += 1
            pos = nl + 1
    if skipped >= 0:
        yield number, OversizedRecord(skipped)
    elif pending:
        line = b"".join(pending)
        if line.strip():
            yield number, line


def _parquet_batches(source: InputSource, part: Partition, batch_size: int, version: str = "") -> Iterator[list]:
    require_extra("preprocess", "pyarrow")
    import pyarrow.parquet as pq   # (an optional, heavy dependency: Parquet inputs only)

    row = part.first_line
    groups = list(range(part.start, part.end))
    with source.parquet_file(version) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size, row_groups=groups):
            rows = batch.to_pylist()
            yield [(row + i, r) for i, r in enumerate(rows)]
            row += len(rows)


def _arrow_batches(source: InputSource, part: Partition, batch_size: int, version: str = "") -> Iterator[list]:
    if source.ranged:   # an object: a stream's batches before the partition are skipped, not read
        with source.open(version, seeking=True) as f:
            reader = arrow_stream.stream_from(f.raw, part.start)
            if reader is not None:
                yield from _arrow_rows(_numbered(reader, part), part, batch_size)
                return
    with source.arrow_file(version) as f:
        yield from _arrow_rows(_arrow_reader(f, part.start, part.end), part, batch_size)


def _numbered(reader, part: Partition) -> Iterator[tuple]:
    """``(g, batch)`` for batches ``[part.start, part.end)`` of a reader starting at ``part.start``."""
    for g in range(part.start, part.end):
        try:
            yield g, reader.read_next_batch()
        except StopIteration:
            raise ValueError(f"the Arrow stream ends before its record batch {g}") from None


def _arrow_rows(numbered, part: Partition, batch_size: int) -> Iterator[list]:
    """The rows of batches ``[part.start, part.end)`` of ``numbered`` (``(g, batch)`` in order)."""
    row = part.first_line
    for g, batch in numbered:
        if g >= part.end:
            break
        if g < part.start:
            continue
        for lo in range(0, batch.num_rows, batch_size):
            rows = batch.slice(lo, batch_size).to_pylist()
            yield [(row + i, r) for i, r in enumerate(rows)]
            row += len(rows)
