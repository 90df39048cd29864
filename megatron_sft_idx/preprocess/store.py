"""The sequence store: every conversation tokenized once, unpacked, in input order.

Layout of a store directory ``S`` (``docs/STORE.md`` is the specification)::

    S/store.json                        identity, inputs (name, sha256, bytes), partitions
    S/parts/part_NNNNNN.{bin,idx,loss.bin,seq.idx,seq.bin}
                                        partition NNNNNN as a shard of this project's format
                                        with pack_size null: one "pack" per conversation,
                                        seq_start_id [0], label-aligned loss mask
    S/parts/part_NNNNNN.rows            ROW_DTYPE per conversation, same order
    S/receipts/index/NNNNNN.json        per input file: sha256, size, mtime, partitions
    S/receipts/tokenize/NNNNNN.json     per partition: counts, skips; the commit point
    S/lock                              pid of the process writing the store

Sequence ``g`` of the store is conversation ``g - starts[k]`` of the partition ``k`` with
``starts[k] <= g < starts[k+1]`` (``starts``: cumulative sequence counts by partition).
A partition whose records were all skipped has no shard, an empty ``.rows`` and a receipt.
The store is complete when every partition has a valid receipt; only a complete store is
planned from. Nothing in it depends on the pack size, padding, split or algorithm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .._atomic import remove_tree, write_file_atomically
from .._kernels import segment_sums
from ..errors import InvariantError, MetadataError, ShardError
from ..format import PUBLISH_ORDER
from ..reader import MMapIndexedDataset
from ..jsondoc import HEX, Doc, load_json
from ..storage.mirror import Mirror
from ..storage.urls import is_remote
from .files import LOCAL, Files, commit_rank
from .integrity import verify_shard
from .records.partitions import Partition, check_cover
from .receipts import ReceiptBook, settings_key

STORE_FORMAT = "megatron_sft_idx.store"
STORE_VERSION = [1, 0]
STORE_FILE = "store.json"
ROWS_SUFFIX = ".rows"
#: a partition's skipped records, one ``line<TAB>reason`` per line (written only when it skipped any)
SKIPS_SUFFIX = ".skips"
#: One record per conversation in ``part_NNNNNN.rows`` (little-endian, 16 bytes).
ROW_DTYPE = np.dtype([("line", "<i8"), ("length", "<i4"), ("first_trained", "<i4")])
#: What to do about a store whose bytes no longer verify.
REBUILD_HINT = ("the sequence store changed after it was written; rerun the preprocess-sft command that made it "
                "with --store DIR --resume (it tokenizes again every partition that does not verify)")


#: a partition's trained positions per conversation (int32, the rows' order): what a mixture weighted
#: by trained tokens measures (absent in stores made before mixtures: then read from the loss mask)
TRAINED_SUFFIX = ".trained"
TRAINED_DTYPE = np.dtype("<i4")

#: Every file of a store partition: its shard's, its rows, its trained counts, its skipped records.
PART_SUFFIXES = PUBLISH_ORDER + (ROWS_SUFFIX, TRAINED_SUFFIX, SKIPS_SUFFIX)


def part_prefix(directory: str, unit: int) -> str:
    return os.path.join(directory, "parts", f"part_{unit:06d}")


def rows_paths(directory: str) -> List[str]:
    """The ``.rows`` of every partition ``store.json`` in ``directory`` describes."""
    body = read_store_file(os.path.join(directory, STORE_FILE))
    return [part_prefix(directory, k) + ROWS_SUFFIX for k in range(len(body["partitions"]))]


def _content(body: dict) -> dict:
    """The keys of ``store.json`` the store id is the digest of."""
    return {k: body[k] for k in ("format", "version", "identity", "inputs", "partitions")}


def content_id(body: dict) -> str:
    """The digest of what a store holds, not of where its inputs were found: ``store_id``'s keys
    with each input's ``name`` left out (its bytes and sha256 stay). What a mixture's draws are
    seeded by, so the same data gives the same mixture wherever it lies."""
    inputs = [{k: v for k, v in item.items() if k != "name"} for item in body["inputs"]]
    return settings_key(dict(_content(body), inputs=inputs))


def empty_store(directory: str) -> None:
    """Remove a run's own store (its description first: what remains is no store)."""
    for name in (STORE_FILE,):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    remove_tree(os.path.join(directory, "parts"), directory)
    remove_tree(os.path.join(directory, "receipts", "tokenize"), directory)


