"""Structural passes: which files exist, the two headers, the metadata, and sizes.

Each pass turns the strict parsers' typed errors (``format.IdxHeader.parse``,
``format.SeqIdxHeader.parse``, ``metadata.ShardMetadata.decode``) into findings
and then, where the bytes allow, carries on past them (a header whose only
fault is its CRC or the file's size is still read for its fields) so one run
reports everything that is wrong, not only the first thing.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zlib
from typing import Dict, Optional

from ..errors import DTypeError, MetadataError, MetadataLimitError, ShardError, SizeMismatchError, VersionError
from ..format import (
    BIN_SUFFIX,
    CHECKSUMMED_SUFFIXES,
    IDX_HEADER,
    IDX_HEADER_SIZE,
    IDX_SUFFIX,
    LOSS_SUFFIX,
    METADATA_OFFSET,
    READABLE_TOKEN_DTYPES,
    SEQ_BIN_SUFFIX,
    SEQ_DTYPE,
    SEQ_IDX_HEADER,
    SEQ_IDX_HEADER_CRC_SPAN,
    SEQ_IDX_HEADER_SIZE,
    SEQ_IDX_SOURCES_VERSION,
    SEQ_IDX_SUFFIX,
    SFT_SUFFIXES,
    TOKEN_DTYPES,
    DType,
    IdxHeader,
    SeqIdxHeader,
)
from ..jsondoc import parse_json
from ..metadata import ShardMetadata
from ..packing import pad_multiple_for
from ..sets import parallelism_words
from ._context import ShardContext

IDX_FIELDS = ("magic", "version", "dtype_code", "sequence_count", "document_count")
SEQ_IDX_FIELDS = ("magic", "version_major", "version_minor", "token_dtype_code", "seq_dtype_code",
                  "loss_dtype_code", "flags", "pack_count", "sequence_count", "token_count",
                  "metadata_length", "csr_offset", "body_crc32", "header_crc32")


def field_offsets(layout: struct.Struct, names) -> Dict[str, int]:
    """Byte offset of each named field of a header ``struct.Struct`` (derived, never spelled)."""
    order, body = layout.format[0], layout.format[1:]
    items = re.findall(r"(\d*)([a-zA-Z?])", body)
    offsets, prefix = {}, ""
    for name, (count, code) in zip(names, items):
        offsets[name] = struct.calcsize(order + prefix)
        prefix += count + code
    return offsets


IDX_OFFSETS = field_offsets(IDX_HEADER, IDX_FIELDS)
SEQ_IDX_OFFSETS = field_offsets(SEQ_IDX_HEADER, SEQ_IDX_FIELDS)


def _offset(offsets: Dict[str, int], field: Optional[str]) -> Optional[int]:
    if not field:
        return None
    return offsets.get(field.split("/")[0])


def _describe(exc: ShardError) -> str:
    text = exc.message
    if exc.expected is not None or exc.actual is not None:
        text += f" (expected {exc.expected!r}, found {exc.actual!r})"
    return text


# --------------------------------------------------------------------------- presence


def locate_files(ctx: ShardContext, allow_pretrain: bool) -> bool:
    """Stat the five files and decide the shard's kind. Returns False when nothing can be checked."""
    for suffix, path in ctx.paths.by_suffix().items():
        try:
            st = os.stat(path)  # follows symbolic links: the target is what gets checked and promoted
        except FileNotFoundError:
            continue
        except OSError as exc:
            ctx.add("FILE_UNREADABLE", f"cannot stat: {exc.strerror}", suffix)
            continue
        if not stat.S_ISREG(st.st_mode):
            ctx.add("FILE_UNREADABLE", "not a regular file (a directory or a device?)", suffix)
            continue
        ctx.sizes[suffix] = st.st_size
        ctx.report.identity[suffix] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return classify_files(ctx, allow_pretrain)


