"""``convert(INPUT, OUTPUT)``: between the packed formats users have and shards.

Formats are inferred from the paths (or named with ``source_format`` / ``to``):

===============  ===================================================  ===========
kind             what INPUT is                                        to
===============  ===================================================  ===========
``npy``          Megatron-Bridge's legacy packed ``.npy`` (pickled,   shard
                 read through the factory's restricted unpickler)
``parquet``      Bridge packed Parquet: a file, a directory or glob   shard
``option-a``     the RFC's Option A directory (``manifest.json``       shard
                 with ``format: memmap_padded_v1``)
``pretrain``     upstream megatron-core ``.bin/.idx`` (no SFT files)  shard
``shard``        our shards: prefix, glob, directory or manifest      parquet
===============  ===================================================  ===========

OUTPUT is a shard prefix, or a ``.parquet``/``.pq`` file (``to="parquet"``), local or an
``s3://`` / ``msc://`` URL: it is written into its destination's staging area, gated (a
shard), then published ``.idx`` last and read back (:mod:`._outputs`). INPUT is local. Example::

    convert("/data/train.npy", "/data/shards/train")               # legacy -> shard
    convert("/data/shards/train", "/data/train.parquet")           # shard -> Bridge Parquet
    convert("/data/pretrain_text_document", "/data/sft/pt", pack_size=4096)
    convert("/data/train.npy", "s3://bucket/sft/train")            # staged, gated, uploaded
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob as _glob
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ..builder import IndexedDatasetBuilder
from ..errors import FormatError, ShardNotFoundError
from ..format import IDX_SUFFIX, SFT_SUFFIXES
from ..legacy import conversion_record
from ..metadata import RESERVED_KEYS, ShardMetadata
from ..open import open_packed
from ..packing import pack_lengths
from ..reader import MMapIndexedDataset
from ..storage.destination import destination_for
from . import _outputs
from . import convert_to_shard as to_shard
from .convert_to_parquet import METADATA_KEY, ROW_GROUP_SIZE, shards_to_parquet
from .merge_plan import resolve_inputs

SOURCE_FORMATS = ("npy", "parquet", "option-a", "pretrain", "shard")
TARGETS = ("shard", "parquet")
OVERLONG = ("error", "truncate", "drop")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class ConvertOptions:
    pack_size: Optional[int] = None
    vocab_size: Optional[int] = None
    pad_seq_to_mult: Optional[int] = None
    pad_layout: Optional[str] = None     # .npy/Parquet: default the factory's (Bridge's: runtime)
    eos_id: Optional[int] = None         # .npy/Parquet: Bridge's EOS id, recorded (the mask is kept as written)
    algorithm: str = "first_fit_decreasing"
    seed: int = 0
    overlong: str = "error"
    row_group_size: int = ROW_GROUP_SIZE
    pack_metadata: Optional[str] = None
    overwrite: bool = False
    staging_dir: Optional[str] = None    # where a remote output is staged (default: system temp)


@dataclass
class ConvertResult:
    source_format: str
    target: str
    output: str
    packs: int
    seconds: float
    metadata: Optional[ShardMetadata] = None
    details: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def detect_source(path: str) -> str:
    """The format of INPUT, from the path alone (see the module table).

    Raises:
        ShardNotFoundError: nothing at ``path``.
        FormatError: something is there, in no format this tool reads.
        ShardError: ``path`` is an ``s3://`` / ``msc://`` URL (inputs are local).
    """
    _outputs.refuse_remote_input(path, "convert-packed")
    if os.path.exists(path + IDX_SUFFIX):
        return "shard" if any(os.path.exists(path + s) for s in SFT_SUFFIXES) else "pretrain"
    if path.endswith(".npy") and os.path.isfile(path):
        return "npy"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "manifest.json")):
        return "option-a"
    if to_shard.parquet_files(path):
        return "parquet"
    if path.endswith(".json") and os.path.isfile(path):
        return "shard"  # a manifest of shards
    if os.path.isdir(path) or (_glob.has_magic(path) and _glob.glob(path)):
        return "shard"
    if os.path.exists(path):
        raise FormatError("not a packed format this tool reads", path=path, field="format",
                          expected=list(SOURCE_FORMATS),
                          hint="give a legacy .npy, a packed .parquet (or a directory of them), an Option A "
                               "directory, a shard prefix (without .idx) or upstream pretrain .bin/.idx prefix")
    raise ShardNotFoundError("nothing at this path", path=path)


def detect_target(output: str) -> str:
    return "parquet" if output.endswith(_PARQUET_SUFFIXES) else "shard"


def convert(source: str, output: str, *, source_format: Optional[str] = None, to: Optional[str] = None,
            options: Optional[ConvertOptions] = None) -> ConvertResult:
    """Convert ``source`` to ``output`` (see the module table); the output appears atomically.

    One code path for every output: the conversion is written into the output's staging area
    (beside a local output; a local temporary directory for a URL), a shard is gated there, and
    the output (and ``pack_metadata``) is published by its destination and read back.

    Raises:
        FormatError: an unsupported pair of formats, or an unreadable source.
        ShardExistsError: ``output`` exists and ``options.overwrite`` is false.
        InvariantError: a pack breaks an invariant (named by file and pack).
        ShardError (any subclass): the source is malformed; IncompleteDestinationError: the
            output read back after publishing is not whole.
    """
    options = options or ConvertOptions()
    source, output = os.fspath(source), os.fspath(output)
    _outputs.refuse_remote_input(source, "convert-packed")
    kind = source_format or detect_source(source)
    target = to or detect_target(output)
    started = time.perf_counter()
    if target == "parquet" and kind != "shard":
        raise FormatError(f"--to parquet converts shards; this input is {kind}", path=source, field="to",
                          hint="convert it to a shard first, then the shard to Parquet")
    if target != "parquet" and kind == "shard":
        raise FormatError("the input is already a shard", path=source, field="to",
                          hint="use merge-shards to copy or combine shards, or --to parquet")
    destination = destination_for(output)
    meta = options.pack_metadata
    meta_destination = destination_for(meta) if meta else None
    if not options.overwrite:
        _outputs.refuse_existing(output, destination, shard=target == "shard")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_outputs.marks_published(output, destination, shard=target == "shard"))
        local = stack.enter_context(destination.staging(output, options.staging_dir))
        local_meta = stack.enter_context(meta_destination.staging(meta, options.staging_dir)) if meta else None
        staged = dataclasses.replace(options, pack_metadata=local_meta, overwrite=True)
        if target == "parquet":
            counts = shards_to_parquet(resolve_inputs([source]), local, row_group_size=options.row_group_size,
                                       overwrite=True, pack_metadata=local_meta)
            result = ConvertResult(kind, target, output, counts["packs"], 0.0, details=counts)
            _outputs.publish_file(local, output, destination)
        else:
            writer = {"npy": _from_flat, "parquet": _from_flat, "option-a": _from_option_a, "pretrain": _from_pretrain}
            result = writer[kind](kind, source, local, staged)
            _outputs.gate_or_refuse(local, output, "standard")
            _outputs.publish_staged(local, output, destination)
        if meta:
            _outputs.publish_file(local_meta, meta, meta_destination)
    result.output = output
    result.seconds = time.perf_counter() - started
    return result


def _builder(output: str, options: ConvertOptions, *, pack_size, dtype=None, vocab_size=None,
             metadata: Optional[dict] = None) -> IndexedDatasetBuilder:
    meta = dict(metadata or {})
    if options.pad_seq_to_mult:
        meta["pad_seq_to_mult"] = options.pad_seq_to_mult
    if options.pad_layout:
        meta["pad_layout"] = options.pad_layout
    return IndexedDatasetBuilder(output, dtype=dtype, vocab_size=vocab_size or options.vocab_size,
                                 pack_size=pack_size, metadata=meta, overwrite=options.overwrite)


def _source_record(kind: str, path: str, **extra) -> dict:
    return {"converted_from": {"format": kind, "path": os.path.abspath(path), **extra}}


def _from_flat(kind: str, source: str, output: str, options: ConvertOptions) -> ConvertResult:
    """Legacy ``.npy`` or packed Parquet, parsed by the factory one file at a time (the runtime
    padding layout and each sequence's unread last position handled there, once, for training
    and conversion alike). The loss mask is kept as Bridge wrote it and the conversion says so in
    ``source.converted_from`` (:func:`~megatron_sft_idx.legacy.conversion_record`)."""
    files = [source] if kind == "npy" else list(to_shard.parquet_files(source))
    restored = to_shard.read_parquet_shard_metadata(files[0], METADATA_KEY) if kind == "parquet" else None
    if restored is None and not options.pack_size and len(files) > 1:
        raise FormatError("several Parquet files are read one at a time: the pack size is needed up front",
                          path=source, field="pack_size", hint="pass --pack-size N")
    # The mask as Bridge wrote it: each consumer's reader applies its own loss rule (legacy.py).
    parse = {"pad_seq_to_mult": options.pad_seq_to_mult or (restored or {}).get("pad_seq_to_mult")}
    layout = options.pad_layout or (restored or {}).get("pad_layout")
    if layout:
        parse["pad_layout"] = layout
    sources = (open_packed(f, **parse) for f in files)
    first = next(sources)
    notes = []
    if restored is not None:  # written by --to parquet: the shard comes back as it was
        builder = IndexedDatasetBuilder(output, dtype=np.dtype(restored.get("token_dtype", "int32")),
                                        vocab_size=restored.get("vocab_size"),
                                        pack_size=options.pack_size or restored.get("pack_size"),
                                        metadata={k: v for k, v in restored.items() if k not in RESERVED_KEYS},
                                        overwrite=options.overwrite)
    else:
        size = options.pack_size or first.summary.max_packed_seqlen
        if not options.pack_size:
            notes.append(f"pack size not given: using the longest pack of {files[0]} ({size}); set --pack-size")
        meta = {"source": _source_record(kind, source, files=len(files), **conversion_record(options.eos_id)),
                "pad_seq_to_mult": first.summary.pad_seq_to_mult, "pad_layout": first.summary.pad_layout}
        builder = _builder(output, options, pack_size=size, metadata=meta)
    with builder:
        packs = to_shard.add_flat_source(builder, first, files[0])
        del first
        for path, src in zip(files[1:], sources):
            packs += to_shard.add_flat_source(builder, src, path, first_pack=packs)
    return ConvertResult(kind, "shard", output, packs, 0.0, builder.metadata, {"files": len(files)}, notes)


def _from_option_a(kind: str, source: str, output: str, options: ConvertOptions) -> ConvertResult:
    manifest = to_shard.read_option_a_manifest(source)
    builder = _builder(output, options, pack_size=options.pack_size or manifest["pack_size"],
                       metadata={"source": _source_record(kind, source, manifest_version=manifest.get("version"))})
    with builder:
        packs = to_shard.add_option_a(builder, source, manifest)
    return ConvertResult(kind, "shard", output, packs, 0.0, builder.metadata)


def _from_pretrain(kind: str, source: str, output: str, options: ConvertOptions) -> ConvertResult:
    if not options.pack_size:
        raise FormatError("converting pretrain data packs its documents: the pack size is needed",
                          path=source, field="pack_size", hint="pass --pack-size N")
    if options.overlong not in OVERLONG:
        raise FormatError("unknown overlong policy", field="overlong", expected=list(OVERLONG),
                          actual=options.overlong)
    src = MMapIndexedDataset(source)
    plan = to_shard.plan_documents(src, options.pack_size, options.overlong)
    if not plan["copy"].size:
        raise FormatError("no non-empty document to convert", path=source, field="documents",
                          actual=plan["counts"])
    assignment = pack_lengths(plan["copy"], options.pack_size, options.algorithm, options.seed)
    dtype = src.dtype.numpy if src.dtype.name in ("uint16", "int32") else None
    meta = {"packing": {"algorithm": options.algorithm, "seed": options.seed, "pack_size": options.pack_size,
                        "overlong": options.overlong},
            "source": _source_record(kind, source, **plan["counts"]), "extra": {"loss_on": "all"}}
    builder = _builder(output, options, pack_size=options.pack_size, dtype=dtype, metadata=meta)
    with builder:
        packs = to_shard.add_pretrain(builder, src, plan, assignment)
    return ConvertResult(kind, "shard", output, packs, 0.0, builder.metadata, dict(plan["counts"]))
