"""The run summary (what ``--json`` prints and ``--summary-json`` writes), from receipts alone."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from .._progress import own_peak_rss_mib
from .._units import human_bytes, plural
from .records.encode import PROMPT_ONLY_DROPPED
from .records.inputs import left_reason
from .records.policy import LossPolicy
from .records.shapes import APPLIED_RULES
from .mixreport import format_mixture, mixture_report

if TYPE_CHECKING:   # (annotations only)
    from .config import PackJob
    from .store import SequenceStore


@dataclass
class PackResult:
    """What a run's stages produced and recorded, as the summary reads it."""

    plan: dict                          # the plan receipt (summary of the plan)
    shards: List[dict]                  # materialize receipts, in output order
    verify: Optional[dict] = None       # what --verify-masks found
    gate: Optional[dict] = None         # what --check found
    manifests: List[str] = field(default_factory=list)   # one per split when the run wrote several shards
    times: Dict[str, float] = field(default_factory=dict)     # seconds by phase, in run order
    resumed: Dict[str, int] = field(default_factory=dict)     # units done before, by stage
    engine: dict = field(default_factory=dict)                # the engine's description
    kept_store: Optional[str] = None    # the --store directory (kept for repack-sft), if any
    orders: List[str] = field(default_factory=list)      # balanced pack orders written (--balance-for)
    orders_not_written: Dict[str, str] = field(default_factory=dict)   # split -> why it has no order
    windows: Dict[str, dict] = field(default_factory=dict)   # a mixture's split -> its window report (an order's)


def peak_rss_mib(receipts: List[dict]) -> Dict[str, float]:
    """This process's own peak RSS (:func:`~megatron_sft_idx._progress.own_peak_rss_mib`: not
    its parent's, when started from a large process), and the largest of its children's and of
    the receipts' (workers report their own)."""
    own = own_peak_rss_mib()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    reported = [r.get("peak_rss_mib", 0.0) for r in receipts]
    return {"main": round(own, 1), "workers_max": round(max([kids] + reported), 1)}