def classify_files(ctx: ShardContext, allow_pretrain: bool) -> bool:
    """From ``ctx.sizes`` (the files found): the shard's kind and FILE_MISSING findings."""
    ctx.report.files = dict(ctx.sizes)
    if ctx.report.unreadable:
        return False
    companions = [s for s in SFT_SUFFIXES if s in ctx.sizes]
    missing = [s for s in (BIN_SUFFIX, IDX_SUFFIX) if s not in ctx.sizes]
    if companions:
        ctx.report.kind = "sft"
        missing += [s for s in SFT_SUFFIXES if s not in ctx.sizes]
    for suffix in missing:
        present = ", ".join(sorted(ctx.sizes)) or "nothing"
        ctx.add("FILE_MISSING", f"{os.path.basename(ctx.path(suffix))} is missing (present: {present})", suffix)
    if not companions and not missing:
        ctx.report.kind = "pretrain"
        if allow_pretrain:
            ctx.add("PRETRAIN_SHARD", "upstream pretrain shard (.bin/.idx only): checked as pretrain data",
                    IDX_SUFFIX, severity="info")
        else:
            ctx.add("PRETRAIN_SHARD", "only .bin/.idx exist: this is upstream pretrain data, not an SFT shard",
                    IDX_SUFFIX)
    return not missing


# --------------------------------------------------------------------------- .idx

_IDX_CODES = ((VersionError, "IDX_BAD_VERSION"), (DTypeError, "IDX_BAD_DTYPE"))


def parse_idx(ctx: ShardContext) -> None:
    size = ctx.sizes[IDX_SUFFIX]
    raw = ctx.read(IDX_SUFFIX, IDX_HEADER_SIZE)
    allowed = TOKEN_DTYPES if ctx.report.kind == "sft" else READABLE_TOKEN_DTYPES
    try:
        ctx.idx_header = IdxHeader.parse(raw, ctx.paths.idx, size, allowed_dtypes=allowed)
        ctx.idx_arrays_ok = True
        return
    except ShardError as exc:
        code = _idx_code(exc)
        ctx.add(code, _describe(exc), IDX_SUFFIX, offset=_offset(IDX_OFFSETS, exc.field))
    if code == "IDX_SIZE_MISMATCH":
        # The fields themselves were valid: keep them for the cross-file checks, not the arrays.
        _, _, dtype_code, nseq, ndoc = IDX_HEADER.unpack_from(raw)
        ctx.idx_header = IdxHeader(dtype_code, nseq, ndoc)


def index_header_pass(ctx: ShardContext) -> None:
    """The ``.idx`` header pass of every scan, local or remote: parse it, count the packs."""
    parse_idx(ctx)
    ctx.report.checks.append("idx-header")
    if ctx.idx_header is not None:
        ctx.report.packs = ctx.idx_header.sequence_count


def seq_header_pass(ctx: ShardContext, vocab_size: Optional[int]) -> Optional[int]:
    """The ``.seq.idx`` header, metadata and cross-file passes of every SFT scan, local or
    remote; returns the vocabulary size token ids are checked against (None: unchecked)."""
    report = ctx.report
    parse_seq_idx(ctx)
    report.checks.append("seq-idx-header+metadata")
    vocab = cross_check(ctx, vocab_size)
    report.checks.append("cross-file")
    ctx.headers_clean = report.count("error") == 0
    if ctx.seq_header is not None:
        report.tokens = ctx.seq_header.token_count
    return vocab


def _idx_code(exc: ShardError) -> str:
    for cls, code in _IDX_CODES:
        if isinstance(exc, cls):
            return code
    if exc.field == "magic":
        return "IDX_BAD_MAGIC"
    if exc.field == "header":
        return "IDX_TRUNCATED"
    return "IDX_SIZE_MISMATCH"


# --------------------------------------------------------------------------- .seq.idx


def _seq_code(exc: ShardError) -> str:
    if isinstance(exc, VersionError):
        return "SEQ_IDX_BAD_VERSION"
    if isinstance(exc, DTypeError):
        return "SEQ_IDX_BAD_DTYPE"
    if exc.field == "header":
        return "SEQ_IDX_TRUNCATED"
    if exc.field == "magic":
        return "SEQ_IDX_BAD_MAGIC"
    if exc.field == "header_crc32":
        return "SEQ_IDX_HEADER_CRC"
    if isinstance(exc, SizeMismatchError):  # includes TruncatedFileError
        return "SEQ_IDX_SIZE_MISMATCH"
    return "SEQ_IDX_BAD_HEADER"


