"""The preprocessing pipeline: inputs -> sequence store -> pack plan -> shards -> publish.

Stages, each a step whose units an engine runs (:mod:`.engines`), each unit committed by a
receipt (:mod:`.receipts`), so ``--resume`` continues a killed run from its completed units:

1. *index* (:mod:`.tokenize`, per input file): sha256, size, deterministic partitions;
2. *tokenize* (per partition): records -> the sequence store (:mod:`.store`);
3. *plan* (one unit, lengths only): store -> pack plan (:mod:`.plan`, :mod:`.planfile`);
4. *materialize* (per output shard): plan + store -> staged shards (:mod:`.materialize`);
5. ``--verify-masks`` / ``--check`` on the staged shards, then *publish* (:mod:`.publish`).

Memory of the driver: receipts, plus (local engine, in-process plan) ~16-24 bytes per
conversation for the planner. Same inputs and settings give byte-identical shards whatever
``--workers``, ``--engine``, ``--partition-bytes`` or ``--batch-size``, and whether or not the
run was interrupted and resumed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .._atomic import _alive
from .._extras import MissingExtraError
from .._progress import Progress
from .._units import human_bytes, plural
from ..errors import OutputError, ShardError, ShardExistsError
from ..packing import pad_multiple_for
from . import outputs
from .chat import load_chat_tokenizer, resolve_chat_template
from .encode import EncodeOptions
from .engines import make_engine
from .errors import output_error
from .inputs import expand_inputs
from .pack_stage import PackJob, books, check_outputs, record_outputs, run_pack
from .partitions import DEFAULT_MAX_RECORD_BYTES, DEFAULT_PARTITION_BYTES, Partition, sha256_file
from .plan import PlanSettings, plan_shards, split_conversations  # noqa: F401  (public names)
from ._schema import HEX
from .receipts import ReceiptBook, settings_key
from .remote_outputs import job_output_key, work_prefix
from .._signals import Terminated, committed, signals_deferred, terminate_as_exception
from .store import STORE_FILE, SequenceStore, tokenize_book, write_store_file
from .summary import build_summary
from .tokenize import IndexStep, TokenizeStep
from .workdir import Lock, WorkDir, keep_only_record

log = logging.getLogger("megatron_sft_idx.preprocess")


@dataclass
class Config:
    """Everything the pipeline needs; the CLI fills it from its flags."""

    inputs: Sequence[str]
    output_prefix: str
    tokenizer: Optional[str] = None
    vocab_size: Optional[int] = None
    pack_size: int = 4096
    workers: int = 1
    seed: int = 1234
    algorithm: str = "first_fit_decreasing"
    loss_on: str = "assistant"
    input_format: str = "auto"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    pad_seq_to_mult: int = 1
    pad_layout: str = "stored"  # "runtime" pads for Megatron-Bridge (packing/padding.py)
    cp: int = 1
    tp: int = 1
    sp: bool = False
    pad_id: Optional[int] = None
    overlong: str = "truncate"
    skip_bad: bool = False
    overwrite: bool = False
    split: Optional[Sequence[float]] = None
    max_packs_per_shard: Optional[int] = None
    max_shard_bytes: Optional[int] = None
    batch_size: int = 256
    check: bool = False
    verify_masks: int = 0
    progress: object = True          # a _progress.Progress, or True (bar on a terminal, else log lines) / False
    store: Optional[str] = None
    resume: bool = False
    engine: str = "local"
    ray_address: Optional[str] = None
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    tokenizer_backend: str = "auto"   # the same bytes either way (checked): not in the store's identity
    span_method: str = "auto"
    staging_dir: Optional[str] = None  # an s3:// / msc:// output is built here, then uploaded
    truncated_turn_loss: str = "keep"  # keep | drop: loss on an assistant turn cut by truncation
    chat_template: Optional[str] = None  # a Jinja file, or a name of one of the tokenizer's templates
    prompt_format: str = "chat"          # chat | raw: prompt/completion strings (schemas.py)
    ignore_fields: Sequence[str] = ()    # message fields that carry nothing the model should see
    tool_call_loss: str = "train"        # the loss policies (policy.py)
    reasoning_loss: str = "train"
    empty_reasoning_loss: str = "mask"
    reasoning_tags: Sequence[str] = ("<think>", "</think>")


def resolve_pad_multiple(cfg) -> int:
    """``lcm(--pad-seq-to-mult, multiple for --cp/--tp/--sp)``.

    Raises:
        ShardError: the multiple exceeds the pack size.
    """
    mult = int(np.lcm(max(1, cfg.pad_seq_to_mult), pad_multiple_for(cfg.cp, cfg.tp, cfg.sp)))
    if mult > cfg.pack_size:
        raise ShardError(f"padding multiple {mult} exceeds --pack-size {cfg.pack_size}", field="pack_size")
    return mult


def plan_settings(cfg, mult: int, vocab: Optional[int]) -> PlanSettings:
    return PlanSettings(
        pack_size=cfg.pack_size, pad_multiple=mult, algorithm=cfg.algorithm, seed=cfg.seed,
        split=tuple(cfg.split) if cfg.split else None, overlong=cfg.overlong, skip_bad=cfg.skip_bad,
        max_packs_per_shard=cfg.max_packs_per_shard, max_shard_bytes=cfg.max_shard_bytes,
        itemsize=2 if (vocab or 0) and vocab <= 65536 else 4, pad_layout=cfg.pad_layout,
        truncated_turn_loss=getattr(cfg, "truncated_turn_loss", "keep"))


def check_pad_id(pad_id: Optional[int], vocab: Optional[int]) -> int:
    if pad_id is None or pad_id < 0 or (vocab is not None and pad_id >= vocab):
        raise ShardError("no usable pad id", field="pad_id", actual=pad_id,
                         hint="pass --pad-id in [0, vocab size) (the tokenizer has no pad or EOS token)")
    return pad_id


@dataclass
class Inputs:
    """What the driver resolves once: the input files and the tokenizer's identity."""

    names: List[str]                 # as given (expanded): recorded in metadata and messages
    paths: List[str]                 # absolute: what the workers open
    options: EncodeOptions
    tokenizer: Optional[dict]        # identity without its path, or None
    pad_id: int

    def stat(self) -> list:
        return [[n, os.path.getsize(p), os.stat(p).st_mtime_ns] for n, p in zip(self.names, self.paths)]