def merged_skips(store: SequenceStore, plan: dict):
    """Skip counts by reason and the first example of each, in input order."""
    skipped: Dict[str, int] = {}
    first: Dict[str, str] = {}
    for r in store.receipts + [plan]:
        for reason, count in r["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
        for reason, message in r["first_skipped"].items():
            first.setdefault(reason, message)
    return dict(sorted(skipped.items())), dict(sorted(first.items()))


def _add(into: Dict[str, int], counts: Dict[str, int]) -> None:
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n


def prompt_only_counts(store: SequenceStore, policy: str, records_skipped: Dict[str, int]) -> dict:
    """``--prompt-only``'s policy and what it did: ``stored``, sequences of the store that train
    nothing (``keep``: read from the store's rows, ``first_trained == length``; the plan may still
    drop an overlong one, counted in ``sequences_dropped``), and ``dropped``, records ``drop`` skipped."""
    stored = 0
    for k in range(len(store.partitions)):
        rows = store.rows(k)
        stored += int((rows["first_trained"] == rows["length"]).sum())
    return {"policy": policy, "stored": stored, "dropped": int(records_skipped.get(PROMPT_ONLY_DROPPED, 0))}


def input_files(store: SequenceStore) -> List[dict]:
    """Per input file, in input order: its records read, sequences stored and skips by reason
    (the tokenize receipts of its partitions)."""
    files = [{"name": i["name"], "records": 0, "sequences": 0, "skipped": {}} for i in store.inputs]
    for part, r in zip(store.partitions, store.receipts):
        f = files[part.file]
        f["records"] += r["records"]
        f["sequences"] += r["sequences"]
        _add(f["skipped"], r["skipped"])
    for f in files:
        f["skipped"] = dict(sorted(f["skipped"].items()))
    return files


def ignored_keys(store: SequenceStore, applied: bool = False) -> Dict[str, int]:
    """Keys ignored by a rule, ``rule:key`` -> records (``records.shapes.account_keys``); with
    ``applied``, the fields read by a rule instead (``records.shapes.APPLIED_RULES``: arguments
    decoded twice), which the tokenize receipts count the same way."""
    out: Dict[str, int] = {}
    for r in store.receipts:
        _add(out, {k: n for k, n in (r.get("ignored") or {}).items()
                   if (k.partition(":")[0] in APPLIED_RULES) == applied})
    return dict(sorted(out.items()))


def inputs_left(left) -> List[dict]:
    """What the input directories hold and the run did not read (``left``: as
    :func:`~megatron_sft_idx.preprocess.records.inputs.expand_inputs` gave it), each
    ``{"name", "reason"}``: the summary's ``inputs_left`` (the files read are its ``inputs``)."""
    return [{"name": p, "reason": left_reason(p)} for p in left]


def workers_busy(store: SequenceStore, workers: int, result: PackResult) -> Dict[str, float]:
    """The share of the tokenize stage's worker time spent in its units (1.0: every worker busy
    throughout); absent when some units were done by an earlier attempt or timed by none."""
    wall = result.times.get("tokenize", 0.0)
    busy = sum(r.get("seconds", 0.0) for r in store.receipts)
    if result.resumed.get("tokenize") or wall <= 0 or busy <= 0:
        return {}
    return {"tokenize": round(min(1.0, busy / (wall * max(1, workers))), 4)}


def build_summary(store: SequenceStore, job: PackJob, result: PackResult) -> dict:
    """The summary of a run (``--json``; a finished run's record keeps it)."""
    s = job.settings
    stats = [r["metadata"]["stats"] for r in result.shards]
    tokens = sum(x["token_count"] for x in stats)
    loss_tokens = sum(x["loss_token_count"] for x in stats)
    packs = sum(x["pack_count"] for x in stats)
    finals = [r["final"] for r in result.shards]
    skipped, first = merged_skips(store, result.plan)
    splits = {}
    for sp in result.plan["splits"]:
        splits[sp["name"]] = {
            "conversations": sp["conversations"], "packs": sp["packs"],
            "shards": [r["final"] for r in result.shards if _split_of(r) == sp["name"]],
            "packing_efficiency": sp["packing_efficiency"], "bins_over_lower_bound": sp["bins_over_lower_bound"]}
    encode = store.identity["encode"]
    records_skipped: Dict[str, int] = {}
    for r in store.receipts:
        _add(records_skipped, r["skipped"])
    out = {
        "inputs": input_files(store),
        "records_read": sum(r["records"] for r in store.receipts),
        "records_skipped": dict(sorted(records_skipped.items())),   # records, by reason (tokenize)
        "sequences_stored": store.sequence_count,                   # sequences the records gave
        "sequences_dropped": dict(sorted(result.plan["skipped"].items())),   # sequences, by reason (plan)
        "ignored_keys": ignored_keys(store),
        "rules_applied": ignored_keys(store, applied=True),   # fields read by a rule, "rule:field" -> records
        "conversations": result.plan["conversations"],   # sequences kept (per-turn: one per trained turn)
        "skipped": skipped,
        "skipped_examples": first,
        "truncated": result.plan["truncated"],
        "truncated_turns_cut": result.plan.get("truncated_turns_cut", 0),
        "truncated_turn_loss": s.truncated_turn_loss,
        "sequences": sum(x["sequence_count"] for x in stats),
        "packs": packs,
        "tokens": tokens,
        "trainable_tokens": loss_tokens,
        "trainable_share": round(loss_tokens / tokens, 6) if tokens else 0.0,
        "padding_tokens": result.plan["padding_tokens"],
        "packing_efficiency": round(tokens / (packs * s.pack_size), 6) if packs else 0.0,
        "pack_size": s.pack_size, "pad_seq_to_mult": s.pad_multiple, "algorithm": s.algorithm, "seed": s.seed,
        "loss_on": encode["loss_on"], "loss_policy": loss_policy(encode), "workers": job.run.workers,
        "engine": result.engine,
        "splits": splits,
        "empty_splits": result.plan["empty_splits"],
        "outputs": finals,
        "manifests": list(result.manifests),
        "store": result.kept_store,
        "resumed_units": result.resumed,
        "units": {"index": len(store.inputs), "tokenize": len(store.partitions), "materialize": len(result.shards)},
        "workers_busy": workers_busy(store, job.run.workers, result),
        "verify_masks": result.verify, "check": result.gate,
        "seconds": {k: round(v, 3) for k, v in result.times.items()},
        "peak_rss_mib": peak_rss_mib(store.receipts + result.shards),
    }
    if "prompt_only" in encode:   # (summaries of runs without --prompt-only keep/drop are unchanged)
        out["prompt_only"] = prompt_only_counts(store, encode["prompt_only"], records_skipped)
    if result.orders:   # (summaries of runs without --balance-for are unchanged)
        out["orders"] = list(result.orders)
    if result.orders_not_written:
        out["orders_not_written"] = dict(result.orders_not_written)
    if job.mixture is not None:   # (--mix: what each source will really get, per split)
        out["mixture"] = mixture_report(result.plan)
        for split, windows in result.windows.items():
            out["mixture"]["splits"][split]["windows"] = windows
    if store.tokenizer_path:   # where the tokenizer was found: inspect-idx --pack looks there first
        path = store.tokenizer_path
        out["tokenizer_path"] = path if "://" in path else os.path.abspath(path)
    return out


def loss_policy(encode: dict) -> dict:
    """The run's loss policies, defaults included (the store records only what differs)."""
    given = encode.get("loss_policy") or {}
    p = LossPolicy()
    return {"tool_calls": given.get("tool_calls", p.tool_calls), "reasoning": given.get("reasoning", p.reasoning),
            "empty_reasoning": given.get("empty_reasoning", p.empty_reasoning),
            "reasoning_tags": list(given.get("reasoning_tags", p.tags))}


def _split_of(receipt: dict) -> str:
    return receipt["metadata"]["extra"]["split"]


# --------------------------------------------------------------------------- read back


def check_verify(doc) -> None:
    """The ``verify_masks`` entry of a summary (or of a checks receipt), as :func:`verify_text` reads it."""
    checked = doc.int("checked", lo=0)
    for key in ("requested", "skipped_truncated", "eligible"):
        doc.int(key, lo=0, default=None if key != "requested" else checked)


def check_gate(doc) -> None:
    doc.int("shards", lo=0)


def check_summary(doc) -> None:
    """A summary read back (a finished run's record): every key :func:`format_summary` and
    :func:`decision_warnings` read, with its type and range.

    Raises:
        ShardError: the first key that is missing or malformed (naming the file and the field).
    """
    inf = float("inf")
    doc.list("inputs")
    # A summary of this version counts records in, sequences out and skips apart: all of those
    # keys or (a summary of an earlier version) none of them.
    apart = {} if "records_skipped" in doc.obj else {"default": None}
    doc.int("records_read", lo=0, **apart)
    for key in ("conversations", "truncated", "sequences", "packs", "pack_size", "pad_seq_to_mult", "tokens",
                "padding_tokens", "trainable_tokens"):
        doc.int(key, lo=0)
    doc.int("truncated_turns_cut", lo=0, default=None)
    doc.str("truncated_turn_loss", default="keep")
    doc.str("algorithm")
    doc.ints("skipped", lo=0)
    for key in ("records_skipped", "sequences_dropped", "ignored_keys"):
        doc.ints(key, lo=0, **({} if not apart else {"default": {}}))
    doc.ints("rules_applied", lo=0, default={})
    doc.int("sequences_stored", lo=0, **apart)
    doc.ints("units", lo=0, default={})
    doc.mapping("workers_busy", lambda v, f: _number(doc, v, f, 1.0), default={})
    for key in ("trainable_share", "packing_efficiency"):
        doc.number(key, 0.0, 1.0)
    splits = doc.doc("splits")
    for name in splits.obj:
        split = splits.doc(name)
        split.int("conversations", lo=0)
        split.int("packs", lo=0)
        split.int("bytes", lo=0, default=None)
        shards = split.list("shards")
        if not shards or not all(isinstance(x, str) for x in shards):
            raise split.fail("must be a non-empty list of strings", "shards")
    doc.str("tokenizer_path", default=None)
    doc.strs("orders_not_written", default={})
    for key in ("empty_splits", "manifests", "orders"):
        if not all(isinstance(x, str) for x in doc.list(key, default=None) or []):
            raise doc.fail("must be a list of strings", key)
    for key, check in (("verify_masks", check_verify), ("check", check_gate)):
        entry = doc.raw(key, None)
        if entry:
            check(doc.doc(key))
    doc.str("store", default=None)
    if doc.raw("mixture", None) is not None:
        check_mixture(doc.doc("mixture"))
    doc.ints("resumed_units", lo=0, default={})
    doc.mapping("seconds", lambda v, f: _number(doc, v, f, inf))
    rss = doc.doc("peak_rss_mib")
    rss.number("main", 0.0, inf)
    rss.number("workers_max", 0.0, inf)


def check_mixture(doc) -> None:
    """A summary's ``mixture`` (:func:`~.mixreport.mixture_report`), as :func:`~.mixreport.format_mixture` reads it."""
    doc.str("unit")
    doc.int("window_steps", lo=1)
    splits = doc.doc("splits")
    for name in splits.obj:
        split = splits.doc(name)
        split.int("packs", lo=0)
        for key in ("max_share_deviation", "data_path_max_share_deviation"):
            split.number(key, 0.0, 1.0)
        for src in split.docs("sources"):
            src.str("name")
            for key in ("target_share", "share", "trained_share"):
                src.number(key, 0.0, 1.0)
            src.number("epochs", 0.0, float("inf"))
            for key in ("sequences", "trained_tokens", "tokens"):
                src.int(key, lo=0)
            blend = src.doc("data_path")
            for key in ("share", "trained_share"):
                blend.number(key, 0.0, 1.0)
            blend.number("epochs", 0.0, float("inf"))
        windows = split.doc("windows", none=True) if "windows" in split.obj else None
        if windows is not None:
            windows.str("topology")
            for key in ("interleaved", "shuffle"):
                windows.doc(key).number("max", 0.0, 1.0)


def _number(doc, value, field, hi):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= hi:
        raise doc.error("must be a number >= 0", path=doc.path, field=field, actual=value)
    return value


# --------------------------------------------------------------------------- as text


_REASONS = {"overlong_dropped": "overlong, dropped",
            "overlong_untrainable_after_truncation": "nothing trained after truncation",
            "overlong": "overlong", "no_trainable_tokens": "nothing trained",
            "prompt_only_dropped": "prompt-only, dropped (--prompt-only drop)",
            "bad_record": "bad record"}


def reason_text(reason: str) -> str:
    return _REASONS.get(reason, reason.replace("_", " "))


def skipped_text(skipped: Dict[str, int]) -> str:
    """``"3 (2 overlong, dropped; 1 bad record)"`` or ``"none"``."""
    total = sum(skipped.values())
    if not total:
        return "none"
    return f"{total:,} (" + "; ".join(f"{n:,} {reason_text(r)}" for r, n in sorted(skipped.items())) + ")"


def format_summary(s: dict) -> str:
    """The run summary as the table ``preprocess-sft`` and ``repack-sft`` print (no Python reprs)."""
    records = f", {plural(s['records_read'], 'record')}" if "records_read" in s else ""
    lines = [f"inputs              {plural(len(s['inputs']), 'file')}{records}"]
    left = s.get("inputs_left") or []
    if left:
        lines.append(f"  left out {plural(len(left), 'path')}: " + ", ".join(
            f"{f['name']} ({f['reason']})" for f in left[:20]) + (" ..." if len(left) > 20 else ""))
    if "records_skipped" in s:   # records in, sequences out, each counted as what it is
        files = [f for f in s["inputs"] if "records" in f]
        for f in files if len(files) > 1 else ():
            lines.append(f"  {f['name']}: {plural(f['records'], 'record')} -> "
                         f"{plural(f['sequences'], 'sequence')}, skipped {skipped_text(f['skipped'])}")
        taken = "taken by the mixture" if s.get("mixture") else "kept"   # (a mixture takes some, some twice)
        lines += [f"records             {s['records_read']:,} read, skipped {skipped_text(s['records_skipped'])}",
                  f"sequences           {s['sequences_stored']:,} from the records, {s['conversations']:,} {taken}, "
                  f"dropped {skipped_text(s['sequences_dropped'])}"]
        if s.get("ignored_keys"):
            lines.append("ignored keys        " + ", ".join(f"{k.partition(':')[2]} ({k.partition(':')[0]}) {n:,}"
                                                             for k, n in s["ignored_keys"].items()))
        if s.get("rules_applied"):
            lines.append("rules applied       " + ", ".join(
                f"{k.partition(':')[2]} ({k.partition(':')[0].replace('-', ' ')}) {n:,}"
                for k, n in s["rules_applied"].items()))
    else:   # (a summary of an earlier version)
        lines.append(f"conversations       {s['conversations']:,} kept, skipped {skipped_text(s['skipped'])}")
    lines += [
        f"truncated           {_truncated_text(s)}",
        f"sequences / packs   {s['sequences']:,} / {s['packs']:,} (pack size {s['pack_size']:,}, "
        f"pad multiple {s['pad_seq_to_mult']}, {s['algorithm']})",
        f"tokens              {s['tokens']:,} ({s['padding_tokens']:,} padding), trainable "
        f"{s['trainable_tokens']:,} ({100 * s['trainable_share']:.1f}%)",
        f"packing efficiency  {100 * s['packing_efficiency']:.2f}%",
    ]
    policy = s.get("loss_policy")
    if policy:
        lines.append(f"loss                {s.get('loss_on', 'assistant')}; tool calls {policy['tool_calls']}, "
                     f"reasoning {policy['reasoning']}, empty reasoning {policy['empty_reasoning']}")
    for name, sp in s["splits"].items():
        shards = sp["shards"]
        size = f", {human_bytes(sp['bytes'])}" if sp.get("bytes") else ""
        lines.append(f"split {name:<13} {plural(sp['conversations'], 'conversation')} -> "
                     f"{plural(sp['packs'], 'pack')} in {plural(len(shards), 'shard')}{size}: "
                     f"{shards[0]}{' ...' if len(shards) > 1 else ''}")
    if s.get("empty_splits"):
        lines.append(f"empty splits        {', '.join(s['empty_splits'])} (too few conversations; not written)")
    if s.get("verify_masks"):
        lines.append(f"verify-masks        {verify_text(s['verify_masks'])}")
    if s.get("check"):
        lines.append(f"check               gate passed on {plural(s['check']['shards'], 'shard')}")
    if s.get("manifests"):
        lines.append(f"manifests           {', '.join(s['manifests'])}")
    if s.get("orders"):
        lines.append(f"balanced orders     {', '.join(s['orders'])}")
    if s.get("mixture"):
        lines += format_mixture(s["mixture"])
    for split, why in (s.get("orders_not_written") or {}).items():
        lines.append(f"no order for {split:<6} {why} (train this split without one)")
    if s.get("store"):
        lines.append(f"sequence store      {s['store']} (repack with repack-sft --store)")
    if s.get("units"):
        busy = (s.get("workers_busy") or {}).get("tokenize")
        lines.append("work units          " + ", ".join(f"{k} {v:,}" for k, v in s["units"].items())
                     + f" ({plural(s.get('workers', 1), 'worker')}"
                     + (f"; tokenize kept them {100 * busy:.0f}% busy)" if busy is not None else ")"))
    resumed = {k: v for k, v in (s.get("resumed_units") or {}).items() if v}
    if resumed:
        lines.append("resumed             " + ", ".join(f"{k} {plural(v, 'unit')}" for k, v in resumed.items())
                     + " done before")
    seconds = s["seconds"]
    lines.append(f"time                {sum(seconds.values()):.2f} s ("
                 + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()) + ")")
    rss = s["peak_rss_mib"]
    lines.append(f"peak RSS            main {rss['main']:,.0f} MiB, workers {rss['workers_max']:,.0f} MiB")
    return "\n".join(lines)


