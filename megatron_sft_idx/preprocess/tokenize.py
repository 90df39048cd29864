"""Making the sequence store: inputs -> partitions -> tokenized partitions.

:func:`resolve_inputs` resolves, once per run, the input files, the tokenizer and the encoding
(:class:`Inputs`). :class:`IndexStep` (unit: one input file) hashes the file and cuts its
partitions; :class:`TokenizeStep` (unit: one partition) reads the partition's records, encodes
them a batch at a time through :meth:`RecordEncoder.encode_batch`, and writes partition ``k``
of the store (a shard plus its ``.rows``), then its receipt. Both are embarrassingly parallel,
hold one batch in memory, and know nothing of the engine that runs them. Between the two,
:func:`describe_store` writes ``store.json`` (or checks that a resumed store is this one), and
the partitions an earlier attempt tokenized are kept once they verify
(:class:`~.store.VerifyStoreStep`). The driver (:mod:`.driver`) runs them in that order.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .._atomic import write_files_atomically
from .._kernels import segment_sums
from ..builder import IndexedDatasetBuilder
from ..errors import InputError, ObjectChangedError, RemoteStorageError, ShardError
from ..packing import exclusive_cumsum
from ..jsondoc import HEX, normal_json
from .records.chat import check_template_date, load_chat_tokenizer, resolve_chat_template, utc_today
from .config import Config, check_pad_id
from .records.encode import EncodedBatch, EncodeOptions, RecordEncoder, preload
from .engines.base import report_progress
from .records.inputs import expand_inputs
from .records.partitions import Partition, index_file, read_batches
from .records.sources import InputSource, input_source
from .records.tokenizer_source import is_tokenizer_reference, resolve_tokenizer
from .receipts import ReceiptBook
from .files import LOCAL, Files
from .store import (ROW_DTYPE, ROWS_SUFFIX, SKIPS_SUFFIX, STORE_FILE, TRAINED_DTYPE, TRAINED_SUFFIX, SequenceStore,
                    empty_store, encoding_extra, part_prefix, read_store_file, tokenize_book, write_store_file)

log = logging.getLogger("megatron_sft_idx.preprocess")

# --------------------------------------------------------------------------- the inputs, resolved


@dataclass
class Inputs:
    """What the driver resolves once: the input files and the tokenizer's identity."""

    names: List[str]                 # as given (expanded): recorded in metadata and messages
    sources: List[InputSource]       # each input, a local file or an object: told apart once, here
    options: EncodeOptions
    tokenizer: Optional[dict]        # identity without its path, or None
    pad_id: int
    sizes: Optional[List[int]] = None   # bytes of each input, as expansion found them
    left: Tuple[str, ...] = ()          # what the input directories hold and the run does not read

    @property
    def paths(self) -> List[str]:
        """Absolute paths (or the URLs): what the workers open."""
        return [s.path for s in self.sources]

    def stat(self) -> list:
        """``[name, bytes, mtime_ns]`` per input (an object's mtime: 0, its stamp is its ETag; its
        bytes as listed)."""
        sizes = self.sizes or [s.stat()[0] for s in self.sources]
        return [[n, size, s.stamp("").get("mtime_ns", 0)] for n, s, size in zip(self.names, self.sources, sizes)]