def resolve_inputs(cfg: Config) -> Inputs:
    names = expand_inputs(cfg.inputs)
    template = resolve_chat_template(cfg.chat_template, cfg.tokenizer) if cfg.chat_template and cfg.tokenizer else None
    tok = load_chat_tokenizer(cfg.tokenizer, template) if cfg.tokenizer else None
    vocab = cfg.vocab_size or (tok.vocab_size if tok else None)
    pad = cfg.pad_id if cfg.pad_id is not None else (tok.pad_id if tok else None)
    # chat input needs a template: say so before anything else fails (auto: when the run fails anyway;
    # else prompt/completion records, which need none, may still come)
    if tok is not None and tok.chat_template is None and (
            cfg.input_format in ("chat", "sharegpt", "alpaca")
            or (cfg.input_format == "prompt" and cfg.prompt_format == "chat")
            or (cfg.input_format == "auto" and pad is None)):
        _no_template(tok, pad is None)
    pad_id = check_pad_id(pad, vocab)
    options = EncodeOptions(tokenizer_path=tok.path if tok else None, vocab_size=vocab, loss_on=cfg.loss_on,
                            input_format=cfg.input_format, prompt_key=cfg.prompt_key,
                            completion_key=cfg.completion_key, skip_bad=cfg.skip_bad,
                            tokenizer_backend=cfg.tokenizer_backend, span_method=cfg.span_method,
                            chat_template=template, tool_call_loss=cfg.tool_call_loss,
                            reasoning_loss=cfg.reasoning_loss, empty_reasoning_loss=cfg.empty_reasoning_loss,
                            reasoning_tags=tuple(cfg.reasoning_tags), prompt_format=cfg.prompt_format,
                            ignore_fields=tuple(cfg.ignore_fields))
    identity = {k: v for k, v in tok.identity().items() if k != "path"} if tok else None
    return Inputs(names, [os.path.abspath(n) for n in names], options, identity, pad_id)