def parse_seq_idx(ctx: ShardContext) -> None:
    """Header (carrying on past a bad CRC or size to the fields), metadata, padding, body CRC."""
    size = ctx.sizes[SEQ_IDX_SUFFIX]
    raw = ctx.read(SEQ_IDX_SUFFIX, SEQ_IDX_HEADER_SIZE)
    assumed_size = size
    for _ in range(3):
        try:
            header = SeqIdxHeader.parse(raw, ctx.paths.seq_idx, assumed_size)
        except ShardError as exc:
            code = _seq_code(exc)
            text = _describe(exc) if code != "SEQ_IDX_HEADER_CRC" else (  # a CRC against a record: "records"
                f"header CRC-32 is {exc.actual:#010x}, the header records {exc.expected:#010x}: the header "
                "bytes were modified")
            ctx.add(code, text, SEQ_IDX_SUFFIX, offset=_offset(SEQ_IDX_OFFSETS, exc.field))
            if code == "SEQ_IDX_HEADER_CRC":
                # Read the fields as if the CRC were right, to say which one is wrong too.
                span = raw[:SEQ_IDX_HEADER_CRC_SPAN]
                raw = span + struct.pack("<I", zlib.crc32(span))
                continue
            if code == "SEQ_IDX_SIZE_MISMATCH":
                assumed_size = _seq_idx_size_from_fields(raw)
                continue
            return
        ctx.seq_header = header
        ctx.csr_ok = assumed_size == size
        break
    else:
        return
    newest = SEQ_IDX_SOURCES_VERSION
    if header.version_minor > newest[1]:
        ctx.add("SEQ_IDX_NEWER_MINOR", f"version {header.version_major}.{header.version_minor} is newer than "
                f"{newest[0]}.{newest[1]}", SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS["version_minor"])
    _read_metadata(ctx, header, size)
    _check_body(ctx, header, size)


def _seq_idx_size_from_fields(raw: bytes) -> int:
    fields = dict(zip(SEQ_IDX_FIELDS, SEQ_IDX_HEADER.unpack_from(raw)))
    header = SeqIdxHeader(token_dtype_code=fields["token_dtype_code"], pack_count=fields["pack_count"],
                          sequence_count=fields["sequence_count"], token_count=fields["token_count"],
                          metadata_length=fields["metadata_length"], csr_offset=fields["csr_offset"],
                          flags=fields["flags"])
    return header.file_size


def _read_metadata(ctx: ShardContext, header: SeqIdxHeader, size: int) -> None:
    end = METADATA_OFFSET + header.metadata_length
    if size < end:
        ctx.skip("metadata", f"the file ends at byte {size}, before the metadata's end at {end}")
        return
    raw = ctx.read(SEQ_IDX_SUFFIX, header.metadata_length, METADATA_OFFSET)
    try:
        obj = parse_json(raw, ctx.paths.seq_idx)
    except MetadataLimitError as exc:
        ctx.add("METADATA_LIMIT", exc.message[:200], SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)
        return
    except MetadataError as exc:
        ctx.add("METADATA_UNPARSABLE", f"metadata ({header.metadata_length} bytes): {exc.message[:200]}",
                SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)
        return
    try:
        ctx.metadata = ShardMetadata.from_dict(obj, path=ctx.paths.seq_idx)
    except MetadataError as exc:
        ctx.add("METADATA_INVALID", f"{_describe(exc)} [key {exc.field}]", SEQ_IDX_SUFFIX,
                offset=METADATA_OFFSET)
        return
    _check_recorded_padding(ctx, ctx.metadata)


