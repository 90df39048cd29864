"""``convert-packed INPUT OUTPUT`` (also ``tools/convert_packed.py``): packed formats <-> shards.

Exit status: 0 converted; 1 refused (malformed input, a pack breaking an invariant: nothing
written); 2 usage error, a missing input, an existing output or a missing optional dependency.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..format import ALL_SUFFIXES, PAD_LAYOUTS
from ..packing import ALGORITHMS, DEFAULT_ALGORITHM
from ..storage.urls import local_only, url_refusal
from .. import _cli
from .convert import OVERLONG, SOURCE_FORMATS, TARGETS, ConvertOptions, ConvertResult, convert, detect_source

_LABELS = {"npy": "legacy .npy", "parquet": "packed Parquet", "option-a": "Option A directory",
           "pretrain": "upstream pretrain .bin/.idx", "shard": "shard(s)"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert-packed",
        description="Convert packed SFT data between Megatron-Bridge's legacy .npy, packed Parquet, the RFC's "
                    "Option A memmap directory, upstream pretrain .bin/.idx and megatron_sft_idx shards. "
                    "Formats are inferred from the paths. Exit 0 = converted, 1 = refused, 2 = usage error.")
    p.add_argument("input", metavar="INPUT", help="a .npy, a .parquet (file, directory or glob), an Option A "
                   "directory, a pretrain .bin/.idx prefix, or shards (prefix, glob, directory, manifest)")
    p.add_argument("output", metavar="OUTPUT", help="a shard prefix, or a .parquet file; local or s3://bucket/... / "
                   "msc://profile/... (staged locally, gated, uploaded .idx last)")
    p.add_argument("--from", dest="source_format", choices=SOURCE_FORMATS, default=None,
                   help="the input format (default: inferred from the path)")
    p.add_argument("--to", choices=TARGETS, default=None, help="the output format (default: parquet for a "
                   ".parquet/.pq OUTPUT, else shard)")
    p.add_argument("--pack-size", type=int, default=None, metavar="N",
                   help="pack size of the shard (required for pretrain input; default for .npy/Parquet: "
                        "recorded by --to parquet, else the longest pack)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N", help="every token id must be < N")
    p.add_argument("--pad-seq-to-mult", type=int, default=None, metavar="M",
                   help="the multiple the producer padded sequences to (.npy/Parquet; checked on every sequence)")
    p.add_argument("--pad-layout", choices=PAD_LAYOUTS, default=None,
                   help=".npy/Parquet: which length the multiple applies to (default runtime, as Megatron-Bridge pads)")
    p.add_argument("--eos-id", type=int, default=None, metavar="ID",
                   help=".npy/Parquet: Bridge's EOS id, recorded in the shard's metadata (the loss mask is kept "
                        "as Bridge wrote it; each consumer's reader applies its own rule at EOS inputs)")
    pre = p.add_argument_group("pretrain input (each document becomes one sequence, loss on all tokens)")
    pre.add_argument("--packing-algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    pre.add_argument("--seed", type=int, default=0, help="seed of first_fit_shuffle (default 0)")
    pre.add_argument("--overlong", choices=OVERLONG, default="error",
                     help="a document longer than the pack size: error (default), truncate or drop")
    pq = p.add_argument_group("Parquet output")
    pq.add_argument("--row-group-size", type=int, default=500, metavar="N", help="packs per row group (500)")
    pq.add_argument("--pack-metadata", metavar="PATH", default=None,
                    help="also write Bridge's packing-metadata JSON (for pad_cu_seqlens) to PATH")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--staging-dir", default=None, metavar="DIR",
                   help="where an s3:// or msc:// OUTPUT is written before its upload (default: the system's "
                        "temporary directory; needs room for the whole output)")
    p.add_argument("--check", action="store_true", help="run the promotion gate on the shard written")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the result as JSON")
    out.add_argument("-q", "--quiet", action="store_true", help="errors only: print nothing on success")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the conversion decides")
    return p


def _usage_problem(args) -> Optional[str]:
    for flag in ("pack_size", "vocab_size", "pad_seq_to_mult", "row_group_size"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            return f"--{flag.replace('_', '-')} must be positive"
    if args.to != "parquet" and not args.output.endswith((".parquet", ".pq")) and args.output.endswith(ALL_SUFFIXES):
        return f"OUTPUT is a shard prefix: drop the file suffix from {args.output!r}"
    return (local_only([("--staging-dir", args.staging_dir)])
            or url_refusal([("OUTPUT", args.output, False), ("INPUT", args.input, True)]) or None)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = _cli.start(parser, argv)
    if isinstance(args, int):
        return args
    problem = _usage_problem(args)
    if problem:
        return _cli.usage_error(parser, problem)

    def body() -> int:
        kind = args.source_format or detect_source(args.input)
        if kind == "pretrain" and not args.pack_size:
            return _cli.usage_error(parser, "pretrain input is packed while converting: pass --pack-size N")
        options = ConvertOptions(pack_size=args.pack_size, vocab_size=args.vocab_size,
                                 pad_seq_to_mult=args.pad_seq_to_mult, pad_layout=args.pad_layout,
                                 eos_id=args.eos_id, algorithm=args.packing_algorithm,
                                 seed=args.seed, overlong=args.overlong, row_group_size=args.row_group_size,
                                 pack_metadata=args.pack_metadata, overwrite=args.overwrite,
                                 staging_dir=args.staging_dir)
        result = convert(args.input, args.output, source_format=kind, to=args.to, options=options)
        with _cli.published(result.output):
            return _report(args, result)

    return _cli.run(parser.prog, body)


def _report(args, result: ConvertResult) -> int:
    gate = _check(result) if args.check else None
    if args.json:
        _cli.emit(json.dumps(_to_dict(result, gate), indent=2, sort_keys=True))
    elif not args.quiet:
        _cli.emit(format_result(result, args.input, gate))
    return _cli.EXIT_OK if gate is None or gate.passed else _cli.EXIT_FAIL


def _check(result: ConvertResult):
    from ..gate import check   # (start-up: the gate's kernels load only with --check)

    if result.target != "shard":
        return None
    report = check(result.output)
    if not report.passed:
        print(report.format_text(), file=sys.stderr)
    return report


def _to_dict(result: ConvertResult, gate) -> dict:
    return {"from": result.source_format, "to": result.target, "output": result.output, "packs": result.packs,
            "seconds": round(result.seconds, 3), "details": result.details, "notes": result.notes,
            "gate_passed": None if gate is None else gate.passed,
            "metadata": result.metadata.to_dict() if result.metadata else None}


def format_result(result: ConvertResult, source: str, gate) -> str:
    lines = [f"converted {_LABELS[result.source_format]} {source} -> {result.target} {result.output}"]
    m = result.metadata
    if m is not None:
        s = m.stats
        lines.append(f"  packs       {s.pack_count:,} ({s.sequence_count:,} sequences, {s.token_count:,} tokens, "
                     f"{m.token_dtype}), pack size {m.pack_size}, trainable {s.loss_token_count / s.token_count:.1%}")
    else:
        lines.append(f"  packs       {result.packs:,} in {result.details.get('row_groups', 0):,} row group(s)")
    for key, value in sorted(result.details.items()):
        if key not in ("row_groups", "files", "packs") and value:
            lines.append(f"  {key.replace('_', ' '):<11} {value:,}")
    if gate is not None:
        lines.append(f"  gate        {'PASS' if gate.passed else 'FAIL'}")
    lines.append(f"  time        {result.seconds:.2f} s")
    lines += [f"  note        {n}" for n in result.notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
