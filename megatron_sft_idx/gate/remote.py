"""The gate on a shard in object storage, and promotion into a bucket.

:func:`check_remote_shard` runs the same passes as a local check, with the same
finding codes, without downloading the data files to disk:

* presence and sizes from one listing of the five objects;
* the index files (``.idx``, ``.seq.idx``, ``.seq.bin``) are read into memory and go
  through the header, metadata, cross-file, pointer-chain and CSR passes unchanged;
* ``.bin`` and ``.loss.bin`` are streamed once, in chunks of whole packs: each chunk
  updates the running CRC-32 of both files and is scanned for every pack invariant
  by the same numba kernel, so memory stays at one chunk whatever the shard's size;
* the read-back opens the shard through the remote reader and compares a sample of
  packs (every pack at ``deep``) with the bytes fetched directly.

Promotion into a bucket is :func:`.promote.promote` with an object-store destination (one
code path with a local one: :mod:`megatron_sft_idx.storage.destination`).
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import numpy as np

from .._crc import crc32
from ..errors import RemoteStorageError, ShardError, ShardNotFoundError
from ..format import BIN_SUFFIX, CHECKSUMMED_SUFFIXES, LOSS_SUFFIX, PUBLISH_ORDER
from ..reader import MMapIndexedDataset
from ..storage.config import StorageConfig
from ..storage.objects import store_for
from ..storage.urls import ObjectURL
from . import content, structure
from ._context import ShardContext, UnreadableFile
from .readback import sample_indices
from .report import ShardReport, make_finding

#: Tokens per streamed chunk (x itemsize + 1 bytes of memory): whole packs, about this many.
CHUNK_TOKENS = 16 << 20

__all__ = ["check_remote_shard"]


class RemoteShardContext(ShardContext):
    """A :class:`ShardContext` whose index files are read from the store into memory."""

    def __init__(self, prefix: str, report: ShardReport, config: StorageConfig) -> None:
        super().__init__(prefix, report)
        self.url = ObjectURL.parse(prefix)
        self.store = store_for(self.url, config)
        self.infos = {}
        self._bytes: Dict[str, bytes] = {}

    def locate(self, allow_pretrain: bool) -> bool:
        self.infos = self.store.stat_files(self.url, PUBLISH_ORDER)
        self.sizes = {s: i.size for s, i in self.infos.items()}
        self.report.identity = {s: (i.size, i.etag) for s, i in self.infos.items()}
        return structure.classify_files(self, allow_pretrain)

    def _whole(self, suffix: str) -> bytes:
        if suffix not in self._bytes:
            if suffix in (BIN_SUFFIX, LOSS_SUFFIX):
                raise ShardError("data files are streamed, never held whole", path=self.path(suffix))
            info = self.infos[suffix]
            try:
                self._bytes[suffix] = b"".join(self.store.read_chunks(self.url.with_suffix(suffix), info.size,
                                                                      info.etag))
            except RemoteStorageError as exc:
                self.add("FILE_UNREADABLE", f"cannot read: {exc.message}", suffix)
                raise UnreadableFile(suffix) from None
        return self._bytes[suffix]

    def read(self, suffix: str, size: int, offset: int = 0) -> bytes:
        return self._whole(suffix)[offset:offset + size]

    def map(self, suffix: str) -> np.ndarray:
        return np.frombuffer(self._whole(suffix), dtype=np.uint8)

    def identity(self, suffix: str) -> tuple:
        info = self.infos[suffix]
        return (info.size, info.etag)


def check_remote_shard(prefix: str, options, config: Optional[StorageConfig] = None) -> ShardReport:
    """Every pass over one remote shard (see the module doc). Never raises."""
    started = time.perf_counter()
    report = ShardReport(prefix=prefix, level=options.level, strict=options.strict)
    try:
        ctx = RemoteShardContext(prefix, report, StorageConfig.resolve(config))
        _run(ctx, options)
    except UnreadableFile:
        pass
    except (RemoteStorageError, ShardNotFoundError) as exc:  # the store failed us, not the shard
        report.add(_unreadable(exc, prefix))
    except Exception as exc:  # the gate must report, not crash; the shard fails to be safe
        report.add(_internal(exc, prefix))
    report.seconds = time.perf_counter() - started
    return report


def _unreadable(exc: ShardError, prefix: str):
    return make_finding("FILE_UNREADABLE", exc.message, exc.path or prefix)


def _internal(exc: Exception, prefix: str):
    return make_finding("GATE_INTERNAL_ERROR", f"{exc.__class__.__name__}: {exc}", prefix)


def _run(ctx: RemoteShardContext, options) -> None:
    report = ctx.report
    if not ctx.locate(options.allow_pretrain):
        return
    report.checks.append("presence")
    structure.index_header_pass(ctx)
    if report.kind == "pretrain":
        ctx.add("CHECK_SKIPPED", "remote pretrain shards are checked for presence and headers only")
        return
    vocab = structure.seq_header_pass(ctx, options.vocab_size)
    _index_checksums(ctx, options)
    if ctx.idx_arrays_ok:
        content.check_idx_arrays(ctx)
        report.checks.append("idx-arrays")
    if ctx.csr_ok:
        content.check_offsets(ctx)
        report.checks.append("csr-offsets")
        if ctx.seq_header.has_sources:
            content.check_sources(ctx)
            report.checks.append("sources")
    if not (ctx.pointers_ok and ctx.offsets_ok and ctx.sizes_ok):
        ctx.skip("streamed pack scan and read-back", "an earlier structural finding makes the arrays untrustworthy")
        return
    _stream_scan(ctx, vocab, options)
    report.checks.append("packs+checksums (streamed)" if options.level != "fast" else "packs (streamed)")
    if not ctx.headers_clean:
        ctx.skip("read-back", "the reader refuses the header/metadata findings reported above")
    elif report.count("error"):  # the remote reader verifies the cached index files' CRCs and refuses them
        ctx.skip("read-back", "the remote reader refuses a shard whose files do not match their checksums")
    else:
        _read_back(ctx, options)


def _index_checksums(ctx: RemoteShardContext, options) -> None:
    """CRC-32 of ``.idx`` and ``.seq.bin`` (already in memory) against the metadata."""
    if options.level == "fast" or ctx.metadata is None:
        return
    for suffix in CHECKSUMMED_SUFFIXES:
        if suffix in (BIN_SUFFIX, LOSS_SUFFIX):
            continue  # streamed below
        recorded = ctx.metadata.files[suffix]
        if ctx.sizes.get(suffix) == recorded.size:
            _compare_crc(ctx, suffix, crc32(ctx.map(suffix)), recorded.crc32)


def _compare_crc(ctx, suffix: str, crc: int, recorded: int) -> None:
    if crc != recorded:
        ctx.add("CHECKSUM_MISMATCH", f"CRC-32 is {crc:#010x}, the metadata records {recorded:#010x}", suffix)


def _stream_scan(ctx: RemoteShardContext, vocab: Optional[int], options) -> None:
    """One pass over ``.bin`` and ``.loss.bin`` in chunks of whole packs: CRC + pack invariants."""
    meta, h = ctx.metadata, ctx.idx_header
    itemsize = h.dtype.itemsize
    lengths, pointers, offsets, starts = ctx.lengths(), ctx.pointers(), ctx.seq_offsets(), ctx.seq_starts()
    token_offsets = pointers // itemsize
    n = h.sequence_count
    agg = content.ScanAggregate(ctx, vocab)
    crcs = {BIN_SUFFIX: 0, LOSS_SUFFIX: 0}
    for first, last in content.data_chunks(pointers, lengths, itemsize, n, CHUNK_TOKENS):
        t0 = int(token_offsets[first])
        t1 = int(token_offsets[last - 1]) + int(lengths[last - 1])
        raw = {s: ctx.store.read_range(ctx.url.with_suffix(s), t0 * (itemsize if s == BIN_SUFFIX else 1),
                                       (t1 - t0) * (itemsize if s == BIN_SUFFIX else 1), ctx.infos[s].etag)
               for s in (BIN_SUFFIX, LOSS_SUFFIX)}
        for suffix, data in raw.items():
            crcs[suffix] = crc32(data, crcs[suffix])
        tokens = np.frombuffer(raw[BIN_SUFFIX], dtype=h.dtype.numpy)
        loss = np.frombuffer(raw[LOSS_SUFFIX], dtype=np.uint8)
        agg.scan(first, lengths[first:last], token_offsets[first:last] - t0, t0, offsets[first:last + 1], tokens,
                 loss, starts)
    agg.report(token_offsets, n, int(starts.shape[0]), int(token_offsets[-1] + lengths[-1]) if n else 0)
    if options.level != "fast":
        for suffix in (BIN_SUFFIX, LOSS_SUFFIX):
            _compare_crc(ctx, suffix, crcs[suffix], meta.files[suffix].crc32)


def _read_back(ctx: RemoteShardContext, options) -> None:
    """Packs through the remote reader equal the bytes fetched directly (a sample; all at deep)."""
    try:
        ds = MMapIndexedDataset(ctx.prefix)
    except ShardError as exc:
        ctx.add("READER_REFUSED", f"the remote reader refused to open it: {exc}")
        return
    n = ctx.idx_header.sequence_count
    idx = sample_indices(n, options.sample, options.level == "deep")
    itemsize = ctx.idx_header.dtype.itemsize
    lengths, pointers, offsets, starts = ctx.lengths(), ctx.pointers(), ctx.seq_offsets(), ctx.seq_starts()
    for i, pack in zip(idx.tolist(), ds.get_many(idx)):
        t0, n_i = int(pointers[i]) // itemsize, int(lengths[i])
        want = (np.frombuffer(ctx.store.read_range(ctx.url.with_suffix(BIN_SUFFIX), t0 * itemsize, n_i * itemsize,
                                                   ctx.infos[BIN_SUFFIX].etag), dtype=ctx.idx_header.dtype.numpy),
                np.frombuffer(ctx.store.read_range(ctx.url.with_suffix(LOSS_SUFFIX), t0, n_i,
                                                   ctx.infos[LOSS_SUFFIX].etag), dtype=np.uint8),
                starts[int(offsets[i]):int(offsets[i + 1])])
        for name, got, exp in zip(("input_ids", "loss_mask", "seq_start_id"), pack, want):
            if not np.array_equal(got, exp):
                ctx.add("READBACK_MISMATCH", f"{name} read through the remote reader differs from the object's "
                        "bytes", pack=i)
                break
    ctx.report.checks.append("read-back-all" if options.level == "deep" else "read-back-sample")