def _truncated_text(s: dict) -> str:
    text = f"{s['truncated']:,}"
    cut = s.get("truncated_turns_cut") or 0
    if s["truncated"]:
        mode = s.get("truncated_turn_loss", "keep")
        what = "loss kept on the tokens before the cut" if mode == "keep" else "the cut reply masked"
        text += f", {cut:,} cut inside an assistant reply ({what}: --truncated-turn-loss {mode})"
    return text


def format_plan_summary(s: dict) -> str:
    """The summary of ``repack-sft --plan-only`` as the command prints it."""
    lines = [f"plan                {s['plan']}: {plural(s['conversations'], 'conversation')}, "
             f"{s['truncated']:,} truncated"]
    for name, sp in s["splits"].items():
        lines.append(f"split {name:<13} {plural(sp['conversations'], 'conversation')} -> "
                     f"{plural(sp['packs'], 'pack')} in {plural(sp['shards'], 'shard')}, "
                     f"efficiency {100 * sp['packing_efficiency']:.2f}%")
    if s.get("mixture"):
        lines += format_mixture(s["mixture"])
    return "\n".join(lines)


def verify_text(v: dict) -> str:
    """``"20 conversations OK against their source (trained tokens: assistant 812, tool_call 95)"``, or how
    many of those asked for were checked and why not all."""
    checked, requested = v["checked"], v.get("requested", v["checked"])
    text = f"{plural(checked, 'conversation')} OK"
    if checked < requested:
        why = []
        if v.get("skipped_truncated"):
            why.append(f"{v['skipped_truncated']:,} truncated ones are not sampled (their masks are cut)")
        if v.get("eligible", checked) < requested:
            why.append(f"only {v.get('eligible', checked):,} untruncated conversations were written")
        text = f"{checked:,} of {requested:,} requested conversations OK ({'; '.join(why) or 'fewer written'})"
    roles = v.get("trained_tokens_by_role")
    if roles:
        text += " against their source (trained tokens: " + ", ".join(f"{k} {n:,}" for k, n in roles.items()) + ")"
    if v.get("sample_of_check"):
        text += ", the sample --check takes"
    return text


