"""Merge shards into one: the concatenation of their packs, streaming, gated, atomic.

    from megatron_sft_idx.tools.merge import merge_shards
    result = merge_shards("/data/all", ["/data/part_*", "/data/more.json"])

How it stays flat in memory and fast:

* The data files (``.bin``, ``.loss.bin``, ``.seq.bin``) are concatenated with
  ``copy_file_range`` (:mod:`._copy`): their bytes never enter Python. Sequence
  starts are pack-local, so ``.seq.bin`` concatenates unchanged too.
* Only the indexes change: each input's lengths are copied, its pointers and CSR
  offsets are recomputed from the lengths and counts by the numba offset kernel
  (``_kernels.exclusive_cumsum``: int64, overflow refused), ``CHUNK_PACKS`` packs at a
  time, written at their final place in the output ``.idx`` and in a CSR spool. The
  input's own pointers and offsets are checked against the recomputed ones first.
* Checksums: the CRC-32 of a concatenation is combined from the inputs' recorded
  CRCs (``crc32_combine``), so no data file is read to checksum it; the index
  sections are checksummed as they are written.
* Statistics: counts and shapes come from the indexes; ``loss_token_count`` from
  the inputs' metadata.

Nothing is trusted blindly: the output is checked by the promotion gate
(:func:`megatron_sft_idx.gate.check`: every CRC, every pack, every statistic,
recomputed from the bytes) in the output's staging area (a hidden directory next to a local
output, a local temporary directory for a URL), and published with the builder's commit
(:func:`megatron_sft_idx.publishing.commit_shard`, ``.idx`` last) only if it passes, then read
back. Any failure or interruption leaves nothing under the output's name (a SIGINT or
SIGTERM after the commit point leaves the complete output, and says so); the staging
directory of a killed run is removed by the next run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

from .. import _kernels
from .._signals import raise_if_signalled
from .._crc import crc32, crc32_combine
from ..errors import InvariantError, ShardError, SizeMismatchError
from ..format import (BIN_SUFFIX, IDX_SUFFIX, LENGTH_DTYPE, LOSS_SUFFIX, METADATA_OFFSET, POINTER_DTYPE,
                      SEQ_BIN_SUFFIX, SEQ_IDX_SUFFIX, IdxHeader, SeqIdxHeader, ShardPaths)
from ..metadata import PackingStats, ShardMetadata
from ..reader import MMapIndexedDataset
from ..version import __version__
from ..storage.destination import destination_for
from . import _outputs
from ._copy import copy_range
from .merge_plan import MergePlan, plan_merge


#: Packs whose index entries are handled at once (~90 bytes each in flight: ~23 MiB).
CHUNK_PACKS = 1 << 18
#: Tokens widened uint16 -> int32 at once.
_WIDEN_CHUNK = 1 << 24
_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass
class MergeResult:
    prefix: str
    metadata: ShardMetadata
    inputs: int
    seconds: float
    gate_seconds: float
    copy_methods: Counter
    notes: List[str] = field(default_factory=list)


def merge_shards(output, inputs: Sequence[str], *, widen: bool = False, pack_size: Optional[int] = None,
                 overwrite: bool = False, check_level: str = "standard",
                 progress: Optional[Callable[[int, int], None]] = None,
                 staging_dir: Optional[str] = None) -> MergeResult:
    """Write the concatenation of ``inputs`` (prefixes, globs, directories, manifests) to ``output``.

    ``output`` and ``inputs`` may be ``s3://`` / ``msc://`` URLs: the output is merged into its
    destination's staging area (beside a local output; a local temporary directory for a URL),
    gated, then published ``.idx`` last and read back (:mod:`._outputs`); a remote input is
    downloaded into the staging directory for its turn, then removed.

    Args:
        widen: allow uint16 and int32 inputs together (the output is int32).
        pack_size: the output's pack size (default: the inputs' largest).
        overwrite: replace an existing shard at ``output``.
        check_level: the gate level run on the output before it is published.
        progress: called as ``progress(inputs_done, inputs_total)``.
        staging_dir: where a remote output is staged (default: the system's temporary directory).

    Raises:
        ShardExistsError: ``output`` exists and ``overwrite`` is false.
        IncompatibleShardsError: inputs that cannot become one shard (dtype, convention,
            pad multiple, CP layout, tokenizer).
        ShardError (any subclass): an input is missing, unreadable or corrupt, or the
            output failed the gate; nothing was published. IncompleteDestinationError: the
            output read back after publishing is not whole.
    """
    started = time.perf_counter()
    output = os.fspath(output)
    destination = destination_for(output)
    if not overwrite:
        _outputs.refuse_existing(output, destination)
    plan = plan_merge(inputs, widen=widen, pack_size=pack_size)
    _refuse_output_among_inputs(output, destination, plan.prefixes)
    try:
        with _outputs.marks_published(output, destination), destination.staging(output, staging_dir) as staged:
            staging = os.path.dirname(staged)
            writer = _MergeWriter(staged, plan)
            try:
                for k, prefix in enumerate(plan.prefixes):
                    raise_if_signalled()
                    with destination_for(prefix).local_copy(prefix, os.path.join(staging, "input")) as local:
                        writer.add(local, int(plan.packs[k]))
                    if progress is not None:
                        progress(k + 1, len(plan.prefixes))
                metadata = writer.finish()
            finally:
                writer.close()
            raise_if_signalled()
            gate_started = time.perf_counter()
            _gate(staged, output, check_level)
            gate_seconds = time.perf_counter() - gate_started
            _outputs.publish_staged(staged, output, destination)
    except OSError as exc:  # a full disk, a read-only destination: name the output, not a descriptor
        if isinstance(exc, ShardError) or exc.filename is not None:
            raise
        raise OSError(exc.errno, f"{exc.strerror} (writing the merged shard; nothing was published)",
                      output) from None
    return MergeResult(output, metadata, len(plan.prefixes), time.perf_counter() - started, gate_seconds,
                       writer.copy_methods, plan.notes)


def _refuse_output_among_inputs(output: str, destination, prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        if destination.same(output, prefix):
            raise ShardError("the output prefix is also an input", path=output, field="output",
                             hint="write the merged shard to a new prefix")


def _gate(staged: str, output: str, level: str) -> None:
    """Check the staged output; refuse it (nothing published) unless it passes."""
    _outputs.gate_or_refuse(staged, output, level)


class _MergeWriter:
    """Writes one merged shard under ``staged`` (a prefix inside the staging directory)."""

    def __init__(self, staged: str, plan: MergePlan) -> None:
        self.paths = ShardPaths.from_prefix(staged)
        self.plan = plan
        self.dtype = plan.dtype
        n = plan.totals["packs"]
        self.idx_header = IdxHeader(int(plan.dtype), n, n + 1)
        self.fds = {}
        for suffix, path in self.paths.by_suffix().items():
            self.fds[suffix] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.spool_path = staged + ".csr"
        self.fds["csr"] = os.open(self.spool_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.crc = {s: 0 for s in (BIN_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX, "lengths", "pointers", "csr")}
        self.size = {s: 0 for s in (BIN_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX)}
        self.packs = 0            # packs written so far
        self.bytes = 0            # output .bin bytes so far (pointer base)
        self.sequences = 0        # output .seq.bin values so far (CSR base)
        self.shape = {"max_samples": 0, "min_packed": _INT64_MAX, "max_packed": 0,
                      "min_seqlen": _INT64_MAX, "max_seqlen": 0, "min_runtime": _INT64_MAX}
        self.copy_methods: Counter = Counter()

    # ------------------------------------------------------------------ per input

    def add(self, prefix: str, expected_packs: int) -> None:
        src = MMapIndexedDataset(prefix)
        if len(src) != expected_packs:
            raise SizeMismatchError("the shard changed since the merge was planned (or its manifest is stale)",
                                    path=prefix, field="packs", expected=expected_packs, actual=len(src))
        arrays = src.arrays()
        cursor = {"bytes": 0, "sequences": 0}
        for a in range(0, len(src), CHUNK_PACKS):
            self._index_chunk(src, arrays, a, min(len(src), a + CHUNK_PACKS), cursor)
            src.release_pages()
        if cursor["bytes"] != src.num_tokens * src.dtype.itemsize or cursor["sequences"] != arrays.seq_starts.size:
            raise InvariantError("the index does not cover the data files exactly", path=prefix,
                                 field="sequence_pointers/seq_offsets",
                                 hint="run check-idx on this shard and rebuild it")
        self._copy_data(src)

    def _index_chunk(self, src, arrays, a: int, b: int, cursor: dict) -> None:
        """Check packs [a, b) of ``src``'s indexes, then write their rebased entries."""
        itemsize = src.dtype.itemsize
        lengths = np.array(arrays.sequence_lengths[a:b])
        pointers = np.array(arrays.sequence_pointers[a:b])
        offsets = np.array(arrays.seq_offsets[a:b + 1])
        expected, cursor["bytes"], bad = _kernels.exclusive_cumsum(lengths, itemsize, cursor["bytes"])
        mismatch = np.flatnonzero(expected != pointers)
        counts = np.diff(offsets)
        if bad >= 0 or mismatch.size or offsets[0] != cursor["sequences"] or counts.min() <= 0 \
                or offsets[-1] > arrays.seq_starts.size:
            pack = a + int(bad if bad >= 0 else mismatch[0] if mismatch.size else 0)
            raise InvariantError("the shard's index is corrupt (pointers or CSR offsets are not the "
                                 "cumulative sums of the lengths and counts)", path=src.prefix, pack=pack,
                                 field="sequence_pointers/seq_offsets",
                                 hint="run check-idx on this shard and rebuild it")
        cursor["sequences"] = int(offsets[-1])
        self._write_index(lengths, counts.astype(np.int32))
        seqlens = np.empty(int(offsets[-1] - offsets[0]), dtype=np.int64)
        _kernels.sequence_lengths_of(lengths, offsets, arrays.seq_starts, seqlens)
        shape = self.shape
        shape["max_samples"] = max(shape["max_samples"], int(counts.max()))
        shape["min_packed"] = min(shape["min_packed"], int(lengths.min()))
        shape["max_packed"] = max(shape["max_packed"], int(lengths.max()))
        shape["min_seqlen"] = min(shape["min_seqlen"], int(seqlens.min()))
        shape["max_seqlen"] = max(shape["max_seqlen"], int(seqlens.max()))
        shape["min_runtime"] = min(shape["min_runtime"], int((lengths.astype(np.int64) - counts).min()))

    def _write_index(self, lengths: np.ndarray, counts: np.ndarray) -> None:
        """Lengths and rebased pointers at their place in ``.idx``; rebased CSR ends to the spool."""
        h = self.idx_header
        at = self.packs
        pointers, self.bytes, bad = _kernels.exclusive_cumsum(lengths, self.dtype.itemsize, self.bytes)
        starts, self.sequences, bad_csr = _kernels.exclusive_cumsum(counts, 1, self.sequences)
        if bad >= 0 or bad_csr >= 0:
            raise ShardError("merged offsets overflow int64", path=self.paths.idx, field="sequence_pointers",
                             hint="split the inputs into several merged shards")
        ends = np.append(starts[1:], np.int64(self.sequences))  # seq_offsets[i + 1] of each pack
        lengths = lengths.astype(LENGTH_DTYPE, copy=False)
        os.pwrite(self.fds[IDX_SUFFIX], lengths, h.lengths_offset + LENGTH_DTYPE.itemsize * at)
        os.pwrite(self.fds[IDX_SUFFIX], pointers, h.pointers_offset + POINTER_DTYPE.itemsize * at)
        _write_all(self.fds["csr"], ends)
        self.crc["lengths"] = crc32(lengths, self.crc["lengths"])
        self.crc["pointers"] = crc32(pointers, self.crc["pointers"])
        self.crc["csr"] = crc32(ends, self.crc["csr"])
        self.packs += lengths.size

    def _copy_data(self, src: MMapIndexedDataset) -> None:
        digests = src.metadata.files
        for suffix in (BIN_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX):
            path = src.prefix + suffix
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size != digests[suffix].size:
                    raise SizeMismatchError("file size changed since the shard was opened", path=path,
                                            field="size", expected=digests[suffix].size, actual=size)
                if suffix == BIN_SUFFIX and src.dtype != self.dtype:
                    self._widen(src, path)
                    continue
                self.copy_methods[copy_range(fd, self.fds[suffix], size, src_path=path)] += 1
            finally:
                os.close(fd)
            self.crc[suffix] = crc32_combine(self.crc[suffix], digests[suffix].crc32, size)
            self.size[suffix] += size

    def _widen(self, src: MMapIndexedDataset, path: str) -> None:
        """uint16 tokens -> int32, streamed (the only data this tool reads into Python)."""
        tokens = src.arrays().tokens
        for t in range(0, tokens.size, _WIDEN_CHUNK):
            chunk = np.asarray(tokens[t:t + _WIDEN_CHUNK], dtype=self.dtype.numpy)
            _write_all(self.fds[BIN_SUFFIX], chunk)
            self.crc[BIN_SUFFIX] = crc32(chunk, self.crc[BIN_SUFFIX])
            self.size[BIN_SUFFIX] += chunk.nbytes
            src.release_pages()
        self.copy_methods["widened"] += 1

    # ------------------------------------------------------------------ finishing

    def finish(self) -> ShardMetadata:
        """Write the document indices, the ``.idx`` header and the ``.seq.idx``; return the metadata."""
        n, h = self.packs, self.idx_header
        if n != h.sequence_count or self.bytes != self.size[BIN_SUFFIX]:
            raise ShardError("internal error: merged counts disagree", path=self.paths.idx,
                             expected=(h.sequence_count, self.size[BIN_SUFFIX]), actual=(n, self.bytes))
        idx_fd = self.fds[IDX_SUFFIX]
        docs_crc = 0
        for start in range(0, n + 1, CHUNK_PACKS):
            docs = np.arange(start, min(start + CHUNK_PACKS, n + 1), dtype=POINTER_DTYPE)
            os.pwrite(idx_fd, docs, h.document_indices_offset + POINTER_DTYPE.itemsize * start)
            docs_crc = crc32(docs, docs_crc)
        header = h.pack()
        os.pwrite(idx_fd, header, 0)
        idx_crc = crc32(header)
        for part, nbytes in (("lengths", 4 * n), ("pointers", 8 * n)):
            idx_crc = crc32_combine(idx_crc, self.crc[part], nbytes)
        idx_crc = crc32_combine(idx_crc, docs_crc, 8 * (n + 1))
        metadata = self._metadata(idx_crc)
        self._write_seq_idx(metadata)
        return metadata

    def _metadata(self, idx_crc: int) -> ShardMetadata:
        totals, shape = self.plan.totals, self.shape
        stats = PackingStats.from_counts(
            pack_count=self.packs, sequence_count=self.sequences, token_count=self.bytes // self.dtype.itemsize,
            loss_token_count=totals["loss_tokens"], max_samples_per_bin=shape["max_samples"],
            dataset_max_seqlen=shape["max_seqlen"], min_seqlen=shape["min_seqlen"],
            min_packed_seqlen=shape["min_packed"], max_packed_seqlen=shape["max_packed"],
            min_packed_runtime_len=shape["min_runtime"], pack_size=self.plan.pack_size)
        files = {s: {"size": self.size[s], "crc32": self.crc[s]} for s in (BIN_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX)}
        files[IDX_SUFFIX] = {"size": self.idx_header.file_size, "crc32": idx_crc}
        raw = dict(self.plan.metadata, stats=dataclasses.asdict(stats), files=files,
                   producer={"name": "megatron_sft_idx", "version": __version__}, format="megatron_sft_idx")
        return ShardMetadata.from_dict(raw, path=self.paths.seq_idx)

    def _write_seq_idx(self, metadata: ShardMetadata) -> None:
        """Header, metadata, zero padding, ``seq_offsets[0] = 0``, then the spooled CSR ends."""
        meta = metadata.encode()
        n = self.packs
        stub = SeqIdxHeader(token_dtype_code=int(self.dtype), pack_count=n, sequence_count=self.sequences,
                            token_count=self.bytes // self.dtype.itemsize, metadata_length=len(meta))
        body = meta + b"\0" * (stub.csr_offset - METADATA_OFFSET - len(meta)) + bytes(POINTER_DTYPE.itemsize)
        body_crc = crc32_combine(crc32(body), self.crc["csr"], POINTER_DTYPE.itemsize * n)
        header = SeqIdxHeader(token_dtype_code=int(self.dtype), pack_count=n, sequence_count=self.sequences,
                              token_count=stub.token_count, metadata_length=len(meta), body_crc32=body_crc)
        fd = self.fds[SEQ_IDX_SUFFIX]
        _write_all(fd, header.pack() + body)
        spool = self.fds["csr"]
        copy_range(spool, fd, os.fstat(spool).st_size, src_path=self.spool_path)
        if os.fstat(fd).st_size != header.file_size:
            raise ShardError("internal error: .seq.idx size disagrees with its header", path=self.paths.seq_idx,
                             expected=header.file_size, actual=os.fstat(fd).st_size)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        try:
            os.unlink(self.spool_path)
        except FileNotFoundError:
            pass


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]
