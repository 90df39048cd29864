"""``repack-sft``: new packed shards from an existing sequence store, without re-tokenizing.

The store is what ``preprocess_sft --store DIR`` kept. A new pack size, pad multiple
(``--cp/--tp/--sp``), algorithm, seed, split or shard size only re-plans and re-materializes;
the shards are byte-identical to those of a fresh ``preprocess_sft`` with the same inputs and
settings. ``--plan-only PATH`` writes just the pack plan, to serve packs virtually
(:class:`megatron_sft_idx.preprocess.virtual.VirtualPackedDataset`) without writing any token.

Example::

    python tools/repack_sft.py --store /data/sft/store --output-prefix /data/sft/cp4/chat \\
        --pack-size 8192 --cp 4 --split 98,1,1 --workers 8
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from .._progress import configure_logging
from .cli import (add_packing_arguments, add_run_arguments, add_staging_argument, progress_of, run_and_report,
                  usage_problem)
from .errors import output_error


@dataclass
class RepackConfig:
    store: str
    output_prefix: Optional[str]
    pack_size: int = 4096
    algorithm: str = "first_fit_decreasing"
    seed: int = 1234
    overlong: str = "truncate"
    pad_seq_to_mult: int = 1
    pad_layout: str = "stored"
    cp: int = 1
    tp: int = 1
    sp: bool = False
    pad_id: Optional[int] = None
    split: Optional[Sequence[float]] = None
    max_packs_per_shard: Optional[int] = None
    max_shard_bytes: Optional[int] = None
    skip_bad: bool = False
    workers: int = 1
    engine: str = "local"
    ray_address: Optional[str] = None
    resume: bool = False
    overwrite: bool = False
    check: bool = False
    verify_masks: int = 0
    tokenizer: Optional[str] = None
    plan_only: Optional[str] = None
    progress: object = True
    staging_dir: Optional[str] = None  # an s3:// / msc:// output is built here, then uploaded
    truncated_turn_loss: str = "keep"


def _job(cfg: RepackConfig, store):
    from .pack_stage import PackJob
    from .pipeline import check_pad_id, plan_settings, resolve_pad_multiple

    vocab = store.vocab_size
    default_pad = (store.tokenizer or {}).get("pad_id")
    pad_id = check_pad_id(cfg.pad_id if cfg.pad_id is not None else default_pad, vocab)
    mult = resolve_pad_multiple(cfg)
    tokenizer = cfg.tokenizer or store.tokenizer_path
    return PackJob(cfg.output_prefix or "", plan_settings(cfg, mult, vocab), pad_id, vocab, (cfg.cp, cfg.tp, cfg.sp),
                   cfg.overwrite, cfg.check, cfg.verify_masks, tokenizer, cfg.staging_dir)


def repack(cfg: RepackConfig) -> dict:
    """Pack the store ``cfg.store`` again; returns the summary (as ``preprocess_sft``'s).

    Raises:
        ShardError: no complete store, bad settings, existing outputs without overwrite, a
            failed check; OutputError: the filesystem refused a write.
        KeyboardInterrupt, Terminated: interrupted (the work directory stays for --resume).
    """
    from .pipeline import _job_key, execute
    from .receipts import settings_key
    from .store import SequenceStore

    times: Dict[str, float] = {}
    t = time.perf_counter()
    store = SequenceStore(cfg.store)
    job = _job(cfg, store)
    if cfg.plan_only:
        return plan_only(store, job, cfg.plan_only)
    run_key = settings_key({"store_id": store.store_id, "job": _job_key(job)})
    times["inputs"] = time.perf_counter() - t
    def get_store(engine, work, resumed):
        t = time.perf_counter()
        store.verify()   # every partition's checksums, once, before any pack is made from it
        times["verify_store"] = time.perf_counter() - t
        return store

    return execute(job, run_key, cfg.resume, cfg.engine, cfg.workers, cfg.ray_address, get_store, times,
                   cfg.progress, store.directory)


def plan_only(store, job, path: str) -> dict:
    """Write only the pack plan (for virtual packs); returns its summary."""
    from .plan import write_plan

    from ..errors import ShardError
    from ..storage import is_remote

    if is_remote(path):
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


PROG = "repack-sft"
DESCRIPTION = """\
New packed shards from a sequence store kept by preprocess-sft --store, without tokenizing again.

A new pack size, pad multiple (--cp/--tp/--sp), algorithm, seed, split or shard size only
plans and writes again; the shards are byte-identical to those of a fresh preprocess-sft with
the same inputs and settings. --plan-only PATH writes just the pack plan, to serve packs
virtually (VirtualPackedDataset) without writing any token.

Example:

  repack-sft --store /data/sft/store --output-prefix /data/sft/cp4/chat \\
      --pack-size 8192 --cp 4 --split 98,1,1 --workers 8
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input and output")
    io.add_argument("--store", required=True, metavar="DIR",
                    help="a sequence store kept by preprocess-sft --store DIR (complete)")
    io.add_argument("--output-prefix", help="output shard prefix, as preprocess-sft's (required unless "
                                            "--plan-only)")
    io.add_argument("--plan-only", metavar="PATH",
                    help="write only the pack plan to PATH (for VirtualPackedDataset); no shards")
    io.add_argument("--tokenizer", metavar="PATH",
                    help="tokenizer for --verify-masks (default: where the store found it)")
    add_staging_argument(io)
    add_packing_arguments(p)
    add_run_arguments(p, "worker processes for writing shards (local engine) (default: 1)")
    return p


def _config(args) -> RepackConfig:
    return RepackConfig(
        store=args.store, output_prefix=args.output_prefix, pack_size=args.pack_size,
        algorithm=args.packing_algorithm, seed=args.seed, overlong=args.overlong,
        pad_seq_to_mult=args.pad_seq_to_mult, pad_layout=args.pad_layout, cp=args.cp, tp=args.tp, sp=args.sp, pad_id=args.pad_id,
        split=args.split, max_packs_per_shard=args.max_packs_per_shard, max_shard_bytes=args.max_shard_bytes,
        skip_bad=args.skip_bad, workers=args.workers, engine=args.engine, ray_address=args.ray_address,
        resume=args.resume, overwrite=args.overwrite, check=args.check, verify_masks=args.verify_masks,
        tokenizer=args.tokenizer, plan_only=args.plan_only, progress=progress_of(PROG, args),
        staging_dir=args.staging_dir, truncated_turn_loss=args.truncated_turn_loss)


def format_plan_summary(s: dict) -> str:
    from .._units import plural

    lines = [f"plan                {s['plan']}: {plural(s['conversations'], 'conversation')}, "
             f"{s['truncated']:,} truncated"]
    for name, sp in s["splits"].items():
        lines.append(f"split {name:<13} {plural(sp['conversations'], 'conversation')} -> "
                     f"{plural(sp['packs'], 'pack')} in {plural(sp['shards'], 'shard')}, "
                     f"efficiency {100 * sp['packing_efficiency']:.2f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(PROG, args.verbose, args.quiet)
    if not args.output_prefix and not args.plan_only:
        parser.error("--output-prefix is required (or --plan-only PATH)")
    problem = usage_problem(args)
    if problem:
        parser.error(problem)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    formatter = format_plan_summary if args.plan_only else None
    return run_and_report(PROG, repack, _config(args), args, formatter)
