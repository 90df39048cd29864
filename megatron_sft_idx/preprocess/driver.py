"""The driver: stage order, resume and commit, for ``preprocess-sft`` and ``repack-sft`` alike.

::

    run(cfg)      inputs -> index -> tokenize -> plan -> materialize -> check -> publish -> record
    repack(cfg)   a kept store, verified  ----> plan -> materialize -> check -> publish -> record
    plan_only()   a kept store, verified  ----> plan (one file, no shards)

    --mix FILE    (both commands) per source: its inputs tokenized into its store (preprocess-sft;
                  a store made from them already is reused, verified) or its store verified, then
                  one plan over the stores (:mod:`.mixplan`) -> materialize -> ... as above

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

The run holds one workspace (:mod:`.workspace`), chosen once from the output, the store, the
engine and the staging directory: local, or with the store or work directory in object storage
(mirrored on every node). The driver never asks which: every check that reads data is a step
the engine runs, in both setups -- the store's verification (:class:`.store.VerifyStoreStep`),
a resumed plan's and shards' (:class:`.plan.VerifyPlanStep`, :class:`.materialize.VerifyShardStep`),
``--check`` and ``--verify-masks`` (:class:`.checks.GateStep`, one unit per shard, and
:class:`.checks.VerifyMasksStep`), ``--balance-for`` (:class:`.balance.BalanceStep`) and
``--skip-report`` (:class:`.skips.SkipReportStep`) -- and the driver collects their verdicts.
The local engine runs a one-unit step in this process and a many-unit one in its workers.

Memory of the driver: receipts, plus (local engine, in-process plan) ~16-24 bytes per
conversation for the planner; with the Ray engine and the work directory in object storage,
receipts only (``bench/driver_memory.py``: flat from 5k to 80k conversations). Same inputs and settings give byte-identical shards whatever
``--workers``, ``--engine``, ``--partition-bytes`` or ``--batch-size``, whichever command wrote
them, and whether or not the run was interrupted and resumed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Callable, Dict, Optional

from ..errors import ShardError
from .config import Config, PackJob, RepackConfig
from .mixplan import write_mix_plan
from .mixreport import mixture_report
from .mixrun import kept_store, source_inputs, tokenize_key
from .mixture import load_mixture
from .plan import write_plan
from .receipts import settings_key
from .records.errors import output_error
from .records.partitions import auto_partition_bytes, sha256_file
from .skips import write_skip_report
from .stages import Stages
from .store import SequenceStore, read_once, read_store_file
from .stores import StoreSet
from .summary import inputs_left
from .tokenize import Inputs, recorded_template_date, resolve_inputs
from .workspace import Workspace, workspace_for
from ..storage.destination import destination_for

log = logging.getLogger("megatron_sft_idx.preprocess")


def run(cfg: Config) -> dict:
    """``preprocess-sft``: the whole pipeline; returns the summary (what ``--json`` prints).

    Raises:
        ShardError: bad arguments, bad input (InputError, naming file:line), an existing output
            without ``overwrite``, a failed check; OutputError: the filesystem refused a write.
        KeyboardInterrupt, Terminated: interrupted (the work directory is kept for ``--resume``).
    """
    if cfg.mix is not None:
        return _mixture(cfg, tokenize=True)
    times: Dict[str, float] = {}
    t = time.perf_counter()
    inputs = resolve_inputs(cfg)
    job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, inputs.options.vocab_size, inputs.pad_id,
                          inputs.options.tokenizer_path, cfg.balance)
    ws = workspace_for(job.output_prefix, job.run.engine, job.run.staging_dir, cfg.store)
    with ws.in_use():   # (this node's mirrors of a bucket: removed after success)
        return _run(cfg, inputs, job, ws, times, t)


def _run(cfg: Config, inputs: Inputs, job: PackJob, ws: Workspace, times: Dict[str, float], t: float) -> dict:
    """:func:`run` once its workspace is chosen (``t``: when the inputs stage started)."""
    if cfg.tokenize.partition_bytes is None:   # auto: from the inputs' size (resolved once, recorded in the key)
        cfg = replace(cfg, tokenize=replace(cfg.tokenize, partition_bytes=auto_partition_bytes(
            sum(size for _, size, _ in inputs.stat()))))
    if inputs.options.template_date is not None and cfg.tokenize.template_date is None and cfg.run.resume:
        ws.peek_store()   # the store being continued (--store, or the run's own) keeps the date it was rendered with
        recorded = recorded_template_date(ws.store_dir)
        if recorded is not None and recorded != inputs.options.template_date:
            inputs = resolve_inputs(cfg, recorded)
    encode = inputs.options.to_dict()
    if cfg.tokenize.template_date is None:  # a default date is the day the run started, not what the run is:
        encode.pop("template_date", None)   # resumed the next day, it is the same run (its store keeps the date)
    key = settings_key({"job": _job_key(job), "tokenizer": inputs.tokenizer, "encode": encode,
                        "inputs": inputs.paths, "partition_bytes": cfg.tokenize.partition_bytes,
                        "max_record_bytes": cfg.tokenize.max_record_bytes, "store": ws.kept_store})
    times["inputs"] = time.perf_counter() - t
    stages = Stages(job, key, times, ws)
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
    if cfg.mix is not None:
        return _mixture(cfg, tokenize=False)
    times: Dict[str, float] = {}
    t = time.perf_counter()
    if cfg.plan_only:   # (planned here, from the whole store: a URL's is mirrored here for the plan)
        with read_once([cfg.store]):
            store = SequenceStore(cfg.store)
            job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, store.vocab_size, (store.tokenizer or {})
                                  .get("pad_id"), cfg.tokenizer or store.tokenizer_path, cfg.balance)
            return plan_only(store, job, cfg.plan_only)
    ws = workspace_for(cfg.output_prefix, cfg.run.engine, cfg.run.staging_dir, cfg.store)
    with ws.in_use():   # (this node's mirrors of a bucket: removed after success)
        return _repack(cfg, ws, times, t)


def _repack(cfg: RepackConfig, ws: Workspace, times: Dict[str, float], t: float) -> dict:
    """:func:`repack` once its workspace is chosen (``t``: when the inputs stage started)."""
    store = SequenceStore(ws.open_kept_store(), files=ws.files)
    job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, store.vocab_size,
                          (store.tokenizer or {}).get("pad_id"), cfg.tokenizer or store.tokenizer_path, cfg.balance)
    key = settings_key({"store_id": store.store_id, "job": _job_key(job)})
    times["inputs"] = time.perf_counter() - t
    stages = Stages(job, key, times, ws)
    summary = stages.finished()
    if summary is not None:
        return summary
    with stages.started():
        stages.pack(stages.verified(store))
    return stages.summary


def plan_only(store, job: PackJob, path: str) -> dict:
    """Write only the pack plan of ``store`` (a mixture's: a :class:`~.stores.StoreSet`) to the
    local file ``path`` (for virtual packs; a URL is refused by :class:`~.config.RepackConfig`);
    returns its summary (a mixture's with its report: what each source will get).

    Raises:
        ShardError: the store does not verify; OutputError: the write failed.
    """
    t = time.perf_counter()
    try:
        for one in getattr(store, "stores", [store]):
            one.verify()   # a plan is made from the rows, and it is served from the tokens
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        meta = (write_plan(store, job.settings, path) if job.mixture is None
                else write_mix_plan(store, job.mixture, job.settings, path))
    except OSError as exc:
        raise output_error(exc, resumable=False) from None
    out = {"plan": path, "conversations": meta["conversations"], "truncated": meta["truncated"],
           "splits": {s["name"]: {k: v for k, v in s.items() if k not in ("arrays", "name", "sources")}
                      for s in meta["splits"]},
           "empty_splits": meta["empty_splits"], "seconds": {"plan": round(time.perf_counter() - t, 3)}}
    if job.mixture is not None:
        out["mixture"] = mixture_report(meta)
    return out


def _mixture(cfg, tokenize: bool) -> dict:
    """``--mix FILE`` of either command: each source's store (tokenized from its inputs by
    ``preprocess-sft`` -- a store made from them already is reused once it verifies -- or kept),
    then one plan over all of them, packed, checked and published as one run (module doc).

    Raises:
        ShardError: a bad mixture file (naming the field), a source's store missing, incomplete or
            of another tokenizer, template or loss policy, a source empty after filtering, targets
            the caps cannot meet; as :func:`run` otherwise.
    """
    times: Dict[str, float] = {}
    t = time.perf_counter()
    mixture = load_mixture(cfg.mix)
    names = mixture.names
    inputs = source_inputs(cfg, mixture) if tokenize else {}
    if getattr(cfg, "plan_only", None):   # (planned here, from the whole stores: a URL's is mirrored here)
        with read_once(s.store for s in mixture.sources):
            kept = {i: kept_store(None, mixture, i, tokenize) for i in range(len(names))}
            return _mixed(cfg, mixture, inputs, kept, None, times, t)
    ws = workspace_for(cfg.output_prefix, cfg.run.engine, cfg.run.staging_dir,
                       stores=[s.store for s in mixture.sources])
    with ws.in_use():   # (this node's mirrors of a bucket: removed after success)
        kept = {i: kept_store(ws, mixture, i, tokenize) for i in range(len(names)) if i not in inputs}
        return _mixed(cfg, mixture, inputs, kept, ws, times, t)


def _mixed(cfg, mixture, inputs: dict, kept: dict, ws: Optional[Workspace], times: Dict[str, float],
           t: float) -> dict:
    """:func:`_mixture` once its stores are found (``ws`` None: ``--plan-only``)."""
    names = mixture.names
    first = next(iter(inputs.values()), None)
    if first is not None:
        vocab, pad, tok_path = first[1].options.vocab_size, first[1].pad_id, first[1].options.tokenizer_path
    else:
        store0 = kept[0]
        vocab, pad = store0.vocab_size, (store0.tokenizer or {}).get("pad_id")
        tok_path = getattr(cfg, "tokenizer", None) or store0.tokenizer_path
    job = PackJob.resolve(cfg.output_prefix, cfg.pack, cfg.run, vocab, pad, tok_path, cfg.balance, mixture)
    if getattr(cfg, "plan_only", None):
        return plan_only(StoreSet([kept[i] for i in range(len(names))], names), job, cfg.plan_only)
    key = settings_key({"job": _job_key(job), "stores": list(ws.kept_stores),
                        "tokenize": {str(i): tokenize_key(c, inp) for i, (c, inp) in inputs.items()}})
    times["inputs"] = time.perf_counter() - t
    stages = Stages(job, key, times, ws)
    summary = stages.finished(_prove_mixture(ws, inputs, len(names), cfg.run.workers))
    if summary is not None:
        return summary
    with stages.started():
        stores = []
        for i in range(len(names)):
            if i in inputs:
                stores.append(stages.tokenize(inputs[i][0], inputs[i][1], index=i, resume=True))
            else:
                stores.append(stages.verified(kept[i]))
        stages.pack(StoreSet(stores, names))
    return stages.summary


def _prove_mixture(ws: Workspace, inputs: Dict[int, tuple], count: int, workers: int) -> Callable[[dict], None]:
    """A ``prove`` for :meth:`.stages.Stages.finished` of a mixture: every source's store is the one the
    finished run packed (its id), and the inputs of those it tokenized are the bytes it read."""
    def prove(record: dict) -> None:
        recorded = record["summary"]["mixture"]["stores"]
        for i in range(count):
            ws.peek_store(i)
            now = read_store_file(os.path.join(ws.store_dirs[i], "store.json"))["store_id"]
            if now != recorded[i]["store_id"]:
                raise ShardError("a source's store changed since the run finished", path=ws.kept_stores[i],
                                 field="store_id", expected=recorded[i]["store_id"], actual=now)
            if i in inputs:
                mine = inputs[i][1]
                theirs = [r for r in record["inputs"] if r["name"] in set(mine.names)]
                prove_inputs(mine, workers)({"inputs": theirs})
    return prove


def _job_key(job: PackJob) -> dict:
    """What of the job the run key digests (the settings as the plan records them, resolved)."""
    key = {"output_prefix": destination_for(job.output_prefix).normal(job.output_prefix),
           "settings": job.settings.to_dict(),
           "pad_id": job.pad_id, "vocab_size": job.vocab_size, "parallelism": list(job.parallelism)}
    if job.fp8 is not None:   # (keys of runs without --fp8 are unchanged)
        key["fp8"] = job.fp8
    if job.balance.to_dict() is not None:   # (keys of runs without --balance-for are unchanged)
        key["balance"] = job.balance.to_dict()
    if job.mixture is not None:
        key["mixture"] = job.mixture.to_dict()
    return key


def _result(future: Future):
    """``future.result()`` in timed waits: a signal the kernel delivers to another thread (a
    process-directed SIGINT may land on any thread that does not block it) runs its Python
    handler only once this, the main, thread wakes; an untimed wait would sleep through it."""
    while True:
        try:
            return future.result(timeout=_WAKE_S)
        except FutureTimeout:
            continue


#: How often a waiting main thread wakes to run the handlers of signals other threads received.
_WAKE_S = 0.2


def prove_inputs(inputs: Inputs, workers: int) -> Callable[[dict], None]:
    """A ``prove`` for :meth:`.stages.Stages.finished`: the inputs are the bytes a finished run read (each
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
                    digests = [_result(f) for f in futures]
                finally:
                    stop.set()
        except OSError as exc:
            raise ShardError(f"cannot read an input ({exc.strerror or exc})", path=exc.filename) from None
        for name, info, digest in zip(inputs.names, recorded, digests):
            if digest != info["sha256"]:
                raise ShardError("input changed since the run finished", path=name, field="sha256",
                                 expected=info["sha256"], actual=digest)
    return prove


__all__ = ["run", "repack", "plan_only", "prove_inputs"]
