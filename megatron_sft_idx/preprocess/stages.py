"""One run of the stages in its workspace (:class:`Stages`): what :mod:`.driver` drives.

The driver decides what a run is (its configuration, inputs, job and key; a mixture's sources)
and calls, in order: :meth:`Stages.finished` (``--resume`` of a finished run), then inside
:meth:`Stages.started` the store (:meth:`Stages.tokenize`, or :meth:`Stages.verified` of a kept
one) and :meth:`Stages.pack` (plan, materialize, check, balance, publish, commit). Each stage is a
step whose units the run's engine runs, each unit committed by a receipt; the module docstring
of :mod:`.driver` states the order, resume and commit rules.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

from .._extras import MissingExtraError
from .._progress import Progress
from .._signals import Terminated, committed, signals_deferred, terminate_as_exception
from .._units import human_bytes, plural
from ..errors import IncompleteDestinationError, OutputError, ShardError
from ..format import PUBLISH_ORDER
from . import outputs
from .balance import BalanceStep
from .checks import GateStep, VerifyMasksStep, checks_schema, verify_count
from .config import Config, PackJob
from .done import check_outputs, owned_files, record_outputs, run_books
from .engines import make_engine
from .files import Files
from .materialize import MaterializeStep, OutputShard, VerifyShardStep, materialize_schema, output_shards, resumed_shards
from .mixplan import MixPlanStep
from .plan import PlanStep, VerifyPlanStep, plan_schema, resumed_plan
from .publish import StagedSet, StagedShard, publish
from .receipts import ReceiptBook, settings_key
from .records.errors import output_error
from .records.partitions import Partition
from .skips import SkipReportStep
from .store import REBUILD_HINT, SequenceStore, VerifyStoreStep, part_prefix, verify_chunks
from .stores import store_argument
from .summary import PackResult, build_summary
from .tokenize import IndexStep, Inputs, TokenizeStep, describe_store, index_schema, part_metadata, partition_sizes
from .workdir import keep_only_record
from .workspace import Workspace

log = logging.getLogger("megatron_sft_idx.preprocess")


class Stages:
    """One run of the stages in its workspace: its job, engine, receipts, times and resumed units.

    :meth:`finished` first (``--resume`` of a finished run), then, inside :meth:`started`, the
    store (:meth:`tokenize` or :meth:`verified`) and :meth:`pack`, which ends with the commit;
    :attr:`summary` is the run's summary once committed.
    """

    def __init__(self, job: PackJob, key: str, times: Dict[str, float], ws: Workspace) -> None:
        self.job, self.key, self.times, self.ws = job, key, times, ws
        self.work, self.destination, self.files = ws.work, ws.destination, ws.files
        self.progress = Progress.of(job.run.progress)
        self.resumed: Dict[str, int] = {}
        self.engine = None
        self.owned: List[str] = []       # final files an earlier attempt of this run published
        self.replaced: List[str] = []    # existing outputs --overwrite replaces
        self.summary: Optional[dict] = None
        self.orders_not_written: Dict[str, str] = {}   # split -> why (--balance-for: BalanceStep)
        self.windows: Dict[str, dict] = {}   # a mixture's split -> its window report (BalanceStep)

    def finished(self, prove: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
        """With ``--resume``, the summary of this run if it already finished and nothing changed
        since: every output it published is still there, complete and identical (sizes and
        CRC-32s), and ``prove`` accepts the record (the inputs are the bytes it read). None
        otherwise (logged: the run is done again, its outputs replaced as its own)."""
        if not self.job.run.resume or self.ws.busy():   # (a run holding the work directory: not finished)
            return None
        done = run_books(self.work, self.key)["done"].read(0)
        if done is None:
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
        self.ws.claim(settings.resume)   # (what a run of this work holds: refused, naming a live holder)
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
                self.engine = self.ws.engine(self.engine)
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
                self.ws.release()

    def _verdicts(self, step, units) -> Dict[int, str]:
        """``{unit: why}`` of the units of a checking ``step`` that found a problem (run by the engine)."""
        units, out = list(units), {}
        if units:
            self.engine.map(step, units, lambda r: out.__setitem__(r["unit"], r["problem"]))
        return {u: why for u, why in out.items() if why}

    def _one(self, step) -> dict:
        """The result of the one-unit ``step`` (run by the engine: here, or in a task)."""
        got: List[dict] = []
        self.engine.map(step, [0], got.append)
        return got[0]

    # ------------------------------------------------------------------ the store

    def tokenize(self, cfg: Config, inputs: Inputs, index: int = 0, resume: Optional[bool] = None) -> SequenceStore:
        """Index the inputs and tokenize every partition not yet in the store: the run's own, or
        the ``--store`` (locked meanwhile); ``index``: which of a mixture's stores, continued
        (``resume``) whatever the run's ``--resume`` says: a store already made from these inputs
        is used as it is, once it verifies."""
        resume = self.job.run.resume if resume is None else resume
        lock = self.ws.take_store(resume, self.job.run.overwrite, index)
        try:
            directory = self.ws.store_dirs[index]
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
        book = ReceiptBook(os.path.join(directory, "receipts"), "index", index_key, directory, index_schema,
                           self.files)
        before = book.completed(range(len(inputs.paths)))
        index: Dict[int, dict] = {}
        step = IndexStep(tuple(inputs.paths), partition_bytes, book)
        sizes = [size for _, size, _ in inputs.stat()]
        with self.progress.phase("index", sum(sizes), byte_unit=True) as bar:
            self.engine.map(step, range(len(inputs.paths)),
                            lambda r: (index.__setitem__(r["unit"], r), bar.update(sizes[r["unit"]])))
        same = [i for i, r in before.items()
                if (r["sha256"], r["partitions"]) == (index[i]["sha256"], index[i]["partitions"])]
        self.resumed["index"] = self.resumed.get("index", 0) + len(same)   # (a mixture: every store)
        for i in sorted(set(before) - set(same)):
            log.warning("input %s changed since the last attempt (sha256 %s, was %s)", inputs.names[i],
                        index[i]["sha256"][:16], before[i]["sha256"][:16])
        self.times["index"] = self.times.get("index", 0.0) + time.perf_counter() - t
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
        store_id = describe_store(directory, identity, infos, parts, inputs, owned=self.ws.own_store,
                                  overwrite=self.job.run.overwrite, files=self.files)
        t_verify = time.perf_counter()
        done = self._verified_partitions(directory)
        self.times["verify_store"] = self.times.get("verify_store", 0.0) + time.perf_counter() - t_verify
        self.resumed["tokenize"] = self.resumed.get("tokenize", 0) + len(done)
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
        self.times["tokenize"] = self.times.get("tokenize", 0.0) + time.perf_counter() - t
        return SequenceStore(directory, files=self.files)

    def _store_problems(self, directory: str, partitions) -> Dict[int, str]:
        """``{partition: why}`` of the ``partitions`` of the store in ``directory`` that do not
        verify (:class:`.store.VerifyStoreStep`, a chunk of partitions a unit)."""
        step = VerifyStoreStep(directory, verify_chunks(partitions), self.files)
        problems: Dict[int, str] = {}
        if step.chunks:
            self.engine.map(step, range(len(step.chunks)), lambda r: problems.update(r["problems"]))
        return problems

    def verified(self, store: SequenceStore) -> SequenceStore:
        """A kept store, every partition's checksums verified once before any pack is made from it.

        Raises:
            ShardError: the first partition that does not verify, naming it."""
        t = time.perf_counter()
        problems = self._store_problems(store.directory, range(len(store.partitions)))
        if problems:
            k = min(problems)
            raise ShardError(f"store partition {k} does not verify: {problems[k]}",
                             path=part_prefix(store.directory, k), hint=REBUILD_HINT)
        self.times["verify_store"] = self.times.get("verify_store", 0.0) + time.perf_counter() - t
        return store

    def _verified_partitions(self, directory: str) -> set:
        """Partitions an earlier attempt tokenized whose bytes still verify; the receipt of every
        other one is removed, so it is tokenized again."""
        store = SequenceStore(directory, require_complete=False, files=self.files)
        present = store.receipts_present
        problems = self._store_problems(directory, present)
        for k in sorted(problems):
            log.warning("store partition %d does not verify; tokenizing it again: %s", k, problems[k])
            store.book.discard(k)
        return set(present) - set(problems)

    def skip_report(self, store: SequenceStore) -> List[str]:
        """``--skip-report``'s lines (:class:`.skips.SkipReportStep`: the tokenize stage's skips and
        the plan's drops by its rule)."""
        return self._one(SkipReportStep(store.directory, self.job.settings, self.files))["lines"]

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
        books = _stage_books(self.work, self.key, store.store_id, self.job, self.files)
        plan = self._plan(store, books["plan"])
        shards = output_shards(store, self.job, plan, self.work.staged)
        done, published, todo = self._materialize(store, plan, shards, books)
        staged = _staged_set(shards, plan, self.job)
        result = PackResult(plan, [done[u] for u in range(len(shards))], manifests=[p for p, _ in staged.manifests],
                            times=self.times, resumed=self.resumed, engine=self.engine.describe(),
                            kept_store=self.ws.kept_store if self.job.mixture is None else None)
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
        result.windows = dict(self.windows)
        written = self._publish(staged, published, books)
        self._commit(store, build_summary(store, self.job, result), staged, result.shards, written)

    def _plan(self, store: SequenceStore, book: ReceiptBook) -> dict:
        """The plan receipt: an earlier attempt's when its plan verifies, else a new plan's."""
        t = time.perf_counter()
        store_dir, names = store_argument(store)
        check = VerifyPlanStep(book, self.work.plan, store_dir, self.job.settings, self.files, names=names)
        plan = resumed_plan(book, lambda: self._verdicts(check, [0]).get(0, ""))
        self.resumed["plan"] = int(plan is not None)
        if plan is None:
            if self.job.mixture is None:
                step = PlanStep(store.directory, self.job.settings, self.work.plan, book, self.files)
            else:
                step = MixPlanStep(store_dir, names, self.job.mixture, self.job.settings, self.work.plan, book,
                                   self.files)
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
        copies = not self.destination.moves   # (an upload leaves the staged files where they are)
        check = VerifyShardStep(books, tuple(shards), self.work.plan, self.work.path, copies)
        done, published = resumed_shards(books, len(shards), copies, lambda units: self._verdicts(check, units))
        if done:
            self.times["verify_shards"] = time.perf_counter() - t
            t = time.perf_counter()
        self.resumed["materialize"] = len(done)
        store_dir, names = store_argument(store)
        step = MaterializeStep(store_dir, self.work.plan, tuple(shards), self.job.pad_id, self.job.vocab_size,
                               books["materialize"], names=names)
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
        # --check also checks a sample against the source (a mixture's sources: each in its own run)
        count = verify_count(job, store) if job.mixture is None else 0
        if count:
            t = time.perf_counter()
            with self.progress.phase("verify-masks", count, unit="conversations") as bar:
                step = VerifyMasksStep(store.directory, self.work.plan, tuple(shards), job, count, self.files)
                out["verify"] = self._one(step)["verify"]
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
        """The promotion gate on the staged shards ``prefixes`` (:class:`.checks.GateStep`, one
        unit per shard: in the local engine's workers too); raises at the first shard it rejects."""
        self.engine.map(GateStep(tuple(prefixes)), range(len(prefixes)), lambda r: on_shard and on_shard())
        return {"passed": True, "shards": len(prefixes)}

    def _balance(self, staged: StagedSet, shards: Sequence[OutputShard], located: Sequence[OutputShard]) -> StagedSet:
        """The staged set with its balanced orders (``--balance-for``), planned again on every
        attempt: derived data, the same bytes from the same packs."""
        if self.job.balance.topology() is None:
            return staged
        t = time.perf_counter()
        got = self._one(BalanceStep(self.job, tuple(shards), tuple(located), tuple(staged.manifests),
                                    plan_path=self.work.plan if self.job.mixture is not None else ""))
        orders, self.orders_not_written = got["orders"], got["not_written"]
        self.windows = got.get("windows", {})
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
        self.ws.sync()   # (the intent is durable before any final name is touched)
        normal = self.destination.normal
        ours = {normal(p) for p in finals}
        mine = {normal(p) for p in self.owned}
        stale = [p for p in outputs.existing_outputs(self.job.bases, self.destination) if normal(p) in mine - ours]
        self.work.publishing = True
        staged = replace(staged, shards=tuple(replace(s, staged=self.ws.source_of(s.staged)) for s in staged.shards))
        with self.progress.phase("publish", len(staged.shards), unit="shards") as bar:
            written = publish(staged, list(self.replaced) + stale, books["publish"], self.destination,
                              on_shard=lambda: bar.update(1))
        self.ws.sync()
        self.times["publish"] = time.perf_counter() - t
        return written

    def _commit(self, store: SequenceStore, summary: dict, staged: StagedSet, receipts: List[dict],
                written: Dict[str, bytes]) -> None:
        """Write the run's record; from here on a signal no longer fails the run, and the work
        directory is reduced to the record whatever arrives."""
        run_books(self.work, self.key)["done"].write(0, {
            "summary": summary, "outputs": record_outputs(staged, receipts, self.work, written),
            "inputs": [{"name": i["name"], "sha256": i["sha256"]} for i in store.inputs]})
        self.ws.sync()   # (the record is durable before the rest of the work directory goes)
        self.summary = summary
        committed()  # (a signal from here on is ignored by the tool, or caught by started())
        with signals_deferred():  # committed: finish the cleanup whatever arrives now
            self.ws.retire()   # (before the engine closes: it cleans up on the engine's nodes)
            self.engine.close()
            self.engine = None


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


def _stage_books(work, key: str, store_id: str, job: PackJob, files: Files) -> Dict[str, ReceiptBook]:
    """The receipts of the pack stages, the run's own besides. ``plan``, ``materialize`` and
    ``publish`` belong also to the store they were made from (a store rebuilt because an input
    changed redoes them), and ``checks`` to which checks run. ``files``: how their artifacts
    are seen."""
    stage_key = settings_key([key, store_id])
    out = run_books(work, key)
    for name, schema in (("plan", plan_schema), ("materialize", materialize_schema), ("publish", _publish_schema)):
        out[name] = ReceiptBook(work.receipts, name, stage_key, work.path, schema, files)
    out["checks"] = ReceiptBook(work.receipts, "checks", settings_key([stage_key, job.run.check, job.run.verify_masks]),
                                work.path, checks_schema, files)
    return out
