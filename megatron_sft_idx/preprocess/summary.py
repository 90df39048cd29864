"""The run summary (what ``--json`` prints and ``--summary-json`` writes), from receipts alone."""

from __future__ import annotations

import resource
from typing import Dict, List, Optional

from .pack_stage import PackJob, PackResult
from .store import SequenceStore


def peak_rss_mib(receipts: List[dict]) -> Dict[str, float]:
    """This process's peak RSS, and the largest of its children's and of the receipts' (Ray
    workers report their own)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
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


def build_summary(store: SequenceStore, job: PackJob, result: PackResult, times: Dict[str, float],
                  workers: int, engine: dict, resumed: Dict[str, int], kept_store: Optional[str]) -> dict:
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
    return {
        "inputs": [{"name": i["name"]} for i in store.inputs],
        "records_read": sum(r["records"] for r in store.receipts),
        "conversations": result.plan["conversations"],
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
        "loss_on": encode["loss_on"], "workers": workers, "engine": engine,
        "splits": splits,
        "empty_splits": result.plan["empty_splits"],
        "outputs": finals,
        "manifests": [path for path, _ in result.staged.manifests],
        "store": kept_store,
        "resumed_units": resumed,
        "verify_masks": result.verify, "check": result.gate,
        "seconds": {k: round(v, 3) for k, v in times.items()},
        "peak_rss_mib": peak_rss_mib(store.receipts + result.shards),
    }


def _split_of(receipt: dict) -> str:
    return receipt["metadata"]["extra"]["split"]