def _check_recorded_padding(ctx: ShardContext, meta: ShardMetadata) -> None:
    """``PAD_MULTIPLE_BELOW_PARALLELISM``: the recorded parallelism (``cp``, ``tp``, ``sp``, ``fp8``)
    needs a multiple (:func:`~megatron_sft_idx.packing.pad_multiple_for`) the recorded
    ``pad_seq_to_mult`` is not a multiple of; a record the rule cannot read is ``METADATA_INVALID``.
    A shard that records no parallelism (or no multiple) claims nothing to check."""
    par = meta.parallelism
    if not par:
        return
    try:
        need = pad_multiple_for(par.get("cp", 1), par.get("tp", 1), bool(par.get("sp", False)), par.get("fp8"))
    except (ShardError, TypeError, ValueError) as exc:
        ctx.add("METADATA_INVALID", f"parallelism {par!r}: {getattr(exc, 'message', exc)} [key parallelism]",
                SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)
        return
    have = int(meta.pad_seq_to_mult or 1)
    if have % need:
        ctx.add("PAD_MULTIPLE_BELOW_PARALLELISM", f"pad_seq_to_mult is {have}; the recorded parallelism "
                f"({parallelism_words(par)}) needs a multiple of {need}", SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)


#: Bytes of the ``.seq.idx`` body checksummed (and resident) at a time.
_BODY_CHUNK = 16 << 20


def _check_body(ctx: ShardContext, header: SeqIdxHeader, size: int) -> None:
    end = min(size, header.csr_offset)
    pad = ctx.map(SEQ_IDX_SUFFIX)[METADATA_OFFSET + header.metadata_length:end]
    if pad.size and pad.any():
        first = METADATA_OFFSET + header.metadata_length + int(pad.nonzero()[0][0])
        ctx.add("SEQ_IDX_BAD_PADDING", "non-zero byte between the metadata and the CSR offsets",
                SEQ_IDX_SUFFIX, offset=first)
    data = ctx.map(SEQ_IDX_SUFFIX)
    crc = 0
    for start in range(SEQ_IDX_HEADER_SIZE, size, _BODY_CHUNK):  # a chunk resident at a time
        stop = min(size, start + _BODY_CHUNK)
        ctx.populate(SEQ_IDX_SUFFIX, start, stop)
        crc = zlib.crc32(data[start:stop], crc)
        ctx.release(SEQ_IDX_SUFFIX, start, stop)
    if crc != header.body_crc32:
        ctx.add("SEQ_IDX_BODY_CRC", f"body CRC-32 is {crc:#010x}, the header records {header.body_crc32:#010x}",
                SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS["body_crc32"])
    if header.has_sources:   # format 1.2: the bytes between the CSR offsets and the source ids
        end = header.csr_offset + header.csr_nbytes
        gap = data[end:min(size, header.sources_offset)]
        if gap.size and gap.any():
            ctx.add("SEQ_IDX_BAD_PADDING", "non-zero byte between the CSR offsets and the source ids",
                    SEQ_IDX_SUFFIX, offset=end + int(gap.nonzero()[0][0]))


# --------------------------------------------------------------------------- cross-file


def cross_check(ctx: ShardContext, vocab_size: Optional[int]) -> Optional[int]:
    """Counts, dtypes and sizes that must agree across files. Returns the vocab size to check against."""
    ih, sh, meta = ctx.idx_header, ctx.seq_header, ctx.metadata
    ok = ctx.idx_arrays_ok and ctx.csr_ok
    if ih is not None and ctx.report.kind == "sft" and ih.document_count != ih.sequence_count + 1:
        ok = False
        ctx.add("IDX_DOCUMENT_COUNT", f"document_count is {ih.document_count}, expected pack_count + 1 = "
                f"{ih.sequence_count + 1}", IDX_SUFFIX, offset=IDX_OFFSETS["document_count"])
    if ih is not None and sh is not None:
        if ih.sequence_count != sh.pack_count:
            ok = False
            ctx.add("PACK_COUNT_MISMATCH", f".idx holds {ih.sequence_count} packs, .seq.idx {sh.pack_count}",
                    SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS["pack_count"])
        if ih.dtype_code != sh.token_dtype_code:
            ok = False
            ctx.add("DTYPE_MISMATCH", f".idx token dtype code {ih.dtype_code}, .seq.idx "
                    f"{sh.token_dtype_code}", SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS["token_dtype_code"])
    if sh is not None:
        ok &= _sizes_vs_seq_header(ctx, sh)
    if meta is not None:
        _against_metadata(ctx, meta)  # wrong recorded sizes do not make the arrays unsafe to scan
    ctx.sizes_ok = ok and ctx.report.kind == "sft"
    return _vocab(ctx, vocab_size)