def _no_template(tok, no_pad: bool) -> None:
    """A bare tokenizer.json: one error naming every flag the run needs (chat template, pad id)."""
    from .chat import TEMPLATE_HINT

    hint = TEMPLATE_HINT + tok.names_hint()
    if no_pad:
        hint += "; it has no pad or EOS token either: also pass --pad-id ID"
    raise ShardError("the tokenizer has no chat template" + (" and no pad or EOS token" if no_pad else ""),
                     path=tok.path, field="chat_template", hint=hint)


# --------------------------------------------------------------------------- the store


def _normal(obj):
    return json.loads(json.dumps(obj, sort_keys=True))


def _index_schema(doc) -> None:
    doc.str("sha256", pattern=HEX[64])
    doc.list("partitions")


def build_store(cfg: Config, inputs: Inputs, engine, directory: str, times: Dict[str, float],
                resumed: Dict[str, int], progress, owned: bool = True) -> SequenceStore:
    """Index the inputs and tokenize every partition not yet in the store at ``directory``.

    Every input is indexed (read and hashed) again, even on ``--resume``: its sha256 proves it
    is the bytes the store was made from. A store made from other bytes is rebuilt when the run
    ``owned`` it (its work directory's), and refused otherwise (``--store``). A partition an
    earlier attempt tokenized is verified (:meth:`SequenceStore.verify`) and tokenized again
    when it does not verify.
    """
    t = time.perf_counter()
    index_key = settings_key({"partition_bytes": cfg.partition_bytes, "inputs": inputs.paths})
    book = ReceiptBook(os.path.join(directory, "receipts"), "index", index_key, directory, _index_schema)
    before = book.completed(range(len(inputs.paths)))
    index: Dict[int, dict] = {}
    step = IndexStep(tuple(inputs.paths), cfg.partition_bytes, book)
    sizes = [size for _, size, _ in inputs.stat()]
    with progress.phase("index", sum(sizes), byte_unit=True) as bar:
        engine.map(step, range(len(inputs.paths)),
                   lambda r: (index.__setitem__(r["unit"], r), bar.update(sizes[r["unit"]])))
    same = [i for i, r in before.items() if (r["sha256"], r["partitions"]) == (index[i]["sha256"], index[i]["partitions"])]
    resumed["index"] = len(same)
    for i in sorted(set(before) - set(same)):
        log.warning("input %s changed since the last attempt (sha256 %s, was %s)", inputs.names[i],
                    index[i]["sha256"][:16], before[i]["sha256"][:16])
    times["index"] = time.perf_counter() - t
    t = time.perf_counter()
    infos = [{"name": n, "sha256": index[i]["sha256"], "bytes": index[i]["bytes"]}
             for i, n in enumerate(inputs.names)]
    parts = [Partition.from_list(p) for i in range(len(infos)) for p in index[i]["partitions"]]
    identity = {"tokenizer": inputs.tokenizer, "encode": inputs.options.to_dict(),
                "max_record_bytes": cfg.max_record_bytes}
    store_id = _describe_store(directory, identity, infos, parts, inputs, owned)
    t_verify = time.perf_counter()
    done = _verified_partitions(directory, store_id)
    times["verify_store"] = time.perf_counter() - t_verify
    resumed["tokenize"] = len(done)
    meta = [_part_metadata(inputs, info, cfg.input_format) for info in infos]
    step = TokenizeStep(directory, store_id, tuple(inputs.paths), tuple(inputs.names), tuple(parts),
                        inputs.options, cfg.batch_size, cfg.max_record_bytes, tuple(meta))
    todo = [k for k in range(len(parts)) if k not in done]
    size, byte_unit = partition_sizes(parts)
    log.info("tokenize: %s to do (%d done before), %s of input", plural(len(todo), "partition"), len(done),
             human_bytes(sum(info["bytes"] for info in infos)))
    reported: Dict[int, int] = {}   # bytes a partition reported before it finished

    def on_progress(unit: int, amount: int) -> None:
        reported[unit] = reported.get(unit, 0) + amount
        bar.update(amount)

    with progress.phase("tokenize", sum(size[k] for k in todo), unit="" if byte_unit else "partitions",
                        byte_unit=byte_unit) as bar:
        engine.map(step, todo, lambda r: bar.update(size[r["unit"]] - reported.get(r["unit"], 0)),
                   on_progress if byte_unit else None)
    times["tokenize"] = time.perf_counter() - t
    return SequenceStore(directory)