def resolve_inputs(cfg: Config, recorded_date: Optional[str] = None) -> Inputs:
    """Expand the inputs, load the tokenizer and its chat template, and fix the encoding options.
    A tokenizer given as a URL or a Hugging Face name is read here, once, and its files travel
    with the encoding options to every task (:mod:`.records.tokenizer_source`).

    A template that reads the clock renders ``--template-date``, else ``recorded_date`` (the date
    the store being continued records, :func:`recorded_template_date`), else today's UTC date.

    Raises:
        ShardError: no input, a tokenizer without the chat template the input needs, no usable pad id.
    """
    tk = cfg.tokenize
    left: List[str] = []
    listed: Dict[str, int] = {}
    names = expand_inputs(cfg.inputs, left, listed)
    if left:   # (what a directory holds that is not input is said, never passed over in silence)
        log.warning("%d file(s) in the input directories are not of a kind the run reads (.jsonl, .json, "
                    ".parquet, .arrow, [.gz|.zst]) and were not read: %s", len(left),
                    ", ".join(left[:20]) + (" ..." if len(left) > 20 else ""))
    template = resolve_chat_template(tk.chat_template, tk.tokenizer) if tk.chat_template and tk.tokenizer else None
    tok = load_chat_tokenizer(tk.tokenizer, template, None, tk.template_args) if tk.tokenizer else None
    date = None
    if tok is not None and tok.reads_clock:  # pinned: the bytes must not depend on the day or the time zone
        date = check_template_date(tk.template_date) if tk.template_date else (recorded_date or utc_today())
        tok = load_chat_tokenizer(tk.tokenizer, template, date, tk.template_args)
    vocab = tk.vocab_size or (tok.vocab_size if tok else None)
    pad = cfg.pack.pad_id if cfg.pack.pad_id is not None else (tok.pad_id if tok else None)
    # chat input needs a template: say so before anything else fails (auto: when the run fails anyway;
    # else prompt/completion records, which need none, may still come)
    if tok is not None and tok.chat_template is None and (
            tk.input_format in ("chat", "sharegpt", "alpaca")
            or (tk.input_format == "prompt" and tk.prompt_format == "chat")
            or (tk.input_format == "auto" and pad is None)):
        _no_template(tok, pad is None)
    pad_id = check_pad_id(pad, vocab)
    if tok is not None and tk.input_format != "tokens":
        tok.require_stop()   # (decided on the template, before anything is tokenized)
    shipped = resolve_tokenizer(tk.tokenizer) if is_tokenizer_reference(tk.tokenizer) else None
    options = tk.encode_options(tokenizer_path=(tk.tokenizer if shipped else tok.path) if tok else None,
                                vocab_size=vocab, skip_bad=cfg.pack.skip_bad, chat_template_text=template,
                                template_date=date, tokenizer_files=shipped)
    identity = {k: v for k, v in tok.identity().items() if k != "path"} if tok else None
    if tok is not None and tk.tokenizer_backend == "auto" and importlib.util.find_spec("gigatoken") is None:
        log.warning("gigatoken is not installed: tokenizing with tokenizers, the same bytes about 8x slower per "
                    "core (docs/PREPROCESSING.md#speed-and-memory); the 'preprocess' extra brings it on Linux "
                    "x86-64, the 'fast' extra elsewhere")
    sizes = [listed[n] if n in listed else os.path.getsize(n) for n in names]
    return Inputs(names, [input_source(n) for n in names], options, identity, pad_id, sizes, tuple(left))


def recorded_template_date(directory: str) -> Optional[str]:
    """The template date the store in ``directory`` records, if there is one that does."""
    path = os.path.join(directory, STORE_FILE)
    if not os.path.exists(path):
        return None
    try:
        return read_store_file(path)["identity"]["encode"].get("template_date")
    except ShardError:  # (a store that does not parse is rebuilt or refused by describe_store)
        return None


def _no_template(tok, no_pad: bool) -> None:
    """A bare tokenizer.json: one error naming every flag the run needs (chat template, pad id)."""
    from .records.chat import TEMPLATE_HINT

    hint = TEMPLATE_HINT + tok.names_hint()
    if no_pad:
        hint += "; it has no pad or EOS token either: also pass --pad-id ID"
    raise ShardError("the tokenizer has no chat template" + (" and no pad or EOS token" if no_pad else ""),
                     path=tok.path, field="chat_template", hint=hint)


# --------------------------------------------------------------------------- the steps


_ENCODERS: Dict[EncodeOptions, RecordEncoder] = {}  # one per process and options: load the tokenizer once


def encoder_for(options: EncodeOptions) -> RecordEncoder:
    """The process's encoder for ``options``, made again when the tokenizer's files changed since
    it was made (the options name the tokenizer by path: a run must not encode with the files an
    earlier run of the process read)."""
    encoder = _ENCODERS.get(options)
    if encoder is not None and encoder.tok is not None and encoder.tok is not load_chat_tokenizer(
            options.tokenizer_directory, options.chat_template_text, options.template_date, options.template_args):
        encoder = None
    if encoder is None:
        _ENCODERS.clear()
        encoder = _ENCODERS[options] = RecordEncoder(options)
    return encoder