def _sizes_vs_seq_header(ctx: ShardContext, sh: SeqIdxHeader) -> bool:
    itemsize = DType(sh.token_dtype_code).itemsize
    expected = ((BIN_SUFFIX, "BIN_SIZE_MISMATCH", sh.token_count * itemsize, "token_count x itemsize"),
                (LOSS_SUFFIX, "LOSS_SIZE_MISMATCH", sh.token_count, "token_count"),
                (SEQ_BIN_SUFFIX, "SEQ_BIN_SIZE_MISMATCH", sh.sequence_count * SEQ_DTYPE.itemsize,
                 "sequence_count x 4"))
    ok = True
    for suffix, code, want, what in expected:
        have = ctx.sizes[suffix]
        if have != want:
            ok = False
            ctx.add(code, f"{have} bytes, but the .seq.idx header's {what} is {want} bytes "
                    f"({'short' if have < want else 'long'} by {abs(want - have)})", suffix,
                    offset=min(have, want))
    return ok


def _against_metadata(ctx: ShardContext, meta: ShardMetadata) -> bool:
    ok = True
    ih, sh = ctx.idx_header, ctx.seq_header
    if ih is not None and DType(ih.dtype_code).name != meta.token_dtype:
        ok = False
        ctx.add("DTYPE_MISMATCH", f"metadata token_dtype is {meta.token_dtype}, .idx says "
                f"{DType(ih.dtype_code).name}", SEQ_IDX_SUFFIX, offset=METADATA_OFFSET)
    if sh is not None and sh.has_sources != (meta.sources is not None):
        ok = False
        ctx.add("SOURCES_MISMATCH", "the .seq.idx header's sources flag is " + ("set" if sh.has_sources else "clear")
                + ", but the metadata " + ("names no sources" if meta.sources is None else "names sources"),
                SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS["flags"])
    if sh is not None:
        for name in ("pack_count", "sequence_count", "token_count"):
            header_value, meta_value = getattr(sh, name), getattr(meta.stats, name)
            if header_value != meta_value:
                ok = False
                ctx.add("METADATA_STATS_MISMATCH", f"stats.{name} is {meta_value}, the header says "
                        f"{header_value}", SEQ_IDX_SUFFIX, offset=SEQ_IDX_OFFSETS[name])
    for suffix in CHECKSUMMED_SUFFIXES:
        recorded, have = meta.files[suffix].size, ctx.sizes[suffix]
        if recorded != have:
            ok = False
            code = "FILE_TRUNCATED" if have < recorded else "FILE_SIZE_MISMATCH"
            ctx.add(code, f"{have} bytes; the metadata records {recorded}", suffix, offset=min(have, recorded))
    return ok


def _vocab(ctx: ShardContext, vocab_size: Optional[int]) -> Optional[int]:
    recorded = ctx.metadata.vocab_size if ctx.metadata is not None else None
    if vocab_size is not None and recorded is not None and vocab_size != recorded:
        ctx.add("VOCAB_DIFFERS_FROM_METADATA", f"checking against --vocab-size {vocab_size}; the metadata "
                f"records {recorded}", SEQ_IDX_SUFFIX)
    chosen = vocab_size if vocab_size is not None else recorded
    if chosen is None and (ctx.metadata is not None or ctx.report.kind == "pretrain"):
        ctx.add("VOCAB_UNKNOWN", "token ids checked only against the token dtype's range",
                SEQ_IDX_SUFFIX if ctx.report.kind == "sft" else IDX_SUFFIX)
    return chosen
