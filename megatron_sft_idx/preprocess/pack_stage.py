"""From a complete sequence store to published shards: plan, materialize, check, publish.

Shared by ``preprocess_sft`` (after tokenizing) and ``repack_sft`` (from an existing store):
the same :class:`PackJob` over the same store gives the same bytes either way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .._progress import Progress
from .._units import plural
from ..errors import HeaderError, MetadataError, ShardError
from ..format import PUBLISH_ORDER, SEQ_IDX_SUFFIX
from ..metadata import ShardMetadata
from . import outputs
from ._schema import HEX, check_int
from .integrity import check_crc, crc32_file, verify_shard
from .materialize import MaterializeStep, OutputShard
from .plan import PlanSettings, PlanStep, plan_summary
from .planfile import PackPlan
from .publish import StagedSet, StagedShard, publish
from .receipts import ReceiptBook, settings_key
from .remote_outputs import is_remote, publish_remote, remote_sizes
from .store import SequenceStore
from .summary import check_gate, check_summary, check_verify
from .workdir import WorkDir

log = logging.getLogger("megatron_sft_idx.preprocess")


@dataclass(frozen=True)
class PackJob:
    """What the output is: the plan settings plus what only the bytes depend on."""

    output_prefix: str
    settings: PlanSettings
    pad_id: int
    vocab_size: Optional[int]
    parallelism: Tuple[int, int, bool]   # cp, tp, sp the padding was computed for
    overwrite: bool = False
    check: bool = False
    verify_masks: int = 0
    tokenizer_path: Optional[str] = None  # for verify_masks
    staging_dir: Optional[str] = None     # where a URL output is built before its upload (remote_outputs)

    @property
    def bases(self) -> List[str]:
        return [outputs.split_prefix(self.output_prefix, s, bool(self.settings.split))
                for s in self.settings.split_names]


@dataclass
class PackResult:
    plan: dict                      # the plan receipt (summary of the plan)
    shards: List[dict]              # materialize receipts, in output order
    verify: Optional[dict]
    gate: Optional[dict]
    staged: StagedSet


def _plan_schema(doc) -> None:
    doc.int("conversations", lo=0)
    doc.list("splits")   # the rest is compared with the plan file's own (strict) metadata


def _materialize_schema(doc) -> None:
    doc.str("final")
    doc.int("packs", lo=1)
    doc.number("peak_rss_mib", 0.0, float(1 << 40))
    try:
        ShardMetadata.from_dict(doc.raw("metadata"), path=doc.path)
    except ShardError as exc:
        raise MetadataError(exc.message, path=doc.path, field=f"metadata.{exc.field}") from None
    doc.doc("metadata").doc("extra").str("split")


def _checks_schema(doc) -> None:
    for key, check in (("verify", check_verify), ("gate", check_gate)):
        entry = doc.doc(key, none=True)
        if entry is not None:
            check(entry)


def _intent_schema(doc) -> None:
    for k, item in enumerate(doc.list("files")):
        if not isinstance(item, str):
            raise doc.fail("must be a string", f"files[{k}]")


def _publish_schema(doc) -> None:
    doc.str("final")


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


_SCHEMAS = {"plan": _plan_schema, "materialize": _materialize_schema, "checks": _checks_schema,
            "intent": _intent_schema, "publish": _publish_schema, "done": _done_schema}


def books(work: WorkDir, run_key: str, job: Optional[PackJob] = None,
          store_id: Optional[str] = None) -> Dict[str, ReceiptBook]:
    """The receipts of the pack stages. ``intent`` (the files the run owns) and ``done`` (the
    finished run's record) belong to the run; ``plan``, ``materialize``, ``checks`` and
    ``publish`` also to the store they were made from (``store_id``: a store rebuilt because an
    input changed redoes them), and ``checks`` to which checks run."""
    stage_key = settings_key([run_key, store_id]) if store_id else run_key
    out = {name: ReceiptBook(work.receipts, name, run_key, work.path, _SCHEMAS[name]) for name in ("intent", "done")}
    for name in ("plan", "materialize", "publish"):
        out[name] = ReceiptBook(work.receipts, name, stage_key, work.path, _SCHEMAS[name])
    if job is not None:
        out["checks"] = ReceiptBook(work.receipts, "checks", settings_key([stage_key, job.check, job.verify_masks]),
                                    work.path, _checks_schema)
    return out


def shard_metadata(store: SequenceStore, job: PackJob, split: str, shard: int, count: int,
                   set_id: Optional[str] = None) -> dict:
    """The metadata every output shard records (the same whichever command wrote it); with
    ``set_id`` (a run writing several shards) the shard's set membership too."""
    s = job.settings
    cp, tp, sp = job.parallelism
    encode = store.identity["encode"]
    meta = {
        "pad_seq_to_mult": s.pad_multiple,
        "pad_layout": s.pad_layout,
        "tokenizer": store.tokenizer,
        "packing": {"algorithm": s.algorithm, "seed": s.seed, "pack_size": s.pack_size, "overlong": s.overlong},
        "parallelism": {"cp": cp, "tp": tp, "sp": bool(sp)},
        "source": {"inputs": store.inputs, "input_format": encode["input_format"]},
        "extra": {"loss_on": encode["loss_on"], "split": split, "shard_index": shard, "shard_count": count},
    }
    if set_id is not None:
        meta["set"] = {"id": set_id, "name": split, "index": shard, "count": count}
    if s.truncated_turn_loss != "keep":  # absent means keep (the default; the bytes of earlier shards)
        meta["extra"]["truncated_turn_loss"] = s.truncated_turn_loss
    from .pipeline import encoding_extra

    meta["extra"].update(encoding_extra(encode))  # loss policy, prompt format: absent means the defaults
    if meta["tokenizer"] is None:  # pre-tokenized input without a tokenizer
        del meta["tokenizer"]
    return meta


def set_id(store: SequenceStore, job: PackJob, split: str) -> str:
    """The id of the set of one split's shards: a digest of everything that decides their bytes
    (what the store holds -- tokenizer, encoding, inputs by content -- and the pack settings)
    and the split's name. Deterministic: the same inputs and settings give the same id whatever
    the engine, the workers, the partitioning or a resume, and whether ``preprocess-sft`` or
    ``repack-sft`` wrote the shards; any change to what the shards hold gives another id."""
    settings = job.settings.to_dict()
    if settings.get("split"):  # weights as given by the CLI (floats) or the API (maybe ints): one spelling
        settings["split"] = [float(w) for w in settings["split"]]
    return settings_key({"set": 1, "store": store.identity, "inputs": store.inputs, "settings": settings,
                         "pad_id": job.pad_id, "vocab_size": job.vocab_size,
                         "parallelism": [int(job.parallelism[0]), int(job.parallelism[1]), bool(job.parallelism[2])],
                         "split": split})


def output_shards(store: SequenceStore, job: PackJob, plan: dict, staged_dir: str) -> List[OutputShard]:
    """Every output shard of the plan, in publishing order (splits, then shard index). When the
    run writes more than one shard, each split's shards form a set (:func:`set_id`)."""
    numbered = bool(job.settings.max_packs_per_shard or job.settings.max_shard_bytes)
    by_name = dict(zip(job.settings.split_names, job.bases))
    several = sum(split["shards"] for split in plan["splits"]) > 1
    out = []
    for i, split in enumerate(plan["splits"]):
        count = split["shards"]
        ident = set_id(store, job, split["name"]) if several else None
        for k in range(count):
            final = outputs.shard_prefix(by_name[split["name"]], k, numbered)
            out.append(OutputShard(i, k, os.path.join(staged_dir, os.path.basename(final)), final,
                                   shard_metadata(store, job, split["name"], k, count, ident)))
    return out


def staged_set(shards: Sequence[OutputShard], plan: dict, job: PackJob) -> StagedSet:
    """The set to publish; with more than one output shard, one manifest per split."""
    manifests = []
    if len(shards) > 1:
        by_name = dict(zip(job.settings.split_names, job.bases))
        for i, split in enumerate(plan["splits"]):
            finals = tuple(s.final for s in shards if s.split == i)
            manifests.append((outputs.manifest_path(by_name[split["name"]]), finals))
    return StagedSet(tuple(StagedShard(s.staged, s.final) for s in shards), tuple(manifests))


def run_pack(store: SequenceStore, job: PackJob, engine, work: WorkDir, run_key: str,
             replaced: Sequence[str], times: Dict[str, float], progress: Optional[Progress] = None,
             resumed: Optional[Dict[str, int]] = None, owned: Sequence[str] = ()) -> PackResult:
    """Plan (one unit), materialize (one unit per output shard), verify/gate, publish.

    Units with a valid receipt (``--resume``) are not run again, once what they made verifies:
    the plan file (pinned CRC-32, its receipt, every array against the store) and each shard,
    staged or already published (every checksum, its metadata against its receipt); what does
    not verify is done again. ``owned``: files an earlier attempt of this run published; those
    this attempt does not write again are removed when it publishes.

    Raises:
        ShardError: see the steps; the gate or --verify-masks rejected the output.
    """
    b = books(work, run_key, job, store.store_id)
    resumed = {} if resumed is None else resumed
    progress = progress or Progress.of(False)
    t = time.perf_counter()
    plan = _resumed_plan(b["plan"], work.plan, store, job.settings)
    resumed["plan"] = int(plan is not None)
    if plan is None:
        step = PlanStep(store.directory, job.settings, work.plan, b["plan"])
        with progress.phase("plan", store.sequence_count, unit="conversations") as bar:
            engine.map(step, [0], lambda r: bar.update(store.sequence_count))
        plan = b["plan"].read(0)
        times["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        PackPlan(work.plan, verify=False).validate(store)   # (a bug guard: cheap, bench/stages.py measures it)
        times["verify_plan"] = time.perf_counter() - t
    else:
        times["plan"] = time.perf_counter() - t             # (verifying the resumed plan)
    log.info("plan: %s kept of %s, %s truncated, %s in %s", f"{plan['conversations']:,}",
             f"{store.sequence_count:,}", f"{plan['truncated']:,}",
             plural(sum(sp["packs"] for sp in plan["splits"]), "pack"),
             plural(sum(sp["shards"] for sp in plan["splits"]), "shard"))
    t = time.perf_counter()
    shards = output_shards(store, job, plan, work.staged)
    done, published = _resumed_shards(b, shards, PackPlan(work.plan, verify=False), work, is_remote(job.output_prefix))
    if done:
        times["verify_shards"] = time.perf_counter() - t
        t = time.perf_counter()
    resumed["materialize"] = len(done)
    step = MaterializeStep(store.directory, work.plan, tuple(shards), job.pad_id, job.vocab_size, b["materialize"])

    todo = [u for u in range(len(shards)) if u not in done]
    total = sum(sp["packs"] for sp in plan["splits"]) - sum(r["packs"] for r in done.values())
    with progress.phase("write", total, unit="packs") as bar:
        def on_done(receipt: dict) -> None:
            done[receipt["unit"]] = receipt
            bar.update(receipt["packs"])

        engine.map(step, todo, on_done)
    times["materialize"] = time.perf_counter() - t
    result = PackResult(plan, [done[u] for u in range(len(shards))], None, None, staged_set(shards, plan, job))
    checked = b["checks"].read(0)
    if checked is None:  # (a resumed publish has passed them already, and moved the staged files)
        moved = set() if is_remote(job.output_prefix) else published   # (a local publish moves the files)
        located = [replace(s, staged=s.final) if u in moved else s for u, s in enumerate(shards)]
        checked = b["checks"].write(0, _checks(store, job, work, located, times, progress))
    elif todo and job.check:  # units done again after the checks passed: the same gate on them
        run_gate([shards[u].staged for u in todo])
    result.verify, result.gate = checked["verify"], checked["gate"]
    t = time.perf_counter()
    resumed["publish"] = len(published)
    # before any final name is touched: the files this run owns (a resumed publish may replace them)
    finals = {s.final + x for s in shards for x in PUBLISH_ORDER} | {path for path, _ in result.staged.manifests}
    b["intent"].write(0, {"files": sorted(finals | set(owned))})
    written, mine = {outputs.normal_path(p) for p in finals}, {outputs.normal_path(p) for p in owned}
    stale = [p for p in outputs.existing_outputs(job.bases) if outputs.normal_path(p) in mine - written]
    work.publishing = True
    with progress.phase("publish", len(shards), unit="shards") as bar:
        publish_to = publish_remote if is_remote(job.output_prefix) else publish
        publish_to(result.staged, list(replaced) + stale, b["publish"], on_shard=lambda: bar.update(1))
    times["publish"] = time.perf_counter() - t
    return result


_RECEIPT_KEYS = ("step", "unit", "key", "artifacts", "crc32")
_REDO_HINT = "the unit is done again"


def _resumed_plan(book: ReceiptBook, path: str, store: SequenceStore, settings: PlanSettings) -> Optional[dict]:
    """The plan receipt of an earlier attempt when the plan file verifies (pinned CRC-32, the
    receipt equal to the file's metadata, the run's settings, every array valid against
    ``store``), else None."""
    receipt = book.read(0)
    if receipt is None:
        return None
    try:
        book.verify(receipt, _REDO_HINT)
        plan = PackPlan(path)
        recorded = {k: v for k, v in receipt.items() if k not in _RECEIPT_KEYS}
        if _normal(plan_summary(plan.metadata)) != _normal(recorded):
            raise HeaderError("the plan receipt disagrees with the plan file", path=book.path(0), field="splits")
        if _normal(plan.metadata["settings"]) != _normal(settings.to_dict()):
            raise HeaderError("the plan was made with other settings", path=path, field="settings")
        plan.validate(store)
    except ShardError as exc:
        log.warning("the pack plan does not verify; planning again: %s", exc)
        book.discard(0)
        return None
    return receipt


def _resumed_shards(b: Dict[str, ReceiptBook], shards: List[OutputShard], plan: PackPlan, work: WorkDir,
                    remote: bool) -> Tuple[Dict[int, dict], set]:
    """``({unit: materialize receipt}, {published units})`` of the units an earlier attempt
    finished whose shard still verifies (where it is now: staged, or under its final name
    once published locally). A unit that does not verify loses both its receipts."""
    done, published = {}, set()
    for u, shard in enumerate(shards):
        pub = b["publish"].read(u)
        moved = pub is not None and not remote   # a local publish moved the staged files
        receipt = b["materialize"].read(u, artifacts=not moved)
        if receipt is None:
            b["publish"].discard(u)
            continue
        starts = plan.arrays(shard.split)["shard_starts"]
        try:
            _verify_unit(receipt, pub, shard, int(starts[shard.shard + 1] - starts[shard.shard]), work, moved)
        except ShardError as exc:
            log.warning("output shard %d does not verify; writing it again: %s", u, exc)
            b["materialize"].discard(u)
            b["publish"].discard(u)
            continue
        done[u] = receipt
        if pub is not None:
            published.add(u)
    return done, published


def _verify_unit(receipt: dict, pub: Optional[dict], shard: OutputShard, packs: int, work: WorkDir,
                 moved: bool) -> None:
    """Raise unless the unit's receipts name this shard and its bytes verify.

    Raises:
        ShardError: a receipt of another shard, or a checksum or the metadata differ.
    """
    final = outputs.normal_path(shard.final)
    if (outputs.normal_path(receipt["final"]) != final or receipt["packs"] != packs
            or (pub is not None and outputs.normal_path(pub["final"]) != final)):
        raise MetadataError("the receipts of this unit name another shard", path=shard.staged, field="final",
                            expected=[shard.final, packs], actual=[receipt["final"], receipt["packs"]])
    rel = os.path.relpath(shard.staged + SEQ_IDX_SUFFIX, work.path)
    ds = verify_shard(shard.final if moved else shard.staged, _REDO_HINT, receipt.get("crc32", {}).get(rel))
    if _normal(ds.metadata.to_dict()) != _normal(receipt["metadata"]):
        raise MetadataError("the shard's metadata differs from its receipt's", path=ds.paths.seq_idx,
                            field="metadata")


def _normal(obj):
    return json.loads(json.dumps(obj, sort_keys=True))


def record_outputs(result: PackResult, shards: Sequence[OutputShard], work: WorkDir) -> Dict[str, list]:
    """``{final file: [size, CRC-32]}`` of everything the run published: the shards' files from
    their metadata and materialize receipts, the manifests read once (a URL's from its local copy)."""
    record: Dict[str, list] = {}
    for shard, receipt in zip(shards, result.shards):
        for suffix, digest in receipt["metadata"]["files"].items():
            record[shard.final + suffix] = [digest["size"], digest["crc32"]]
        rel = os.path.relpath(shard.staged + SEQ_IDX_SUFFIX, work.path)
        record[shard.final + SEQ_IDX_SUFFIX] = [receipt["artifacts"][rel], receipt.get("crc32", {}).get(rel)]
    for path, _ in result.staged.manifests:
        local = os.path.join(work.staged, os.path.basename(path)) if is_remote(path) else path
        record[path] = [os.path.getsize(local), crc32_file(local)]
    return record


def check_outputs(record: Dict[str, list]) -> None:
    """Raise unless every output of a finished run's record is still there, complete and
    identical: local files by size and CRC-32 (read once), objects by size (one LIST per prefix).

    Raises:
        ShardError: a file or object is missing, or differs (naming it).
    """
    remote = sorted(p for p in record if is_remote(p))
    sizes = remote_sizes(remote) if remote else {}
    for path, (size, crc) in sorted(record.items()):
        if is_remote(path):
            if sizes.get(path) != size:
                raise ShardError("a published object is missing or changed size", path=path, field="size",
                                 expected=size, actual=sizes.get(path))
            continue
        try:
            actual = os.path.getsize(path)
        except OSError:
            raise ShardError("a published file is missing", path=path) from None
        if actual != size:
            raise ShardError("a published file changed size", path=path, field="size", expected=size, actual=actual)
        if crc is not None:
            check_crc(path, crc, "a published file", _REDO_HINT)


def _checks(store, job: PackJob, work: WorkDir, shards, times, progress: Progress) -> dict:
    """``--verify-masks`` and ``--check`` on the staged shards; raises when either fails."""
    out = {"verify": None, "gate": None}
    from .verify import CHECK_SAMPLE, verify_masks

    # --check also checks a sample against the source when --verify-masks asks for none
    count = job.verify_masks or (CHECK_SAMPLE if job.check and (job.tokenizer_path or store.tokenizer is None) else 0)
    if count:
        t = time.perf_counter()
        with progress.phase("verify-masks", count, unit="conversations") as bar:
            out["verify"] = verify_masks(store, work.plan, shards, job, count)
            bar.update(out["verify"]["checked"])
        if not job.verify_masks:
            out["verify"]["sample_of_check"] = True
        times["verify_masks"] = time.perf_counter() - t
    if job.check:
        t = time.perf_counter()
        with progress.phase("check", len(shards), unit="shards") as bar:
            out["gate"] = run_gate([s.staged for s in shards], on_shard=lambda: bar.update(1))
        times["check"] = time.perf_counter() - t
    return out


def run_gate(prefixes: Sequence[str], on_shard=None) -> dict:
    """Run the promotion gate on every staged shard.

    Raises:
        ShardError: the gate is not installed, or a shard fails it.
    """
    try:
        from ..gate import check
    except ImportError as exc:
        raise ShardError(f"--check needs megatron_sft_idx.gate ({exc})", field="check") from None
    report = None
    for prefix in prefixes:  # one shard at a time: progress per shard, and the first failure stops
        report = check([prefix], level="standard")
        if not report.passed:
            break
        if on_shard is not None:
            on_shard()
    if report is not None and not report.passed:
        raise ShardError("the gate rejected the output; nothing was published:\n" + report.format_text(),
                         field="check")
    return {"passed": True, "shards": len(prefixes)}