def _verified_partitions(directory: str, store_id: str) -> set:
    """Partitions an earlier attempt tokenized whose bytes still verify; the receipt of every
    other one is removed, so it is tokenized again."""
    store = SequenceStore(directory, require_complete=False)
    done = set()
    for k in sorted(store.receipts_present):
        try:
            store.verify([k])
        except ShardError as exc:
            log.warning("store partition %d does not verify; tokenizing it again: %s", k, exc)
            store.book.discard(k)
            continue
        done.add(k)
    return done


def partition_sizes(parts: List[Partition]):
    """Each partition's share of the tokenize phase: its bytes when every partition is a byte range
    of a JSONL file or a JSON array (the common case), else 1 each (compressed streams, Parquet
    row groups, Arrow batches)."""
    if parts and all(p.kind in ("lines", "array") and p.end >= p.start for p in parts):
        return [p.end - p.start for p in parts], True
    return [1] * len(parts), False


def _part_metadata(inputs: Inputs, info: dict, input_format: str) -> dict:
    meta = {"tokenizer": inputs.tokenizer, "source": {"inputs": [info], "input_format": input_format},
            "extra": dict({"loss_on": inputs.options.loss_on}, **encoding_extra(inputs.options.to_dict()))}
    if inputs.tokenizer is None:
        del meta["tokenizer"]
    return meta


def encoding_extra(encode: dict) -> dict:
    """What a shard's ``extra`` records of the encoding beyond ``loss_on``: the loss policy and the
    prompt format, when they differ from the defaults (absent means the defaults, so shards made
    with them keep the bytes of earlier versions)."""
    return {k: encode[k] for k in ("loss_policy", "prompt_format") if k in encode}


def _describe_store(directory: str, identity: dict, infos: List[dict], parts: List[Partition],
                    inputs: Inputs, owned: bool) -> str:
    """Write ``store.json``, or check that an existing one (``--resume``) describes the same store.
    An ``owned`` store (the run's own) that does not, or does not parse, is emptied and started
    again; another is refused.

    Raises:
        ShardError: a ``--store`` made from other inputs or settings (naming what differs).
    """
    path = os.path.join(directory, STORE_FILE)
    if os.path.exists(path):
        try:
            existing = SequenceStore(directory, require_complete=False)
            differs = _store_difference(existing, identity, infos, parts)
        except ShardError as exc:
            if not owned:
                raise
            differs = str(exc)
        if differs is None:
            return existing.store_id
        if not owned:
            raise ShardError(f"the sequence store was made with other {differs}", path=directory,
                             hint="restore them, or give an empty --store (this run cannot reuse that one)")
        log.warning("the run's sequence store was made with other %s; tokenizing again", differs)
        _empty_store(directory)
    return write_store_file(directory, identity, infos, parts, inputs.options.tokenizer_path, inputs.paths)


def _store_difference(existing: SequenceStore, identity: dict, infos: List[dict],
                      parts: List[Partition]) -> Optional[str]:
    """What differs between a store and the one this run would make (None: nothing)."""
    if _normal(identity) != _normal(existing.identity):
        return "tokenizer and encoding settings"
    if len(infos) != len(existing.inputs):
        return "inputs"
    for mine, theirs in zip(infos, existing.inputs):
        if mine["name"] != theirs["name"]:
            return (f"inputs: {mine['name']!r} is named {theirs['name']!r} in the store "
                    f"(shards record inputs by the name given)")
        if _normal(mine) != _normal(theirs):
            return (f"inputs: {mine['name']} is not the file it was made from "
                    f"(sha256 {mine['sha256'][:16]}..., was {str(theirs['sha256'])[:16]}...)")
    if [p.to_list() for p in parts] != [p.to_list() for p in existing.partitions]:
        return "partitions"
    return None