@dataclass(frozen=True)
class IndexStep:
    """Unit ``i``: sha256, size and partitions of input file ``i``; the receipt holds them
    (:func:`index_schema`)."""

    paths: Tuple[str, ...]       # absolute paths, read by whichever node runs the unit
    partition_bytes: int
    book: ReceiptBook
    name: str = "index"

    @property
    def writes_to(self) -> str:
        return self.book.directory

    def run(self, unit: int) -> dict:
        try:
            info = index_file(self.paths[unit], unit, self.partition_bytes)
        except ObjectChangedError as exc:
            raise replaced_input(self.paths[unit], exc, "while it was indexed") from None
        except RemoteStorageError:
            raise
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read input ({exc.__class__.__name__}: {exc})", path=self.paths[unit],
                             hint="check the file is complete and its format matches its suffix") from None
        return self.book.write(unit, info)


def index_schema(doc) -> None:
    """The index receipt's own fields: the file's digest and its partitions."""
    doc.str("sha256", pattern=HEX[64])
    doc.list("partitions")


class PartWriter:
    """Partition ``unit`` of the store: its shard (one conversation per pack) and its rows."""

    def __init__(self, directory: str, unit: int, vocab_size: Optional[int], metadata: dict) -> None:
        self.prefix = part_prefix(directory, unit)
        os.makedirs(os.path.dirname(self.prefix), exist_ok=True)
        self.builder = IndexedDatasetBuilder(self.prefix, vocab_size=vocab_size, pack_size=None,
                                             metadata=metadata, overwrite=True)
        self.rows = []
        self.trained = []   # int32 trained positions per conversation (TRAINED_SUFFIX)
        self.tokens = 0
        self.skips: List[str] = []   # "line<TAB>reason" of every skipped record (SKIPS_SUFFIX)

    def add(self, batch: EncodedBatch) -> None:
        ends = exclusive_cumsum(batch.lengths)
        self.builder.add_sequences(batch.ids, batch.loss_mask, batch.lengths)  # one pack per conversation
        rows = np.empty(batch.lengths.size, dtype=ROW_DTYPE)
        rows["line"] = batch.lines
        rows["length"] = batch.lengths
        rows["first_trained"] = first_trained(batch.loss_mask, ends)
        self.rows.append(rows)
        self.trained.append(trained_counts(batch.loss_mask, ends))
        self.tokens += int(ends[-1]) if ends.size else 0
        self.skips.extend(f"{line}\t{reason}\n" for line, reason in batch.skipped_lines)

    def finish(self) -> list:
        """Publish the shard (when it holds anything), then the rows and skips; returns the
        artifact paths. The rows and skips are synced while the shard commits, so the
        partition waits about one sync for its data files, not one per file (issue 45)."""
        rows = np.concatenate(self.rows) if self.rows else np.empty(0, ROW_DTYPE)
        artifacts = []
        if rows.size:
            artifacts = [self.prefix + s for s in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")]
        trained = np.concatenate(self.trained).astype(TRAINED_DTYPE) if self.trained else np.empty(0, TRAINED_DTYPE)
        files = {self.prefix + ROWS_SUFFIX: rows.tobytes(), self.prefix + TRAINED_SUFFIX: trained.tobytes()}
        artifacts.append(self.prefix + TRAINED_SUFFIX)
        if self.skips:
            files[self.prefix + SKIPS_SUFFIX] = "".join(self.skips).encode()
            artifacts.append(self.prefix + SKIPS_SUFFIX)
        write_files_atomically(files, alongside=self.builder.finalize if rows.size else self.builder.abort)
        return artifacts + [self.prefix + ROWS_SUFFIX]

    def abort(self) -> None:
        self.builder.abort()


def trained_counts(mask: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per sequence ``[ends[k], ends[k+1])``: its trained positions (ones in the loss mask), int32:
    what a mixture weighted by trained tokens measures each sequence by, without reading masks."""
    out = np.empty(ends.size - 1, dtype=np.int64)
    segment_sums(np.asarray(mask, dtype=np.uint8), np.asarray(ends, dtype=np.int64), out)
    return out.astype(np.int32)


def first_trained(mask: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per sequence ``[ends[k], ends[k+1])``: the offset of its first trained position (the
    sequence's length when none is), so the planner can tell, from lengths alone, whether a
    sequence cut to T tokens still trains anything (``first_trained < T - 1``)."""
    lengths = np.diff(ends)
    trained = np.flatnonzero(mask)
    if trained.size == 0:
        return lengths.astype(np.int32)
    at = np.minimum(np.searchsorted(trained, ends[:-1]), trained.size - 1)
    first = trained[at] - ends[:-1]
    return np.where((first >= 0) & (first < lengths), first, lengths).astype(np.int32)


@dataclass(frozen=True)
class TokenizeStep:
    """Unit ``k``: tokenize partition ``k`` into the store; the receipt is the commit point."""

    directory: str                     # the store, absolute
    store_id: str
    paths: Tuple[str, ...]             # absolute input paths, for reading
    names: Tuple[str, ...]             # the inputs as given, for messages (file:line)
    partitions: Tuple[Partition, ...]
    options: EncodeOptions
    batch_size: int
    max_record_bytes: int
    shard_metadata: Tuple[dict, ...]   # per input file: metadata of its partitions' shards
    name: str = "tokenize"
    versions: Tuple[str, ...] = ()     # per input: the object version (ETag) the index read, "" if local

    @property
    def writes_to(self) -> str:
        return self.directory

    @property
    def book(self) -> ReceiptBook:
        return tokenize_book(self.directory, self.store_id)

    def prepare(self) -> None:
        """Load the tokenizers once in the process that forks the workers, so they start with them."""
        preload(self.options)
        encoder_for(self.options)

    def run(self, unit: int) -> dict:
        part = self.partitions[unit]
        path, name = self.paths[part.file], self.names[part.file]
        version = self.versions[part.file] if self.versions else ""
        encoder = encoder_for(self.options)
        meta = dict(self.shard_metadata[part.file])
        meta["extra"] = dict(meta.get("extra") or {}, store_id=self.store_id, partition=part.to_list())
        writer = PartWriter(self.directory, unit, self.options.vocab_size, meta)
        started = time.perf_counter()
        records, sequences = 0, 0
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        ignored: Dict[str, int] = {}
        try:
            for batch in _read(path, name, part, self.batch_size, self.max_record_bytes, version):
                records += len(batch)
                encoded = encoder.encode_batch(batch, name)
                if part.kind in ("lines", "array"):  # the driver sized this partition in bytes
                    report_progress(sum(len(raw) for _, raw in batch if isinstance(raw, bytes)))
                writer.add(encoded)
                sequences += int(encoded.lengths.size)
                for reason, count in encoded.skipped.items():
                    skipped[reason] = skipped.get(reason, 0) + count
                for reason, message in encoded.first_skipped.items():
                    first.setdefault(reason, message)
                for key, count in encoded.ignored.items():
                    ignored[key] = ignored.get(key, 0) + count
            artifacts = writer.finish()
        except BaseException:
            writer.abort()
            raise
        body = {"records": records, "sequences": sequences, "tokens": writer.tokens, "skipped": skipped,
                "first_skipped": first, "ignored": dict(sorted(ignored.items())),
                "seconds": round(time.perf_counter() - started, 6)}   # (how busy the workers were)
        pinned = [a for a in artifacts if a.endswith((".seq.idx", ROWS_SUFFIX, TRAINED_SUFFIX))]  # small: verified on reuse
        return self.book.write(unit, body, artifacts, pinned)


def _read(path: str, name: str, part: Partition, batch_size: int, max_record_bytes: int, version: str = ""):
    try:
        yield from read_batches(path, part, batch_size, max_record_bytes, version)
    except InputError:
        raise
    except ObjectChangedError as exc:
        raise replaced_input(name, exc, "after it was indexed") from None
    except RemoteStorageError:
        raise
    except (OSError, EOFError, ValueError) as exc:
        raise InputError(f"cannot read input ({exc.__class__.__name__}: {exc})", path=name,
                         hint="check the file is complete and its compression matches its suffix") from None


def replaced_input(name: str, exc: ObjectChangedError, when: str) -> ObjectChangedError:
    """The error of an input object replaced ``when`` (its ETag changed): never read as a mix of
    two versions, and a rerun indexes it again."""
    return ObjectChangedError(f"input {name} was replaced {when} (its ETag changed): the run would mix two "
                              "versions of it", path=name, field="etag", expected=getattr(exc, "expected", None),
                              actual=getattr(exc, "actual", None),
                              hint="do not rewrite inputs during a run; run again with --resume (the input "
                                   "is indexed again, and partitions of its old bytes are tokenized again)")


# --------------------------------------------------------------------------- the store's description


def partition_sizes(parts: List[Partition]):
    """Each partition's share of the tokenize phase: its bytes when every partition is a byte range
    of a JSONL file or a JSON array (the common case), else 1 each (compressed streams, Parquet
    row groups, Arrow batches)."""
    if parts and all(p.kind in ("lines", "array") and p.end >= p.start for p in parts):
        return [p.end - p.start for p in parts], True
    return [1] * len(parts), False


def part_metadata(inputs: Inputs, info: dict, input_format: str) -> dict:
    """The metadata of the store partitions cut from one input file (``info``: its name, digest, size)."""
    meta = {"tokenizer": inputs.tokenizer, "source": {"inputs": [info], "input_format": input_format},
            "extra": dict({"loss_on": inputs.options.loss_on}, **encoding_extra(inputs.options.to_dict()))}
    if inputs.tokenizer is None:
        del meta["tokenizer"]
    return meta


def describe_store(directory: str, identity: dict, infos: List[dict], parts: List[Partition],
                   inputs: Inputs, owned: bool, overwrite: bool = False, files: Files = LOCAL) -> str:
    """Write ``store.json``, or check that an existing one (``--resume``) describes the same store;
    returns the store id. A store that does not, or does not parse, is emptied and started again
    when nothing else can use it -- the run's own (``owned``), or a ``--store`` an earlier run left
    unfinished (a failed run's: ``repack-sft`` refuses an incomplete store) -- or when
    ``overwrite`` asks for it; a complete ``--store`` is refused.

    Raises:
        ShardError: a complete ``--store`` made from other inputs or settings (naming what
            differs), or one whose ``store.json`` does not parse, without ``overwrite``.
    """
    path = os.path.join(directory, STORE_FILE)
    if os.path.exists(path):
        unfinished = owned or overwrite
        try:
            existing = SequenceStore(directory, require_complete=False, files=files)
            differs = _store_difference(existing, identity, infos, parts)
            unfinished = unfinished or bool(existing.missing)
        except ShardError as exc:
            if not unfinished:
                raise ShardError(f"the --store holds no store this run can read ({exc.message})", path=directory,
                                 hint="pass --overwrite to replace it (every partition is tokenized again), or "
                                      "give an empty --store") from None
            differs = str(exc)
        if differs is None:
            return existing.store_id
        if not unfinished:
            raise ShardError(f"the sequence store is complete and was made with other {differs}", path=directory,
                             hint="restore them, pass --overwrite to replace the store (every partition is "
                                  "tokenized again), or give an empty --store")
        log.warning("the %s sequence store was made with other %s; tokenizing again",
                    "run's" if owned else ("replaced" if overwrite else "unfinished"), differs)
        empty_store(directory)
    return write_store_file(directory, identity, infos, parts, inputs.options.tokenizer_path, inputs.paths)


def _store_difference(existing: SequenceStore, identity: dict, infos: List[dict],
                      parts: List[Partition]) -> Optional[str]:
    """What differs between a store and the one this run would make (None: nothing)."""
    if normal_json(identity) != normal_json(existing.identity):
        mine, theirs = identity["encode"].get("template_date"), existing.identity["encode"].get("template_date")
        if mine != theirs and normal_json(dict(identity["encode"], template_date=None)) \
                == normal_json(dict(existing.identity["encode"], template_date=None)):
            return (f"template date: the chat template reads the clock; the store was rendered with "
                    f"{theirs or 'no recorded date'}, this run renders {mine}"
                    + (f" (pass --template-date {theirs} to continue it)" if theirs else ""))
        return "tokenizer and encoding settings"
    if len(infos) != len(existing.inputs):
        return "inputs"
    for mine, theirs in zip(infos, existing.inputs):
        if mine["name"] != theirs["name"]:
            return (f"inputs: {mine['name']!r} is named {theirs['name']!r} in the store "
                    f"(shards record inputs by the name given)")
        if normal_json(mine) != normal_json(theirs):
            return (f"inputs: {mine['name']} is not the file it was made from "
                    f"(sha256 {mine['sha256'][:16]}..., was {str(theirs['sha256'])[:16]}...)")
    if [p.to_list() for p in parts] != [p.to_list() for p in existing.partitions]:
        return "partitions"
    return None
