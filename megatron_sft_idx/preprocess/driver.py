"""The driver: stage order, resume and commit, for ``preprocess-sft`` and ``repack-sft`` alike.

::

    run(cfg)      inputs -> index -> tokenize -> plan -> materialize -> check -> publish -> record
    repack(cfg)   a kept store, verified  ----> plan -> materialize -> check -> publish -> record
    plan_only()   a kept store, verified  ----> plan (one file, no shards)

Each stage is a step whose units an engine runs (:mod:`.engines`), each unit committed by a
receipt (:mod:`.receipts`), so ``--resume`` continues a killed run from its completed units:

1. *index* (:mod:`.tokenize`, per input file): sha256, size, deterministic partitions;
2. *tokenize* (per partition): records -> the sequence store (:mod:`.store`);
3. *plan* (one unit, lengths only): store -> pack plan (:mod:`.plan`, :mod:`.planfile`);
4. *materialize* (per output shard): plan + store -> staged shards (:mod:`.materialize`);
5. *check*: ``--verify-masks`` / ``--check`` on the staged shards (:mod:`.checks`);
6. *publish* (:mod:`.publish`, to the output's destination, read back after), then the run's *record*.

Resume: every input is hashed again and a resumed unit is used only once what it made verifies
(:func:`.plan.resumed_plan`, :func:`.materialize.resumed_shards`); the rest is done again.
Commit: before any final name is touched, the *intent* receipt names every file the run owns;
after the last one is published, the *done* record (summary, outputs with sizes and CRC-32s,
inputs by digest) makes the run committed, and the work directory is reduced to that record,
so ``--resume`` of a finished run is a no-op while its outputs and inputs are unchanged.

A store or work directory in object storage (:mod:`.workarea`): every engine's units run
mirrored (pull what they read, push what they make, the receipt last), the driver syncs its own
writes and pulls the receipts alone, both areas are locked by objects written conditionally.
What reads the data runs as units whose verdicts the driver collects: the store's verification
(:class:`.store.VerifyStoreStep`), a resumed plan's and shards' (:class:`.plan.VerifyPlanStep`,
:class:`.materialize.VerifyShardStep`), ``--check`` and ``--verify-masks``
(:class:`.checks.GateStep`, :class:`.checks.VerifyMasksStep`); the plan's bug guard runs in the
plan unit; the staged objects are published by server-side copies.

Memory of the driver: receipts, plus (local engine, in-process plan) ~16-24 bytes per
conversation for the planner; with the Ray engine and the work directory in object storage,
receipts only (``bench/driver_memory.py``: flat from 5k to 80k conversations). Same inputs and settings give byte-identical shards whatever
``--workers``, ``--engine``, ``--partition-bytes`` or ``--batch-size``, whichever command wrote
them, and whether or not the run was interrupted and resumed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

from .._atomic import _alive
from .._extras import MissingExtraError
from .._progress import Progress
from .._signals import Terminated, committed, signals_deferred, terminate_as_exception
from .._units import human_bytes, plural
from ..errors import IncompleteDestinationError, OutputError, ShardError
from ..format import PUBLISH_ORDER
from . import outputs
from .balance import BalanceStep, stage_orders
from .checks import GateStep, VerifyMasksStep, checks_schema, run_gate, verify_count, verify_masks
from .config import Config, PackJob, RepackConfig
from .engines import make_engine
from .records.errors import output_error
from .materialize import (MaterializeStep, OutputShard, VerifyShardStep, materialize_schema, output_shards,
                          resumed_shards)
from .records.partitions import Partition, auto_partition_bytes, sha256_file
from .plan import PlanStep, SkipReportStep, VerifyPlanStep, plan_schema, resumed_plan, write_plan
from .publish import StagedSet, StagedShard, publish
from .receipts import ReceiptBook, settings_key
from .done import check_outputs, owned_files, record_outputs, run_books
from ..storage.urls import is_remote, local_only
from ..storage.destination import ObjectDestination, destination_for
from .store import REBUILD_HINT, SequenceStore, VerifyStoreStep, part_prefix
from .summary import PackResult, build_summary, inputs_left, write_skip_report
from .tokenize import (IndexStep, Inputs, TokenizeStep, describe_store, index_schema, lock_user_store,
                       part_metadata, partition_sizes, recorded_template_date, resolve_inputs,
                       verified_partitions)
from .workarea import Area, RunAreas, is_metadata, mirrored_store
from .workdir import RECORD, WorkDir, keep_only_record

log = logging.getLogger("megatron_sft_idx.preprocess")


def run(cfg: Config) -> dict:
    """``preprocess-sft``: the whole pipeline; returns the summary (what ``--json`` prints).

    Raises:
        ShardError: bad arguments, bad input (InputError, naming file:line), an existing output
            without ``overwrite``, a failed check; OutputError: the filesystem refused a write.
        KeyboardInterrupt, Terminated: interrupted (the work directory is kept for ``--resume``).
    """
    times: Dict[str, float] = {}
    t = time.perf_counter()
    inputs = resolve_inputs(cfg)
    job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, inputs.options.vocab_size, inputs.pad_id,
                          inputs.options.tokenizer_path, cfg.balance)
    store_area = Area(cfg.store) if cfg.store and is_remote(cfg.store) else None   # mirrored here
    store_dir = store_area.local if store_area else (os.path.abspath(cfg.store) if cfg.store else None)
    if cfg.tokenize.partition_bytes is None:   # auto: from the inputs' size (resolved once, recorded in the key)
        cfg = replace(cfg, tokenize=replace(cfg.tokenize, partition_bytes=auto_partition_bytes(
            sum(size for _, size, _ in inputs.stat()))))
    if inputs.options.template_date is not None and cfg.tokenize.template_date is None and cfg.run.resume:
        # the store being continued (--store, or the run's own) keeps the date it was rendered with
        areas = RunAreas(job.output_prefix, job.run.engine, job.run.staging_dir, store_area)
        work = areas.work_prefix(destination_for(job.output_prefix).work_prefix(job.output_prefix,
                                                                                job.run.staging_dir))
        for area, rel in ((store_area, "store.json"), (None if store_area else areas.work, "store/store.json")):
            if area is not None:   # (a store in object storage: its description, mirrored here)
                area.pull(rel)
        recorded = recorded_template_date(store_dir or WorkDir(work).store)
        if recorded is not None and recorded != inputs.options.template_date:
            inputs = resolve_inputs(cfg, recorded)
    encode = inputs.options.to_dict()
    if cfg.tokenize.template_date is None:  # a default date is the day the run started, not what the run is:
        encode.pop("template_date", None)   # resumed the next day, it is the same run (its store keeps the date)
    key = settings_key({"job": _job_key(job), "tokenizer": inputs.tokenizer, "encode": encode,
                        "inputs": inputs.paths, "partition_bytes": cfg.tokenize.partition_bytes,
                        "max_record_bytes": cfg.tokenize.max_record_bytes,
                        "store": store_area.url if store_area else store_dir})
    times["inputs"] = time.perf_counter() - t
    stages = _Run(job, key, times, kept_store=store_dir, store_area=store_area)
    summary = stages.finished(prove_inputs(inputs, cfg.run.workers))
    if summary is not None:
        return dict(summary, inputs_left=inputs_left(inputs.left))   # (said on every run)
    with stages.started():
        store = stages.tokenize(cfg, inputs)
        if cfg.tokenize.skip_report:   # (before packing: a temporary store is gone after it)
            write_skip_report(cfg.tokenize.skip_report, stages.skip_report(store))
        stages.pack(store)
    return dict(stages.summary, inputs_left=inputs_left(inputs.left))


def repack(cfg: RepackConfig) -> dict:
    """``repack-sft``: pack the store ``cfg.store`` again; returns the summary (as :func:`run`'s),
    or with ``cfg.plan_only`` that of the plan alone (:func:`plan_only`).

    Raises:
        ShardError: no complete store, bad settings, existing outputs without overwrite, a
            failed check; OutputError: the filesystem refused a write.
        KeyboardInterrupt, Terminated: interrupted (the work directory stays for --resume).
    """
    times: Dict[str, float] = {}
    t = time.perf_counter()
    store_area = Area(cfg.store) if is_remote(cfg.store) else None
    # (a URL's: its metadata mirrored here; --plan-only plans here, from the whole store)
    store = SequenceStore(mirrored_store(cfg.store, None if cfg.plan_only else is_metadata)
                          if store_area else cfg.store)
    job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, store.vocab_size,
                          (store.tokenizer or {}).get("pad_id"), cfg.tokenizer or store.tokenizer_path, cfg.balance)
    if cfg.plan_only:
        return plan_only(store, job, cfg.plan_only)
    key = settings_key({"store_id": store.store_id, "job": _job_key(job)})
    times["inputs"] = time.perf_counter() - t
    stages = _Run(job, key, times, kept_store=store.directory, store_area=store_area)
    summary = stages.finished()
    if summary is not None:
        return summary
    with stages.started():
        stages.pack(stages.verified(store))
    return stages.summary


def plan_only(store: SequenceStore, job: PackJob, path: str) -> dict:
    """Write only the pack plan of ``store`` to the local file ``path`` (for virtual packs);
    returns its summary.

    Raises:
        ShardError: ``path`` is a URL, the store does not verify; OutputError: the write failed.
    """
    if local_only([("--plan-only", path)]):
        raise ShardError("--plan-only writes a local file", path=path, field="plan_only",
                         hint="give a local path (VirtualPackedDataset reads the plan and the store locally)")
    t = time.perf_counter()
    try:
        store.verify()   # a plan is made from the rows, and it is served from the tokens
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        meta = write_plan(store, job.settings, path)
    except OSError as exc:
        raise output_error(exc, resumable=False) from None
    return {"plan": path, "conversations": meta["conversations"], "truncated": meta["truncated"],
            "splits": {s["name"]: {k: v for k, v in s.items() if k not in ("arrays", "name")}
                       for s in meta["splits"]},
            "empty_splits": meta["empty_splits"], "seconds": {"plan": round(time.perf_counter() - t, 3)}}


def _job_key(job: PackJob) -> dict:
    """What of the job the run key digests (the settings as the plan records them, resolved)."""
    key = {"output_prefix": destination_for(job.output_prefix).normal(job.output_prefix),
           "settings": job.settings.to_dict(),
           "pad_id": job.pad_id, "vocab_size": job.vocab_size, "parallelism": list(job.parallelism)}
    if job.balance.to_dict() is not None:   # (keys of runs without --balance-for are unchanged)
        key["balance"] = job.balance.to_dict()
    return key


def prove_inputs(inputs: Inputs, workers: int) -> Callable[[dict], None]:
    """A ``prove`` for :meth:`_Run.finished`: the inputs are the bytes a finished run read (each
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


# --------------------------------------------------------------------------- one run


class _Run:
    """One run of the stages: its job, work directory, engine, receipts, times and resumed units.

    :meth:`finished` first (``--resume`` of a finished run), then, inside :meth:`started`, the
    store (:meth:`tokenize` or :meth:`verified`) and :meth:`pack`, which ends with the commit;
    :attr:`summary` is the run's summary once committed.
    """

    def __init__(self, job: PackJob, key: str, times: Dict[str, float], kept_store: Optional[str],
                 store_area: Optional[Area] = None) -> None:
        self.job, self.key, self.times, self.kept_store = job, key, times, kept_store
        self.destination = destination_for(job.output_prefix)
        self.areas = RunAreas(job.output_prefix, job.run.engine, job.run.staging_dir, store_area)
        if self.areas.work is not None:   # staged shards are published by server-side copies
            self.destination = ObjectDestination(copies=self.areas.work.object_of)
        self.work = WorkDir(self.areas.work_prefix(self.destination.work_prefix(job.output_prefix,
                                                                                 job.run.staging_dir)))
        self.progress = Progress.of(job.run.progress)
        self.resumed: Dict[str, int] = {}
        self.engine = None
        self.owned: List[str] = []       # final files an earlier attempt of this run published
        self.replaced: List[str] = []    # existing outputs --overwrite replaces
        self.summary: Optional[dict] = None
        self.orders_not_written: Dict[str, str] = {}   # split -> why (--balance-for: stage_orders)

    def finished(self, prove: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
        """With ``--resume``, the summary of this run if it already finished and nothing changed
        since: every output it published is still there, complete and identical (sizes and
        CRC-32s), and ``prove`` accepts the record (the inputs are the bytes it read). None
        otherwise (logged: the run is done again, its outputs replaced as its own)."""
        if not self.job.run.resume:
            return None
        if self.areas.busy():   # (a work directory in the bucket that a run holds: not finished)
            return None
        done = run_books(self.work, self.key)["done"].read(0)
        owner = self.work.lock.owner()
        if done is None or (owner is not None and owner != os.getpid() and _alive(owner)):
            return None
        try:
            check_outputs(done["outputs"], self.destination)
            if prove is not None:
                prove(done)
        except ShardError as exc:
            log.warning("the finished run cannot be taken as done; running it again: %s", exc)
            return None
        keep_only_record(self.work.path)   # (leftovers of a cleanup that was cut short)
        return dict(done["summary"], resumed_units={"done": 1})

    @contextlib.contextmanager
    def started(self):
        """Refuse existing outputs, open the work directory and the engine for the stages.

        The work directory stays after an interruption or a filesystem error (for ``--resume``)
        and is removed after a failure no resume can fix. An interruption during the committed
        cleanup is no failure: it ends the block with :attr:`summary` set.

        Raises:
            ShardExistsError: an output exists without ``overwrite``; OutputError: a write was
                refused; KeyboardInterrupt, Terminated (``publishing`` says whether anything
                reached a final name); whatever a stage raises.
        """
        work, settings = self.work, self.job.run
        self.areas.open(settings.resume)   # (in the bucket: its lock, naming a run that holds it)
        self.owned = sorted(owned_files(work, self.key)) if settings.resume else []
        self.replaced = outputs.refuse_existing(self.job.bases, settings.overwrite, self.destination, set(self.owned))
        with terminate_as_exception():
            try:
                work.open(settings.resume)
            except OSError as exc:
                raise output_error(exc, resumable=False) from None
            remove = False
            try:
                t = time.perf_counter()
                self.engine = make_engine(settings.engine, settings.workers, settings.ray_address)
                if self.engine.name == "ray":  # joining or starting the cluster: seconds, part of the run
                    self.times["ray_start"] = time.perf_counter() - t
                self.engine = self.areas.engine(self.engine, own_store=self.kept_store is None)
                yield self
            except (OutputError, IncompleteDestinationError):
                raise
            except (ShardError, MissingExtraError):
                remove = True
                raise
            except (KeyboardInterrupt, Terminated) as exc:
                if work.closed:  # arrived during the committed cleanup (delivered when it ended)
                    return
                exc.publishing = work.publishing  # the CLI says whether anything reached final names
                raise
            except OSError as exc:
                raise output_error(exc, where=work.parent) from None
            finally:
                if self.engine is not None:
                    self.engine.close()
                if not work.closed:
                    work.close(remove)
                self.areas.release()

    # ------------------------------------------------------------------ the store

    def tokenize(self, cfg: Config, inputs: Inputs) -> SequenceStore:
        """Index the inputs and tokenize every partition not yet in the store: the run's own, or
        the ``--store`` directory (``kept_store``, locked meanwhile)."""
        if self.areas.store is not None:
            lock = self.areas.lock_store(self.job.run.resume, self.job.run.overwrite)
        else:
            lock = lock_user_store(self.kept_store, self.job.run.resume, self.job.run.overwrite) \
                if self.kept_store else None
        try:
            directory = self.kept_store or self.work.store
            index = self._index(inputs, cfg.tokenize.partition_bytes, directory)
            return self._tokenize(cfg, inputs, index, directory)
        finally:
            if lock is not None:
                lock.release()

    def _index(self, inputs: Inputs, partition_bytes: int, directory: str) -> Dict[int, dict]:
        """Every input indexed (read and hashed) again, even on ``--resume``: its sha256 proves it
        is the bytes the store was made from. ``{input: index receipt}``."""
        t = time.perf_counter()
        index_key = settings_key({"partition_bytes": partition_bytes, "inputs": inputs.paths})
        book = ReceiptBook(os.path.join(directory, "receipts"), "index", index_key, directory, index_schema)
        before = book.completed(range(len(inputs.paths)))
        index: Dict[int, dict] = {}
        step = IndexStep(tuple(inputs.paths), partition_bytes, book)
        sizes = [size for _, size, _ in inputs.stat()]
        with self.progress.phase("index", sum(sizes), byte_unit=True) as bar:
            self.engine.map(step, range(len(inputs.paths)),
                            lambda r: (index.__setitem__(r["unit"], r), bar.update(sizes[r["unit"]])))
        same = [i for i, r in before.items()
                if (r["sha256"], r["partitions"]) == (index[i]["sha256"], index[i]["partitions"])]
        self.resumed["index"] = len(same)
        for i in sorted(set(before) - set(same)):
            log.warning("input %s changed since the last attempt (sha256 %s, was %s)", inputs.names[i],
                        index[i]["sha256"][:16], before[i]["sha256"][:16])
        self.times["index"] = time.perf_counter() - t
        return index

    def _tokenize(self, cfg: Config, inputs: Inputs, index: Dict[int, dict], directory: str) -> SequenceStore:
        """Describe the store (a store made from other bytes is rebuilt when the run owns it,
        refused otherwise), keep the partitions an earlier attempt tokenized that verify, and
        tokenize the others."""
        t = time.perf_counter()
        tk = cfg.tokenize
        infos = [{"name": n, "sha256": index[i]["sha256"], "bytes": index[i]["bytes"]}
                 for i, n in enumerate(inputs.names)]
        parts = [Partition.from_list(p) for i in range(len(infos)) for p in index[i]["partitions"]]
        identity = {"tokenizer": inputs.tokenizer, "encode": inputs.options.to_dict(),
                    "max_record_bytes": tk.max_record_bytes}
        store_id = describe_store(directory, identity, infos, parts, inputs, owned=self.kept_store is None,
                                  overwrite=self.job.run.overwrite)
        t_verify = time.perf_counter()
        done = self._verified_partitions(directory)
        self.times["verify_store"] = time.perf_counter() - t_verify
        self.resumed["tokenize"] = len(done)
        meta = tuple(part_metadata(inputs, info, tk.input_format) for info in infos)
        step = TokenizeStep(directory, store_id, tuple(inputs.paths), tuple(inputs.names), tuple(parts),
                            inputs.options, tk.batch_size, tk.max_record_bytes, meta,
                            versions=tuple(index[i].get("etag", "") for i in range(len(infos))))
        todo = [k for k in range(len(parts)) if k not in done]
        size, byte_unit = partition_sizes(parts)
        log.info("tokenize: %s to do (%d done before), %s of input", plural(len(todo), "partition"), len(done),
                 human_bytes(sum(info["bytes"] for info in infos)))
        reported: Dict[int, int] = {}   # bytes a partition reported before it finished

        def on_progress(unit: int, amount: int) -> None:
            reported[unit] = reported.get(unit, 0) + amount
            bar.update(amount)

        with self.progress.phase("tokenize", sum(size[k] for k in todo), unit="" if byte_unit else "partitions",
                                 byte_unit=byte_unit) as bar:
            self.engine.map(step, todo, lambda r: bar.update(size[r["unit"]] - reported.get(r["unit"], 0)),
                            on_progress if byte_unit else None)
        self.times["tokenize"] = time.perf_counter() - t
        return SequenceStore(directory)

    def verified(self, store: SequenceStore) -> SequenceStore:
        """A kept store, every partition's checksums verified once before any pack is made from it
        (in the tasks, one per partition, when it is in object storage).

        Raises:
            ShardError: the first partition that does not verify, naming it."""
        t = time.perf_counter()
        if not self.areas.all:
            store.verify()
        else:
            problems = self._verdicts(VerifyStoreStep(store.directory), range(len(store.partitions)))
            if problems:
                k = min(problems)
                raise ShardError(f"store partition {k} does not verify: {problems[k]}",
                                 path=part_prefix(store.directory, k), hint=REBUILD_HINT)
        self.times["verify_store"] = time.perf_counter() - t
        return store

    def _verified_partitions(self, directory: str) -> set:
        """:func:`.tokenize.verified_partitions`, in the tasks (one per partition) when the store
        or the work directory is in object storage: the driver reads their verdicts."""
        if not self.areas.all:
            return verified_partitions(directory)
        store = SequenceStore(directory, require_complete=False)
        present = store.receipts_present
        problems = self._verdicts(VerifyStoreStep(directory), present)
        for k in sorted(problems):
            log.warning("store partition %d does not verify; tokenizing it again: %s", k, problems[k])
            store.book.discard(k)
        return set(present) - set(problems)

    def skip_report(self, store: SequenceStore) -> List[str]:
        """``--skip-report``'s lines (:class:`.plan.SkipReportStep`: the tokenize stage's skips and
        the plan's drops by its rule), made by the engine as every one-unit step is (with the
        store in object storage the task pulls the partitions' ``.skips`` and ``.rows``; the
        driver gets the lines alone)."""
        got: List[List[str]] = []
        self.engine.map(SkipReportStep(store.directory, self.job.settings), [0], lambda r: got.append(r["lines"]))
        return got[0]

    def _verdicts(self, step, units) -> Dict[int, str]:
        """``{unit: why}`` of the units of a checking ``step`` that found a problem (run by the engine)."""
        units, out = list(units), {}
        if units:
            self.engine.map(step, units, lambda r: out.__setitem__(r["unit"], r["problem"]))
        return {u: why for u, why in out.items() if why}

    # ------------------------------------------------------------------ the pack stages

    def pack(self, store: SequenceStore) -> None:
        """Plan (one unit), materialize (one unit per output shard), check, publish, commit.

        Units with a valid receipt (``--resume``) are not run again, once what they made
        verifies: the plan file (pinned CRC-32, its receipt, every array against the store) and
        each shard, staged or already published (every checksum, its metadata against its
        receipt); what does not verify is done again.

        Raises:
            ShardError: see the steps; the gate or --verify-masks rejected the output.
        """
        books = _stage_books(self.work, self.key, store.store_id, self.job)
        plan = self._plan(store, books["plan"])
        shards = output_shards(store, self.job, plan, self.work.staged)
        done, published, todo = self._materialize(store, plan, shards, books)
        staged = _staged_set(shards, plan, self.job)
        result = PackResult(plan, [done[u] for u in range(len(shards))], manifests=[p for p, _ in staged.manifests],
                            times=self.times, resumed=self.resumed, engine=self.engine.describe(),
                            kept_store=self.areas.store.url if self.areas.store else self.kept_store)
        moved = published if self.destination.moves else set()   # (where a publish moves the staged files)
        located = [replace(s, staged=s.final) if u in moved else s for u, s in enumerate(shards)]
        checked = books["checks"].read(0)
        if checked is None:  # (a resumed publish has passed them already, and moved the staged files)
            checked = books["checks"].write(0, self._check(store, located))
        elif todo and self.job.run.check:  # units done again after the checks passed: the same gate on them
            self._gate([shards[u].staged for u in todo])
        result.verify, result.gate = checked["verify"], checked["gate"]
        staged = self._balance(staged, shards, located)
        result.orders = [o.final for o in staged.orders]
        result.orders_not_written = dict(self.orders_not_written)
        written = self._publish(staged, published, books)
        self._commit(store, build_summary(store, self.job, result), staged, result.shards, written)

    def _plan(self, store: SequenceStore, book: ReceiptBook) -> dict:
        """The plan receipt: an earlier attempt's when its plan verifies, else a new plan's."""
        t = time.perf_counter()
        verdict = None
        if self.areas.all:   # (checked in a task, which pulls the plan and the store's rows)
            verdict = lambda receipt: self._verdicts(   # noqa: E731
                VerifyPlanStep(book, self.work.plan, store.directory, self.job.settings), [0]).get(0, "")
        plan = resumed_plan(book, self.work.plan, store, self.job.settings, verdict)
        self.resumed["plan"] = int(plan is not None)
        if plan is None:
            step = PlanStep(store.directory, self.job.settings, self.work.plan, book)
            validated: List[float] = []   # the plan's bug guard, run by the plan unit

            def on_done(receipt: dict) -> None:
                validated.append(receipt.get("validate_seconds", 0.0))
                bar.update(store.sequence_count)

            with self.progress.phase("plan", store.sequence_count, unit="conversations") as bar:
                self.engine.map(step, [0], on_done)
            plan = book.read(0)
            self.times["verify_plan"] = sum(validated)
            self.times["plan"] = time.perf_counter() - t - self.times["verify_plan"]
        else:
            self.times["plan"] = time.perf_counter() - t             # (verifying the resumed plan)
        log.info("plan: %s kept of %s, %s truncated, %s in %s", f"{plan['conversations']:,}",
                 f"{store.sequence_count:,}", f"{plan['truncated']:,}",
                 plural(sum(sp["packs"] for sp in plan["splits"]), "pack"),
                 plural(sum(sp["shards"] for sp in plan["splits"]), "shard"))
        return plan

    def _materialize(self, store: SequenceStore, plan: dict, shards: List[OutputShard],
                     books: Dict[str, ReceiptBook]):
        """``({unit: materialize receipt} of every shard, {units published before}, [units written now])``."""
        t = time.perf_counter()
        verdicts = None
        if self.areas.work is not None:   # (checked in the tasks, each pulling the plan and its shard)
            verdicts = lambda units: self._verdicts(   # noqa: E731
                VerifyShardStep(books, tuple(shards), self.work.plan, self.work.path), units)
        done, published = resumed_shards(books, shards, self.work.plan, self.work.path,
                                         not self.destination.moves, verdicts)   # (an upload leaves them staged)
        if done:
            self.times["verify_shards"] = time.perf_counter() - t
            t = time.perf_counter()
        self.resumed["materialize"] = len(done)
        step = MaterializeStep(store.directory, self.work.plan, tuple(shards), self.job.pad_id, self.job.vocab_size,
                               books["materialize"])
        todo = [u for u in range(len(shards)) if u not in done]
        total = sum(sp["packs"] for sp in plan["splits"]) - sum(r["packs"] for r in done.values())
        with self.progress.phase("write", total, unit="packs") as bar:
            def on_done(receipt: dict) -> None:
                done[receipt["unit"]] = receipt
                bar.update(receipt["packs"])

            self.engine.map(step, todo, on_done)
        self.times["materialize"] = time.perf_counter() - t
        return done, published, todo

    def _check(self, store: SequenceStore, shards: Sequence[OutputShard]) -> dict:
        """``--verify-masks`` and ``--check`` on the staged shards; raises when either fails."""
        out = {"verify": None, "gate": None}
        job, times = self.job, self.times
        count = verify_count(job, store)   # --check also checks a sample against the source
        if count:
            t = time.perf_counter()
            with self.progress.phase("verify-masks", count, unit="conversations") as bar:
                if self.areas.work is None:
                    out["verify"] = verify_masks(store, self.work.plan, shards, job, count)
                else:   # (in a task, which pulls what the sample reads)
                    got: List[dict] = []
                    self.engine.map(VerifyMasksStep(store.directory, self.work.plan, tuple(shards), job, count), [0],
                                    lambda r: got.append(r["verify"]))
                    out["verify"] = got[0]
                bar.update(out["verify"]["checked"])
            if not job.run.verify_masks:
                out["verify"]["sample_of_check"] = True
            times["verify_masks"] = time.perf_counter() - t
        if job.run.check:
            t = time.perf_counter()
            with self.progress.phase("check", len(shards), unit="shards") as bar:
                out["gate"] = self._gate([s.staged for s in shards], on_shard=lambda: bar.update(1))
            times["check"] = time.perf_counter() - t
        return out

    def _gate(self, prefixes: Sequence[str], on_shard=None) -> dict:
        """:func:`.checks.run_gate` on the staged shards ``prefixes``: here, or in the tasks (one
        per shard, each pulling its shard) when the work directory is in object storage."""
        if self.areas.work is None:
            return run_gate(prefixes, on_shard=on_shard)
        self.engine.map(GateStep(tuple(prefixes)), range(len(prefixes)), lambda r: on_shard and on_shard())
        return {"passed": True, "shards": len(prefixes)}

    def _balance(self, staged: StagedSet, shards: Sequence[OutputShard], located: Sequence[OutputShard]) -> StagedSet:
        """The staged set with its balanced orders (``--balance-for``), planned again on every
        attempt: derived data, the same bytes from the same packs."""
        if self.job.balance.balance_for is None:
            return staged
        t = time.perf_counter()
        if self.areas.work is None:
            orders, self.orders_not_written = stage_orders(self.job, shards, located, staged.manifests)
        else:   # (in a task, which pulls the staged shards: the driver gets the orders)
            got: List[dict] = []
            self.engine.map(BalanceStep(self.job, tuple(shards), tuple(located), tuple(staged.manifests)), [0],
                            got.append)
            orders, self.orders_not_written = got[0]["orders"], got[0]["not_written"]
        self.times["balance"] = time.perf_counter() - t
        for split, why in self.orders_not_written.items():
            log.warning("balance: no order for split %s: %s", split, why)
        for o in orders:
            before, after = o.order.stats["shuffle"], o.order.stats["balanced"]
            log.info("balance: %s for %s, predicted straggler overhead %.2f %% -> %.2f %% (mean)", o.final,
                     o.order.topology.describe(), 100 * before["mean"], 100 * after["mean"])
        return replace(staged, orders=tuple(orders))

    def _publish(self, staged: StagedSet, published: set, books: Dict[str, ReceiptBook]) -> Dict[str, bytes]:
        """Record the intent (every file the run owns, before any final name is touched: a resumed
        publish may replace them), then publish the set; files an earlier attempt published that
        this one does not write again are removed with the replaced outputs."""
        t = time.perf_counter()
        self.resumed["publish"] = len(published)
        finals = ({s.final + x for s in staged.shards for x in PUBLISH_ORDER} | {path for path, _ in staged.manifests}
                  | {o.final for o in staged.orders})
        books["intent"].write(0, {"files": sorted(finals | set(self.owned))})
        self.areas.sync()   # (the intent is in the bucket before any final name is touched)
        normal = self.destination.normal
        ours = {normal(p) for p in finals}
        mine = {normal(p) for p in self.owned}
        stale = [p for p in outputs.existing_outputs(self.job.bases, self.destination) if normal(p) in mine - ours]
        self.work.publishing = True
        if self.areas.work is not None:   # from the staged objects, copied server-side: never through here
            staged = replace(staged, shards=tuple(replace(s, staged=str(self.areas.work.url_of(self.areas.work.rel(s.staged))))
                                                  for s in staged.shards))
        with self.progress.phase("publish", len(staged.shards), unit="shards") as bar:
            written = publish(staged, list(self.replaced) + stale, books["publish"], self.destination,
                              on_shard=lambda: bar.update(1))
        self.areas.sync()
        self.times["publish"] = time.perf_counter() - t
        return written

    def _commit(self, store: SequenceStore, summary: dict, staged: StagedSet, receipts: List[dict],
                written: Dict[str, bytes]) -> None:
        """Write the run's record; from here on a signal no longer fails the run, and the work
        directory is reduced to the record whatever arrives."""
        run_books(self.work, self.key)["done"].write(0, {
            "summary": summary, "outputs": record_outputs(staged, receipts, self.work, written),
            "inputs": [{"name": i["name"], "sha256": i["sha256"]} for i in store.inputs]})
        self.areas.sync()   # (the record is in the bucket before the rest of the work directory goes)
        self.summary = summary
        committed()  # (a signal from here on is ignored by the tool, or caught by started())
        with signals_deferred():  # committed: finish the cleanup whatever arrives now
            self.engine.close()
            self.engine = None
            self.work.retire()
            self.areas.keep_only_record(RECORD.replace(os.sep, "/"))


def _staged_set(shards: Sequence[OutputShard], plan: dict, job: PackJob) -> StagedSet:
    """The set to publish; with more than one output shard, one manifest per split."""
    manifests = []
    if len(shards) > 1:
        by_name = dict(zip(job.settings.split_names, job.bases))
        for i, split in enumerate(plan["splits"]):
            finals = tuple(s.final for s in shards if s.split == i)
            manifests.append((outputs.manifest_path(by_name[split["name"]]), finals))
    return StagedSet(tuple(StagedShard(s.staged, s.final) for s in shards), tuple(manifests))


# --------------------------------------------------------------------------- the stages' receipts


def _publish_schema(doc) -> None:
    doc.str("final")


def _stage_books(work: WorkDir, key: str, store_id: str, job: PackJob) -> Dict[str, ReceiptBook]:
    """The receipts of the pack stages, the run's own besides. ``plan``, ``materialize`` and
    ``publish`` belong also to the store they were made from (a store rebuilt because an input
    changed redoes them), and ``checks`` to which checks run."""
    stage_key = settings_key([key, store_id])
    out = run_books(work, key)
    for name, schema in (("plan", plan_schema), ("materialize", materialize_schema), ("publish", _publish_schema)):
        out[name] = ReceiptBook(work.receipts, name, stage_key, work.path, schema)
    out["checks"] = ReceiptBook(work.receipts, "checks", settings_key([stage_key, job.run.check, job.run.verify_masks]),
                                work.path, checks_schema)
    return out


__all__ = ["run", "repack", "plan_only", "prove_inputs"]