def _empty_store(directory: str) -> None:
    """Remove a run's own store (its description first: what remains is no store)."""
    for name in (STORE_FILE,):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    shutil.rmtree(os.path.join(directory, "parts"), ignore_errors=True)
    shutil.rmtree(os.path.join(directory, "receipts", "tokenize"), ignore_errors=True)


def _user_store(directory: str, resume: bool) -> Lock:
    """Take the lock of a ``--store`` directory; refuse a non-empty one without ``--resume``."""
    if os.path.isdir(directory) and [n for n in os.listdir(directory) if n != "lock"] and not resume:
        raise ShardExistsError("the --store directory is not empty", path=directory,
                               hint="pass --resume to reuse it (only missing partitions are tokenized), "
                                    "pack it again with repack-sft, or choose an empty directory")
    os.makedirs(directory, exist_ok=True)
    lock = Lock(os.path.join(directory, "lock"), f"sequence store {directory}")
    lock.acquire()
    return lock


# --------------------------------------------------------------------------- running


def execute(job: PackJob, run_key: str, resume: bool, engine_kind: str, workers: int,
            ray_address: Optional[str], get_store: Callable, times: Dict[str, float], progress,
            kept_store: Optional[str], prove: Optional[Callable[[dict], None]] = None) -> dict:
    """Everything after the settings are resolved, for preprocess_sft and repack_sft alike:
    the work directory, the engine, ``get_store(engine, work, resumed)``, the pack stages, the
    summary. The work directory stays after an interruption or a filesystem error (for
    ``--resume``) and is removed after a failure no resume can fix. Once every output is
    published the run is committed: its record is written, a signal during the last cleanup no
    longer fails it, and the work directory is reduced to the record, so ``--resume`` of a
    finished run is a no-op (``prove(record)`` raises when what the run read has changed since)."""
    work = WorkDir(work_prefix(job.output_prefix, job.staging_dir))  # a URL's is in the staging directory
    if resume:
        summary = finished_run(work, run_key, prove)
        if summary is not None:
            return summary
    ours = owned_files(work, run_key) if resume else set()
    replaced = outputs.refuse_existing(job.bases, job.overwrite, ours)
    with terminate_as_exception():
        try:
            work.open(resume)
        except OSError as exc:
            raise output_error(exc, resumable=False) from None
        remove, engine = False, None
        try:
            engine = make_engine(engine_kind, workers, ray_address)
            resumed: Dict[str, int] = {}
            store = get_store(engine, work, resumed)
            result = run_pack(store, job, engine, work, run_key, replaced, times, Progress.of(progress), resumed,
                              sorted(ours))
            summary = build_summary(store, job, result, times, workers, engine.describe(), resumed, kept_store)
            books(work, run_key)["done"].write(0, {
                "summary": summary, "outputs": record_outputs(result, result.staged.shards, work),
                "inputs": [{"name": i["name"], "sha256": i["sha256"]} for i in store.inputs]})
            committed()  # (a signal from here on is ignored by the tool, or caught below)
            with signals_deferred():  # committed: finish the cleanup whatever arrives now
                engine.close()
                engine = None
                work.retire()
            return summary
        except OutputError:
            raise
        except (ShardError, MissingExtraError):
            remove = True
            raise
        except (KeyboardInterrupt, Terminated) as exc:
            if work.closed:  # arrived during the committed cleanup (delivered when it ended)
                return summary
            exc.publishing = work.publishing  # the CLI says whether anything reached final names
            raise
        except OSError as exc:
            raise output_error(exc, where=work.parent) from None
        finally:
            if engine is not None:
                engine.close()
            if not work.closed:
                work.close(remove)


def owned_files(work: WorkDir, run_key: str) -> set:
    """Final files an earlier attempt of this run published or meant to (not "existing
    outputs"): its intent, and the outputs of its record if it finished (read for them alone:
    a record whose summary no longer parses still names the run's own outputs)."""
    b = books(work, run_key)
    intent = b["intent"].read(0)
    done = ReceiptBook(work.receipts, "done", run_key, work.path, _outputs_schema).read(0)
    return set(intent["files"] if intent else ()) | set(done["outputs"] if done else ())


def _outputs_schema(doc) -> None:
    doc.mapping("outputs", lambda v, f: v)


