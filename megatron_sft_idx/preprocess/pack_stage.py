"""From a complete sequence store to published shards: plan, materialize, check, publish.

Shared by ``preprocess_sft`` (after tokenizing) and ``repack_sft`` (from an existing store):
the same :class:`PackJob` over the same store gives the same bytes either way.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .._progress import Progress
from .._units import plural
from ..errors import ShardError
from ..format import PUBLISH_ORDER
from . import outputs
from .materialize import MaterializeStep, OutputShard
from .plan import PlanSettings, PlanStep
from .publish import StagedSet, StagedShard, publish
from .receipts import ReceiptBook, settings_key
from .remote_outputs import is_remote, publish_remote
from .store import SequenceStore
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


def books(work: WorkDir, run_key: str, job: Optional[PackJob] = None) -> Dict[str, ReceiptBook]:
    """The receipts of the pack stages; those of the checks also depend on which checks run."""
    out = {name: ReceiptBook(work.receipts, name, run_key, work.path)
           for name in ("plan", "materialize", "intent", "publish", "done")}
    if job is not None:
        out["checks"] = ReceiptBook(work.receipts, "checks", settings_key([run_key, job.check, job.verify_masks]),
                                    work.path)
    return out


def shard_metadata(store: SequenceStore, job: PackJob, split: str, shard: int, count: int) -> dict:
    """The metadata every output shard records (the same whichever command wrote it)."""
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
    if s.truncated_turn_loss != "keep":  # absent means keep (the default; the bytes of earlier shards)
        meta["extra"]["truncated_turn_loss"] = s.truncated_turn_loss
    from .pipeline import encoding_extra

    meta["extra"].update(encoding_extra(encode))  # loss policy, prompt format: absent means the defaults
    if meta["tokenizer"] is None:  # pre-tokenized input without a tokenizer
        del meta["tokenizer"]
    return meta


def output_shards(store: SequenceStore, job: PackJob, plan: dict, staged_dir: str) -> List[OutputShard]:
    """Every output shard of the plan, in publishing order (splits, then shard index)."""
    numbered = bool(job.settings.max_packs_per_shard or job.settings.max_shard_bytes)
    by_name = dict(zip(job.settings.split_names, job.bases))
    out = []
    for i, split in enumerate(plan["splits"]):
        count = split["shards"]
        for k in range(count):
            final = outputs.shard_prefix(by_name[split["name"]], k, numbered)
            out.append(OutputShard(i, k, os.path.join(staged_dir, os.path.basename(final)), final,
                                   shard_metadata(store, job, split["name"], k, count)))
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
             resumed: Optional[Dict[str, int]] = None) -> PackResult:
    """Plan (one unit), materialize (one unit per output shard), verify/gate, publish.

    Units with a valid receipt (``--resume``) are not run again.

    Raises:
        ShardError: see the steps; the gate or --verify-masks rejected the output.
    """
    b = books(work, run_key, job)
    resumed = {} if resumed is None else resumed
    progress = progress or Progress.of(False)
    t = time.perf_counter()
    plan = b["plan"].read(0)
    resumed["plan"] = int(plan is not None)
    if plan is None:
        step = PlanStep(store.directory, job.settings, work.plan, b["plan"])
        with progress.phase("plan", store.sequence_count, unit="conversations") as bar:
            engine.map(step, [0], lambda r: bar.update(store.sequence_count))
        plan = b["plan"].read(0)
    times["plan"] = time.perf_counter() - t
    log.info("plan: %s kept of %s, %s truncated, %s in %s", f"{plan['conversations']:,}",
             f"{store.sequence_count:,}", f"{plan['truncated']:,}",
             plural(sum(sp["packs"] for sp in plan["splits"]), "pack"),
             plural(sum(sp["shards"] for sp in plan["splits"]), "shard"))
    t = time.perf_counter()
    shards = output_shards(store, job, plan, work.staged)
    done = b["materialize"].completed(range(len(shards)))
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
        checked = b["checks"].write(0, _checks(store, job, work, shards, times, progress))
    result.verify, result.gate = checked["verify"], checked["gate"]
    t = time.perf_counter()
    resumed["publish"] = len(b["publish"].completed(range(len(shards))))
    # before any final name is touched: the files this run owns (a resumed publish may replace them)
    b["intent"].write(0, {"files": sorted({s.final + x for s in shards for x in PUBLISH_ORDER}
                                          | {path for path, _ in result.staged.manifests})})
    work.publishing = True
    with progress.phase("publish", len(shards), unit="shards") as bar:
        publish_to = publish_remote if is_remote(job.output_prefix) else publish
        publish_to(result.staged, replaced, b["publish"], on_shard=lambda: bar.update(1))
    times["publish"] = time.perf_counter() - t
    return result


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
