"""The gate's entry point: check shards, return a :class:`Report`, never raise for a bad shard.

The numba passes (``content``) are imported on the first check, not with the package, so
that ``check_idx`` handles its signals from the first second (importing numba takes one).

Order of passes for one SFT shard (each skips itself, saying so, when an input
it needs failed an earlier pass):

1. presence of the five files (``.bin``/``.idx`` alone: a pretrain shard);
2. ``.idx`` header, ``.seq.idx`` header, metadata, padding, body CRC;
3. cross-file agreement: counts, dtypes, sizes vs headers vs metadata;
4. CRC-32 of the four data files (a thread, overlapping 5-7; skipped at ``fast``);
5. ``.idx`` arrays: lengths, pointer chain, end of ``.bin``, document indices;
6. CSR offsets of ``.seq.idx``;
7. every pack's invariants, all-zero loss masks, statistics vs metadata;
8. read-back through ``MMapIndexedDataset`` (a sample; every pack at ``deep``).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

from ..errors import ShardError
from ..format import METADATA_FIELD_RANGES
from ..storage import is_remote
from . import structure
from ._context import ShardContext, UnreadableFile
from .discover import resolve_selections
from .readback import read_back
from .report import Report, ShardReport

LEVELS = ("fast", "standard", "deep")
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Options:
    level: str = "standard"
    vocab_size: Optional[int] = None
    strict: bool = False
    allow_pretrain: bool = False
    sample: int = 64


def check(prefixes: Union[PathLike, Sequence[PathLike]], *, level: str = "standard",
          vocab_size: Optional[int] = None, strict: bool = False, allow_pretrain: bool = False,
          sample: int = 64, workers: int = 1) -> Report:
    """Check shards and report every finding.

    Args:
        prefixes: a shard prefix, a glob, a directory (every shard directly in it), or a list of them.
        level: ``"fast"`` (no CRC pass over the data files), ``"standard"``, or
            ``"deep"`` (read every pack back through the reader).
        vocab_size: every token id must be below it (default: the metadata's, if recorded).
        strict: warnings (e.g. a pack whose loss mask is all zero) fail the shard.
        allow_pretrain: a ``.bin``/``.idx``-only shard passes (checked as pretrain data).
        sample: packs read back at ``standard`` level, besides the first and the last.
        workers: shards checked in parallel, one process each.

    Returns:
        the :class:`Report`; ``report.passed`` is the verdict.

    Raises:
        ValueError: an argument is invalid.
        ShardNotFoundError: an entry of ``prefixes`` matches no shard file.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    low, high = METADATA_FIELD_RANGES["vocab_size"]
    if vocab_size is not None and (isinstance(vocab_size, bool) or not low <= int(vocab_size) <= high):
        raise ValueError(f"vocab_size must be an integer in {low}..{high} (docs/FORMAT.md \"Limits\"), "
                         f"not {vocab_size!r}")
    if int(workers) < 1 or int(sample) < 0:
        raise ValueError("workers must be >= 1 and sample >= 0")
    options = Options(level, None if vocab_size is None else int(vocab_size), bool(strict),
                      bool(allow_pretrain), int(sample))
    started = time.perf_counter()
    selections = resolve_selections(prefixes)
    shards = list(dict.fromkeys(p for s in selections for p in s.prefixes))
    if int(workers) > 1 and len(shards) > 1:
        ctx = multiprocessing.get_context("spawn")  # safe beside threads; each worker maps its own files
        # A Pool, not a ProcessPoolExecutor: leaving the block by an exception (Ctrl-C, SIGTERM
        # turned into one by the CLI) terminates the workers instead of waiting for them.
        with ctx.Pool(min(int(workers), len(shards)), initializer=_ignore_sigint) as pool:
            reports = pool.starmap(check_shard, [(prefix, options) for prefix in shards])
    else:
        reports = [check_shard(prefix, options) for prefix in shards]
    by_prefix = {r.prefix: r for r in reports}
    for selection in selections:  # a directory, glob or manifest must hold whole sets
        if selection.kind != "prefix":
            require_whole_sets_found([by_prefix[p] for p in selection.prefixes], selection.source)
    return Report(shards=reports, level=level, options={**asdict(options), "workers": int(workers)},
                  seconds=time.perf_counter() - started)


def require_whole_sets_found(reports: Sequence[ShardReport], source: str) -> None:
    """Fail (``SET_INCOMPLETE``) every shard of a set that ``reports`` (the shards ``source``
    selects) hold only part of, naming the members missing (:func:`megatron_sft_idx.sets.require_whole_sets`).
    Each set is judged alone: a run's directory holds its train, valid and test sets."""
    from ..errors import ShardSetError
    from ..sets import require_whole_sets
    from .report import make_finding

    by_set = {}
    for r in reports:
        if r.shard_set is not None:
            by_set.setdefault(r.shard_set.id, []).append(r)
    for members in by_set.values():
        try:
            require_whole_sets([(r.prefix, r.shard_set) for r in members], source=source, selected_by="manifest")
        except ShardSetError as exc:
            for r in members:
                if "SET_INCOMPLETE" not in r.codes():
                    r.add(make_finding("SET_INCOMPLETE", f"{source}: {exc.message}", r.prefix))


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which terminates them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def check_shard(prefix: str, options: Options = Options()) -> ShardReport:
    """Every pass over one shard. Never raises: an unexpected exception becomes GATE_INTERNAL_ERROR."""
    if is_remote(prefix):  # s3:// and msc://: the same passes over streamed bytes
        from .remote import check_remote_shard
        return check_remote_shard(prefix, options)
    started = time.perf_counter()
    report = ShardReport(prefix=prefix, level=options.level, strict=options.strict)
    ctx = ShardContext(prefix, report)
    try:
        _run(ctx, options)
    except UnreadableFile:
        pass
    except Exception as exc:  # the gate must report, not crash; the shard fails to be safe
        ctx.add("GATE_INTERNAL_ERROR", f"{exc.__class__.__name__}: {exc}")
    finally:
        ctx.close()
    report.seconds = time.perf_counter() - started
    return report


def _run(ctx: ShardContext, options: Options) -> None:
    report = ctx.report
    if not structure.locate_files(ctx, options.allow_pretrain):
        return
    report.checks.append("presence")
    structure.index_header_pass(ctx)
    if report.kind == "pretrain":
        _run_pretrain(ctx, options)
        return
    vocab = structure.seq_header_pass(ctx, options.vocab_size)
    crc_job = _start_checksums(ctx, options)
    try:
        _run_arrays(ctx, vocab, options)
    finally:
        if crc_job is not None:
            pool, future = crc_job
            for code, message, suffix, offset in future.result():
                ctx.add(code, message, suffix, offset=offset)
            pool.shutdown()
            report.checks.append("checksums")


def _run_arrays(ctx: ShardContext, vocab: Optional[int], options: Options) -> None:
    from . import content

    report = ctx.report
    if ctx.idx_arrays_ok:
        content.check_idx_arrays(ctx)
        report.checks.append("idx-arrays")
    else:
        ctx.skip("pointer/length pass", "the .idx header or size is wrong")
    if ctx.csr_ok:
        content.check_offsets(ctx)
        report.checks.append("csr-offsets")
        if ctx.seq_header.has_sources:
            content.check_sources(ctx)
            report.checks.append("sources")
    else:
        ctx.skip("CSR offsets pass", "the .seq.idx header or size is wrong")
    if ctx.pointers_ok and ctx.offsets_ok and ctx.sizes_ok:
        content.scan(ctx, vocab)
        report.checks.append("packs")
        if _bridge_alignment_padding(ctx):
            report.checks.append("bridge-alignment-padding")
        if ctx.headers_clean:
            read_back(ctx, options.sample, options.level == "deep")
            report.checks.append("read-back-all" if options.level == "deep" else "read-back-sample")
        else:
            ctx.skip("read-back", "the reader refuses the header/metadata findings reported above")
    else:
        ctx.skip("pack scan and read-back", "an earlier structural finding makes the arrays untrustworthy")


#: Tokens per chunk of the alignment-padding pass (whole packs, bounded memory).
_ALIGN_CHUNK_TOKENS = 1 << 20


def _bridge_alignment_padding(ctx: ShardContext) -> bool:
    """``BRIDGE_ALIGNMENT_PADDING_TRAINED`` for a shard converted from Bridge's packer with CP
    padding whose stored mask trains EOS alignment padding (the EOS id is the one the conversion
    recorded). False when the pass does not apply (not such a shard, no EOS id, pack errors)."""
    import numpy as np

    from ..format import LOSS_SUFFIX
    from ..legacy import consumer_loss_counts, converted_eos_id, converted_loss_state

    meta = ctx.metadata
    if meta is None or converted_loss_state(meta) is None or int(meta.pad_seq_to_mult or 1) <= 1:
        return False
    eos = converted_eos_id(meta)
    if eos is None or any(f.severity == "error" for f in ctx.report.findings):
        return False
    lengths = np.asarray(ctx.lengths(), dtype=np.int64)
    offsets = np.asarray(ctx.seq_offsets(), dtype=np.int64)
    token_off = np.concatenate(([0], np.cumsum(lengths)))
    tokens, loss, starts = ctx.tokens(), ctx.loss(), ctx.seq_starts()
    total, first, a = 0, None, 0
    while a < lengths.shape[0]:
        b = min(lengths.shape[0], max(a + 1, int(np.searchsorted(token_off, token_off[a] + _ALIGN_CHUNK_TOKENS,
                                                                  side="right")) - 1))
        lo, hi = int(token_off[a]), int(token_off[b])
        part = consumer_loss_counts(tokens[lo:hi], loss[lo:hi], starts[offsets[a]:offsets[b]],
                                    offsets[a:b + 1] - offsets[a], lengths[a:b], eos_id=eos,
                                    pad_seq_to_mult=int(meta.pad_seq_to_mult))
        total += part["alignment_padding_trained"]
        if first is None and part["first_alignment_pack"] is not None:
            first = a + part["first_alignment_pack"]
        ctx.release(LOSS_SUFFIX, lo, hi)
        a = b
    if total:
        ctx.add("BRIDGE_ALIGNMENT_PADDING_TRAINED", f"{total:,} positions of EOS alignment padding (EOS id {eos}) "
                f"carry loss 1, first in pack {first}", LOSS_SUFFIX, pack=first)
    return True


def _start_checksums(ctx: ShardContext, options: Options):
    if options.level == "fast":
        ctx.add("CHECKSUMS_SKIPPED", "level fast: CRC-32 of .bin/.idx/.loss.bin/.seq.bin not verified "
                "(the .seq.idx header and body CRCs were)")
        return None
    if ctx.metadata is None:
        ctx.add("CHECKSUMS_SKIPPED", "no readable metadata to compare CRC-32s with")
        return None
    from . import content

    pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gate-crc")
    return pool, pool.submit(content.checksums, ctx)


def _run_pretrain(ctx: ShardContext, options: Options) -> None:
    from . import content

    report = ctx.report
    ctx.add("CHECKSUMS_SKIPPED", "pretrain shard: no metadata records checksums")
    vocab = structure.cross_check(ctx, options.vocab_size)
    ctx.headers_clean = not any(f.severity == "error" and f.code != "PRETRAIN_SHARD" for f in report.findings)
    if report.packs is not None and ctx.idx_header is not None:
        report.tokens = ctx.sizes.get(".bin", 0) // ctx.idx_header.dtype.itemsize
    if not ctx.idx_arrays_ok:
        ctx.skip("pointer/length pass", "the .idx header or size is wrong")
        return
    content.check_idx_arrays(ctx)
    report.checks.append("idx-arrays")
    if not ctx.pointers_ok:
        ctx.skip("token scan and read-back", "the pointer pass failed")
        return
    content.scan_pretrain_tokens(ctx, vocab)
    report.checks.append("tokens")
    if not ctx.headers_clean:
        ctx.skip("read-back", "the reader refuses the header findings reported above")
        return
    read_back(ctx, options.sample, options.level == "deep")
    report.checks.append("read-back-all" if options.level == "deep" else "read-back-sample")


__all__ = ["check", "check_shard", "Options", "LEVELS", "ShardError"]