def finished_run(work: WorkDir, run_key: str, prove: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
    """The summary of this run if it already finished and nothing changed since: every output
    it published is still there, complete and identical (sizes and CRC-32s), and ``prove``
    accepts the record (the inputs are the bytes it read). ``--resume`` then has nothing to
    do. None otherwise (logged: the run is done again, its outputs replaced as its own)."""
    done = books(work, run_key)["done"].read(0)
    owner = work.lock.owner()
    if done is None or (owner is not None and owner != os.getpid() and _alive(owner)):
        return None
    try:
        check_outputs(done["outputs"])
        if prove is not None:
            prove(done)
    except ShardError as exc:
        log.warning("the finished run cannot be taken as done; running it again: %s", exc)
        return None
    keep_only_record(work.path)   # (leftovers of a cleanup that was cut short)
    return dict(done["summary"], resumed_units={"done": 1})


def prove_inputs(inputs: Inputs, workers: int) -> Callable[[dict], None]:
    """A ``prove`` for :func:`execute`: the inputs are the bytes a finished run read (each
    hashed again, ``workers`` at a time)."""
    def prove(record: dict) -> None:
        recorded = record["inputs"]
        if [r["name"] for r in recorded] != inputs.names:
            raise ShardError("the finished run read other inputs", field="inputs",
                             expected=[r["name"] for r in recorded], actual=inputs.names)
        stop = threading.Event()   # set when the run is interrupted: the threads end within a block
        try:
            with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL
                futures = [pool.submit(sha256_file, path, stop) for path in inputs.paths]
                try:
                    digests = [f.result() for f in futures]
                finally:
                    stop.set()
        except OSError as exc:
            raise ShardError(f"cannot read an input ({exc.strerror or exc})", path=exc.filename) from None
        for name, info, digest in zip(inputs.names, recorded, digests):
            if digest != info["sha256"]:
                raise ShardError("input changed since the run finished", path=name, field="sha256",
                                 expected=info["sha256"], actual=digest)
    return prove


def run(cfg: Config) -> dict:
    """Run the whole pipeline; returns the summary (also what ``--summary-json`` writes).

    Raises:
        ShardError: bad arguments, bad input (InputError, naming file:line), an existing output
            without ``overwrite``, a failed check; OutputError: the filesystem refused a write.
        KeyboardInterrupt, Terminated: interrupted (the work directory is kept for ``--resume``).
    """
    times: Dict[str, float] = {}
    t = time.perf_counter()
    inputs = resolve_inputs(cfg)
    mult = resolve_pad_multiple(cfg)
    vocab = inputs.options.vocab_size
    job = PackJob(cfg.output_prefix, plan_settings(cfg, mult, vocab), inputs.pad_id, vocab,
                  (cfg.cp, cfg.tp, cfg.sp), cfg.overwrite, cfg.check, cfg.verify_masks, inputs.options.tokenizer_path,
                  cfg.staging_dir)
    store_dir = os.path.abspath(cfg.store) if cfg.store else None
    run_key = settings_key({"job": _job_key(job), "tokenizer": inputs.tokenizer, "encode": inputs.options.to_dict(),
                            "inputs": inputs.paths, "partition_bytes": cfg.partition_bytes,
                            "max_record_bytes": cfg.max_record_bytes, "store": store_dir})
    times["inputs"] = time.perf_counter() - t

    def get_store(engine, work: WorkDir, resumed: Dict[str, int]) -> SequenceStore:
        lock = _user_store(store_dir, cfg.resume) if store_dir else None
        try:
            return build_store(cfg, inputs, engine, store_dir or work.store, times, resumed,
                               Progress.of(cfg.progress), owned=store_dir is None)
        finally:
            if lock is not None:
                lock.release()

    return execute(job, run_key, cfg.resume, cfg.engine, cfg.workers, cfg.ray_address, get_store, times,
                   cfg.progress, store_dir, prove_inputs(inputs, cfg.workers))


def _job_key(job: PackJob) -> dict:
    return {"output_prefix": job_output_key(job.output_prefix), "settings": job.settings.to_dict(),
            "pad_id": job.pad_id, "vocab_size": job.vocab_size, "parallelism": list(job.parallelism)}