def decision_warnings(s: dict, threshold_pct: float) -> List[str]:
    """Warnings, with counts and rates, for decisions that touched more than ``threshold_pct``
    percent of the conversations: truncation, and conversations skipped or dropped."""
    out: List[str] = []
    if "skipped" not in s or "conversations" not in s:  # e.g. repack-sft --plan-only
        return out
    kept = s["conversations"]
    skipped = sum(s["skipped"].values())
    seen = kept + skipped
    if not seen:
        return out
    limit = threshold_pct / 100.0
    truncated = s.get("truncated", 0)
    if kept and truncated / kept > limit:
        cut = s.get("truncated_turns_cut") or 0
        mode = s.get("truncated_turn_loss", "keep")
        detail = (f"; {cut:,} of them cut inside an assistant reply, which "
                  + ("keeps its loss with no end-of-turn (--truncated-turn-loss drop masks it)" if mode == "keep"
                     else "was masked (--truncated-turn-loss drop)")) if cut else ""
        out.append(f"{truncated:,} of {kept:,} conversations ({100 * truncated / kept:.1f}%) were truncated to "
                   f"--pack-size {s.get('pack_size', '?')}{detail}; above the {threshold_pct:g}% threshold: "
                   f"raise --pack-size or pass --overlong drop (--warn-above sets the threshold)")
    tail = (f"; above the {threshold_pct:g}% threshold (the summary's skipped_examples name the first of each; "
            f"--warn-above sets the threshold)")
    if "records_skipped" not in s:   # (a summary of an earlier version)
        if skipped / seen > limit:
            out.append(f"{skipped:,} of {seen:,} conversations ({100 * skipped / seen:.1f}%) were not written: "
                       f"{skipped_text(s['skipped'])}{tail}")
        return out
    records_skipped, dropped_by = s.get("records_skipped") or {}, s.get("sequences_dropped") or {}
    bad, read = sum(records_skipped.values()), s.get("records_read")   # (each may be absent: an earlier summary)
    if read and bad / read > limit:
        out.append(f"{bad:,} of {read:,} records ({100 * bad / read:.1f}%) were skipped: "
                   f"{skipped_text(records_skipped)}{tail}")
    dropped, made = sum(dropped_by.values()), s.get("sequences_stored")
    if made and dropped / made > limit:
        out.append(f"{dropped:,} of {made:,} sequences ({100 * dropped / made:.1f}%) were dropped: "
                   f"{skipped_text(dropped_by)}{tail}")
    return out