def write_store_file(directory: str, identity: dict, inputs: List[dict], partitions: List[Partition],
                     tokenizer_path: Optional[str], input_paths: List[str]) -> str:
    """Write ``store.json`` (atomically); returns the store id, a digest of everything that
    determines the store's content (not of where the tokenizer was found)."""
    body = {"format": STORE_FORMAT, "version": STORE_VERSION, "identity": identity, "inputs": inputs,
            "partitions": [p.to_list() for p in partitions]}
    body["store_id"] = settings_key(body)
    body["tokenizer_path"] = tokenizer_path  # where things were found, not what the store holds
    body["input_paths"] = input_paths
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    os.makedirs(directory, exist_ok=True)
    write_file_atomically(os.path.join(directory, STORE_FILE), lambda f: f.write(data))
    return body["store_id"]


def read_store_file(path: str) -> dict:
    """``store.json`` parsed as strictly as a shard header: every key the tools read, its type and
    range, the partitions against the inputs, and the store id against the content it digests.

    Raises:
        ShardError: missing (the hint says what to give), unreadable, another format or major
            version, or malformed (MetadataError naming the file and the field).
    """
    try:
        body = load_json(path)
    except FileNotFoundError:
        raise ShardError("no sequence store here (store.json is missing)", path=path,
                         hint="give the --store directory of a preprocess_sft run") from None
    except OSError as exc:
        raise ShardError(f"cannot read the store description ({exc.strerror or exc})", path=path) from None
    doc = Doc(body, path)
    if body.get("format") != STORE_FORMAT:
        raise MetadataError("not a megatron_sft_idx sequence store", path=path, field="format",
                            expected=STORE_FORMAT, actual=body.get("format"))
    version = body.get("version")
    if not isinstance(version, list) or not version or version[0] != STORE_VERSION[0]:
        raise ShardError(f"unsupported store version {version}; supported major: {STORE_VERSION[0]}",
                         path=path, field="version", hint="rebuild the store with this version")
    doc.list("version", length=2)
    _check_identity(doc.doc("identity"))
    inputs = doc.docs("inputs")
    for info in inputs:
        info.str("name")
        info.str("sha256", pattern=HEX[64])
        info.int("bytes", lo=0)
    parts = [Partition.from_list(p, path, f"partitions[{k}]") for k, p in enumerate(doc.list("partitions"))]
    check_cover(parts, [i.obj["name"] for i in inputs], [i.obj["bytes"] for i in inputs], path)
    store_id = doc.str("store_id", pattern=HEX[32])
    if settings_key(_content(body)) != store_id:
        raise MetadataError("store.json was edited: its store_id is not the digest of its content", path=path,
                            field="store_id", expected=settings_key(_content(body)), actual=store_id,
                            hint="restore it, or rebuild the store")
    doc.str("tokenizer_path", none=True)
    paths = doc.list("input_paths", none=True) or []
    for k, item in enumerate(paths):
        if not isinstance(item, str):
            raise MetadataError("must be a string", path=path, field=f"input_paths[{k}]", actual=item)
    if paths and len(paths) != len(inputs):
        raise MetadataError("one path per input", path=path, field="input_paths", expected=len(inputs),
                            actual=len(paths))
    return body


def _check_identity(identity: Doc) -> None:
    """The identity keys the tools read (others, e.g. new encode options, only enter the store id)."""
    tokenizer = identity.doc("tokenizer", none=True)
    if tokenizer is not None:
        tokenizer.int("pad_id", lo=0, default=None)
        tokenizer.int("vocab_size", lo=1, default=None)
        tokenizer.str("files_sha256", default=None)
    encode = identity.doc("encode")
    encode.int("vocab_size", lo=1, hi=1 << 31, none=True)
    encode.str("loss_on")
    encode.str("input_format")
    encode.str("template_date", pattern=re.compile(r"\d{4}-\d{2}-\d{2}"), default=None)
    identity.int("max_record_bytes", lo=1)


def _tokenize_schema(doc: Doc) -> None:
    """A tokenize receipt: the counts the planner and the summary read, and the rows it commits."""
    records = doc.int("records", lo=0)
    sequences = doc.int("sequences", lo=0)
    if sequences and not records:
        raise doc.fail("sequences without records", "sequences", actual=sequences)
    doc.int("tokens", lo=sequences)
    doc.ints("skipped", lo=0)
    doc.strs("first_skipped")
    doc.ints("ignored", lo=0, default={})   # (absent in stores made before record-level accounting)
    seconds = doc.raw("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise doc.fail("must be a number of seconds >= 0", "seconds", actual=seconds)
    rows = os.path.relpath(part_prefix("", doc.obj["unit"]) + ROWS_SUFFIX)
    if rows not in doc.obj["artifacts"]:
        raise doc.fail("the receipt does not commit the partition's rows", "artifacts", expected=rows)
    if doc.obj["artifacts"][rows] != ROW_DTYPE.itemsize * sequences:
        raise doc.fail("the rows' size disagrees with the sequence count", "artifacts",
                       expected=ROW_DTYPE.itemsize * sequences, actual=doc.obj["artifacts"][rows])
    trained = os.path.relpath(part_prefix("", doc.obj["unit"]) + TRAINED_SUFFIX)
    if trained in doc.obj["artifacts"] and doc.obj["artifacts"][trained] != TRAINED_DTYPE.itemsize * sequences:
        raise doc.fail("the trained counts' size disagrees with the sequence count", "artifacts",
                       expected=TRAINED_DTYPE.itemsize * sequences, actual=doc.obj["artifacts"][trained])


def tokenize_book(directory: str, store_id: str, files: Files = LOCAL) -> ReceiptBook:
    return ReceiptBook(os.path.join(directory, "receipts"), "tokenize", store_id, directory, _tokenize_schema, files)


def mirrored_store(mirror: Mirror, only: Optional[Callable[[str], bool]] = None) -> str:
    """The local tree of ``mirror`` (a store in object storage), pulled now (whole, or the
    objects ``only`` keeps): a reader that opens a store by URL (plan-batches, virtual packs),
    or a run packing a kept store; every partition is verified by its reader before use.

    Raises:
        ShardError: no ``store.json`` under the mirror's URL."""
    if not mirror.listing(STORE_FILE):
        raise ShardError("no sequence store here (store.json is missing)", path=mirror.url + "/" + STORE_FILE,
                         hint="give the --store URL of a preprocess-sft run")
    mirror.pull(only=only)
    return mirror.local


@contextlib.contextmanager
def read_once(stores: Iterable[Optional[str]]):
    """A one-shot reader of ``stores`` (``plan-batches --dynamic --store``, ``--plan-only``): this
    node's mirror of each URL among them is held while the block runs and removed when it ends
    without an exception, as a run's are (a reader that keeps reading, virtual packs, keeps its
    mirror). Directories and None are left alone."""
    mirrors = [Mirror(s, commit_rank) for s in stores if s and is_remote(s)]
    with contextlib.ExitStack() as held:
        for mirror in mirrors:
            held.enter_context(mirror.in_use())
        yield
    for mirror in mirrors:
        mirror.remove_if_unused()


class SequenceStore:
    """A store opened for reading (planning, materializing, virtual packs). ``directory`` may be
    an ``s3://`` / ``msc://`` URL: the store is then mirrored on this node's disk first
    (:func:`mirrored_store`) and read there, every partition verified as a local one.

    ``store.json`` and every receipt (or, with ``units``, those partitions' alone) are parsed
    strictly at open; the partitions' bytes are verified by :meth:`verify` (once per run, by
    whoever makes new data from them). ``files``: how the store's files are seen (a mirror
    that holds only some of them: :mod:`.files`).

    Raises:
        ShardError: no store here, an unknown format version, a malformed ``store.json``
            (naming the field), or (``require_complete``) partitions without a valid receipt.
    """

    def __init__(self, directory: str, *, require_complete: bool = True, units: Optional[Iterable[int]] = None,
                 files: Files = LOCAL) -> None:
        if is_remote(directory):   # a store in object storage: its mirror on this node, pulled now
            directory = mirrored_store(Mirror(directory, commit_rank))
        self.directory = os.path.abspath(directory)
        self.body = body = read_store_file(os.path.join(self.directory, STORE_FILE))
        self.store_id: str = body["store_id"]
        self.content_id: str = content_id(body)
        self.identity: dict = body["identity"]
        self.inputs: List[dict] = body["inputs"]
        self.partitions = [Partition.from_list(p) for p in body["partitions"]]
        self.files = files
        self.book = tokenize_book(self.directory, self.store_id, files)
        wanted = range(len(self.partitions)) if units is None else [k for k in units if 0 <= k < len(self.partitions)]
        self._receipts: Dict[int, dict] = self.book.completed(wanted)
        if require_complete:
            self.require_complete()
        self._parts: Dict[int, Optional[MMapIndexedDataset]] = {}
        self.verified: set = set()   # partitions whose bytes this object has verified

    # ------------------------------------------------------------------ completeness

    @property
    def missing(self) -> List[int]:
        return [k for k in range(len(self.partitions)) if k not in self._receipts]

    def require_complete(self) -> None:
        missing = self.missing
        if missing:
            why = self.book.rejected.get(missing[0])
            raise ShardError(f"the sequence store is incomplete: {len(missing)} of {len(self.partitions)} "
                             f"partitions have no valid receipt (e.g. {missing[0]}"
                             f"{': ' + why if why else ''})", path=self.directory,
                             hint="finish it with the same preprocess_sft command plus --resume")

    @property
    def receipts_present(self) -> List[int]:
        """Partitions with a valid receipt (all of them once the store is complete)."""
        return sorted(self._receipts)

    @property
    def receipts(self) -> List[dict]:
        return [self._receipts[k] for k in range(len(self.partitions))]

    def counts(self) -> np.ndarray:
        """Conversations per partition (int64)."""
        return np.array([r["sequences"] for r in self.receipts], dtype=np.int64)

    def starts(self) -> np.ndarray:
        """First store sequence of each partition, plus the total (int64[K+1])."""
        return np.concatenate(([0], np.cumsum(self.counts()))).astype(np.int64)

    @property
    def sequence_count(self) -> int:
        return int(self.counts().sum())

    # ------------------------------------------------------------------ data

    def rows(self, unit: int) -> np.ndarray:
        """The ROW_DTYPE records of partition ``unit``.

        Raises:
            ShardError: the file is missing or its size disagrees with the receipt.
        """
        path = part_prefix(self.directory, unit) + ROWS_SUFFIX
        expected = self._receipts[unit]["sequences"]
        try:
            rows = np.fromfile(path, dtype=ROW_DTYPE)
        except OSError as exc:
            raise ShardError(f"cannot read store rows ({exc.strerror})", path=path) from None
        if rows.size != expected:
            raise ShardError("store rows disagree with the partition's receipt", path=path, field="rows",
                             expected=expected, actual=rows.size, hint="rebuild the store")
        return rows

    def has_trained(self, unit: int) -> bool:
        """Whether partition ``unit``'s receipt commits its trained counts (stores made before
        mixtures do not: :meth:`trained` then reads the loss mask)."""
        rel = os.path.relpath(part_prefix(self.directory, unit) + TRAINED_SUFFIX, self.directory)
        return rel in self._receipts[unit]["artifacts"]

    def trained(self, unit: int) -> np.ndarray:
        """Trained positions of every conversation of partition ``unit`` (int32, the rows' order):
        its ``.trained`` file, or counted from its loss mask where the store has none.

        Raises:
            ShardError: the file is missing or of another size than the receipt says.
        """
        expected = self._receipts[unit]["sequences"]
        if not self.has_trained(unit):
            ds = self.part(unit)
            if ds is None:
                return np.empty(0, dtype=TRAINED_DTYPE)
            out = np.empty(expected, dtype=np.int64)
            ends = np.concatenate(([0], np.cumsum(np.asarray(ds.sequence_lengths, dtype=np.int64))))
            segment_sums(ds.arrays().loss_mask, ends, out)
            ds.release_pages()
            return out.astype(TRAINED_DTYPE)
        path = part_prefix(self.directory, unit) + TRAINED_SUFFIX
        try:
            trained = np.fromfile(path, dtype=TRAINED_DTYPE)
        except OSError as exc:
            raise ShardError(f"cannot read the store's trained counts ({exc.strerror})", path=path) from None
        if trained.size != expected:
            raise ShardError("store trained counts disagree with the partition's receipt", path=path, field="trained",
                             expected=expected, actual=trained.size, hint=REBUILD_HINT)
        return trained

    def part_prefix(self, unit: int) -> str:
        """Where partition ``unit``'s files are (their prefix)."""
        return part_prefix(self.directory, unit)

    def skips(self, unit: int) -> List[Tuple[int, str]]:
        """``(line, reason)`` of every record partition ``unit`` skipped, in input order.

        Raises:
            ShardError: the receipt commits a skips file that is missing, of another size, or malformed.
        """
        receipt = self._receipts[unit]
        path = part_prefix(self.directory, unit) + SKIPS_SUFFIX
        size = receipt["artifacts"].get(os.path.relpath(path, self.directory))
        if size is None:
            return []
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
        except OSError as exc:
            raise ShardError(f"cannot read the partition's skipped records ({exc.strerror})", path=path,
                             hint="rebuild the store") from None
        out = []
        for n, item in enumerate(data.decode("utf-8", "replace").splitlines() if len(data) == size else [None]):
            line, _, reason = (item or "").partition("\t")
            if not line.isdigit() or not reason.replace("_", "").isalnum():
                raise ShardError("the partition's skipped records are malformed", path=path, field=f"line {n + 1}",
                                 hint="rebuild the store")
            out.append((int(line), reason))
        if sum(receipt["skipped"].values()) != len(out):
            raise ShardError("the partition's skipped records disagree with its receipt's count", path=path,
                             expected=sum(receipt["skipped"].values()), actual=len(out), hint="rebuild the store")
        return out

    def part(self, unit: int) -> Optional[MMapIndexedDataset]:
        """Partition ``unit`` as a mapped shard (opened once per process), None when empty."""
        if unit not in self._parts:
            self._parts[unit] = (MMapIndexedDataset(part_prefix(self.directory, unit))
                                 if self._receipts[unit]["sequences"] else None)
        return self._parts[unit]

    # ------------------------------------------------------------------ verification

    def verify(self, units=None) -> None:
        """Verify the bytes of partitions ``units`` (default: all with a receipt), each once per
        object: the CRC-32s their receipt pins (``.seq.idx``, ``.rows``), every checksum of the
        partition's shard, and the partition against its receipt and ``store.json`` (sequence
        and token counts, one sequence per pack, lengths equal to the rows', the store id and
        partition in its metadata). Reads each file once, in blocks.

        Raises:
            ShardError: the first partition that does not verify (ChecksumError, InvariantError,
                ...), naming its file; the hint says how to rebuild it.
        """
        for k in sorted(self._receipts if units is None else units):
            if k not in self.verified:
                self._verify_part(k)
                self.verified.add(k)

    def _verify_part(self, k: int) -> None:
        receipt, part = self._receipts[k], self.partitions[k]
        prefix = part_prefix(self.directory, k)
        self.book.verify(receipt, REBUILD_HINT)
        rows = self.rows(k)
        lines = rows["line"]

        def wrong(what: str, field: str, path: str = prefix + ROWS_SUFFIX, **kw) -> InvariantError:
            return InvariantError(f"store partition {k}: {what}", path=path, field=field, hint=REBUILD_HINT, **kw)

        if rows.size and (lines[0] < part.first_line or (np.diff(lines) < 0).any()):
            raise wrong("row lines must rise from the partition's first line", "line", expected=part.first_line)
        if rows.size and ((rows["length"] < 1).any() or (rows["first_trained"] < 0).any()
                          or (rows["first_trained"] > rows["length"]).any()):
            raise wrong("row lengths must be >= 1 and first_trained within them", "length/first_trained")
        if not rows.size:
            return
        ds = verify_shard(prefix, REBUILD_HINT)
        header = ds.seq_header
        if (len(ds), header.sequence_count, header.token_count) != (rows.size, rows.size, receipt["tokens"]):
            raise wrong("its shard disagrees with its receipt (one conversation per pack)", "pack_count",
                        path=prefix + ".seq.idx", expected=(rows.size, rows.size, receipt["tokens"]),
                        actual=(len(ds), header.sequence_count, header.token_count))
        if not np.array_equal(ds.sequence_lengths, rows["length"]):
            raise wrong("row lengths differ from its shard's sequence lengths", "length")
        if self.has_trained(k):
            trained = self.trained(k)
            if ((trained < 0).any() or (trained > rows["length"]).any()
                    or int(trained.sum()) != ds.metadata.stats.loss_token_count):
                raise wrong("its trained counts disagree with its shard's loss mask", "trained",
                            path=prefix + TRAINED_SUFFIX, expected=ds.metadata.stats.loss_token_count,
                            actual=int(trained.sum()))
        extra = ds.metadata.extra
        if extra.get("store_id") != self.store_id or extra.get("partition") != part.to_list():
            raise wrong("its shard belongs to another store or partition", "extra.store_id/partition",
                        path=prefix + ".seq.idx", expected=[self.store_id, part.to_list()],
                        actual=[extra.get("store_id"), extra.get("partition")])

    @property
    def vocab_size(self) -> Optional[int]:
        return self.identity["encode"]["vocab_size"]

    @property
    def tokenizer(self) -> Optional[dict]:
        """The tokenizer identity as shards record it (no local path), or None."""
        return self.identity.get("tokenizer")

    def input_path(self, file: int) -> str:
        """Where input ``file`` was read from (absolute), for re-reading a record."""
        paths = self.body.get("input_paths") or []
        return paths[file] if file < len(paths) else self.inputs[file]["name"]

    @property
    def tokenizer_path(self) -> Optional[str]:
        """Where the tokenizer was when the store was written (for --verify-masks)."""
        return self.body.get("tokenizer_path")

    def __getstate__(self):
        return {"directory": self.directory, "files": self.files}

    def __setstate__(self, state) -> None:
        self.__init__(state["directory"], files=state.get("files", LOCAL))


#: Partitions one unit of :class:`VerifyStoreStep` verifies (its fixed cost, opening the store,
#: paid once per this many).
VERIFY_CHUNK = 16


def verify_chunks(units: Iterable[int], size: int = VERIFY_CHUNK) -> Tuple[Tuple[int, ...], ...]:
    """``units`` (sorted) in consecutive chunks of ``size``: the units of a :class:`VerifyStoreStep`."""
    units = sorted(units)
    return tuple(tuple(units[i:i + size]) for i in range(0, len(units), size))


@dataclass(frozen=True)
class VerifyStoreStep:
    """Unit ``u``: :meth:`SequenceStore.verify` of the partitions ``chunks[u]``, each on its own,
    where the unit runs (a store in object storage: the task pulls those partitions alone, the
    driver gets the verdicts). Returns ``{"unit": u, "problems": {partition: why}}`` of the
    partitions that do not verify (the error's text)."""

    directory: str
    chunks: Tuple[Tuple[int, ...], ...]
    files: Files = LOCAL
    name: str = "verify-store"

    @property
    def writes_to(self) -> str:
        return self.directory

    def reads(self, unit: int) -> List[str]:
        return [part_prefix(self.directory, k) + suffix for k in self.chunks[unit] for suffix in PART_SUFFIXES]

    def run(self, unit: int) -> dict:
        mine = self.chunks[unit]
        store = SequenceStore(self.directory, require_complete=False, units=mine, files=self.files)
        problems = {}
        for k in mine:
            try:
                if k not in store.receipts_present:
                    raise ShardError(f"store partition {k} has no valid receipt", path=part_prefix(self.directory, k))
                store.verify([k])
            except ShardError as exc:
                problems[k] = str(exc)
        return {"unit": unit, "problems": problems}


def encoding_extra(encode: dict) -> dict:
    """What a shard's ``extra`` records of the store's encoding beyond ``loss_on``: the loss policy
    and the prompt format, when they differ from the defaults (absent means the defaults, so shards
    made with them keep the bytes of earlier versions), and the date a template that reads the
    clock rendered (absent for every other template), and the template's switches (``--template-arg``,
    absent when none was given)."""
    return {k: encode[k] for k in ("loss_policy", "prompt_format", "template_date", "template_args", "prompt_only")
            if k in encode}
