"""Shard metadata: the JSON object stored in ``P.seq.idx`` after the header.

It makes a shard self-describing. Keys written by format 1.0 (1.1 adds ``pad_layout``
and ``stats.min_packed_runtime_len``; a 1.0 shard reads as ``pad_layout = "stored"``
with that statistic None):

=====================  ========  ====================================================
key                    required  meaning
=====================  ========  ====================================================
format                 yes       ``"megatron_sft_idx"``
pack_size              yes       max tokens per pack (int), or null (sequence-store partitions)
token_dtype            yes       ``"uint16"`` or ``"int32"``; equals the header code
vocab_size             yes       int or null; every token id is < vocab_size
loss_mask_convention   yes       ``"label_aligned"``: mask[j] == 1 trains predicting j+1
pad_seq_to_mult        yes       int >= 1; every sequence length is a multiple of it
pad_layout             1.1       ``"stored"`` (L % mult == 0) or ``"runtime"`` ((L-1) % mult == 0)
stats                  yes       packing statistics (see :class:`PackingStats`)
files                  yes       ``{".bin"|".idx"|".loss.bin"|".seq.bin": {"size", "crc32"}}``
producer               yes       ``{"name", "version"}`` of the writer
tokenizer              no        identity of the tokenizer (name, hash, ...)
packing                no        algorithm, seed, ...
parallelism            no        the CP/TP/SP the shard was padded for
source                 no        inputs (names, hashes)
set                    no        the set the shard was written in (see :class:`ShardSet`)
sources                1.2       the sources its sequences' ids name (see :class:`ShardSource`)
extra                  no        anything the producer wants to keep
=====================  ========  ====================================================

Readers ignore keys they do not know (a newer minor version may add some);
they refuse a missing required key or a value of the wrong type. The whole document,
known keys or not, stays within the format's limits (``format.py``, docs/FORMAT.md
"Limits"): :func:`megatron_sft_idx.jsondoc.parse_json`, the project's one JSON reader, is where
the bytes become a JSON value, for the reader, the gate and the builder alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import MetadataError
from .format import (
    CHECKSUMMED_SUFFIXES,
    LOSS_MASK_CONVENTION,
    MAX_SET_TEXT,
    MAX_SOURCES,
    METADATA_FIELD_RANGES,
    PAD_LAYOUT_STORED,
    PAD_LAYOUTS,
    TOKEN_DTYPES,
)
from . import jsondoc

FORMAT_NAME = "megatron_sft_idx"
#: Keys the builder owns; a caller's ``metadata=`` may not set them.
RESERVED_KEYS = frozenset(
    {"format", "pack_size", "token_dtype", "vocab_size", "loss_mask_convention", "stats", "files", "producer"}
)
#: Optional keys with a known meaning; anything else a caller passes goes under ``extra``.
OPTIONAL_KEYS = ("pad_seq_to_mult", "pad_layout", "tokenizer", "packing", "parallelism", "source", "set",
                 "sources", "extra")


@dataclass(frozen=True)
class PackingStats:
    """Statistics of the packs, computed by the builder from the data it wrote.

    ``max_samples_per_bin``, ``dataset_max_seqlen`` and ``min_packed_runtime_len`` give
    the values Megatron-Bridge's ``pad_cu_seqlens`` needs (Bridge's ``dataset_max_seqlen``
    is ours minus one; its ``min_packed_seqlen`` is our ``min_packed_runtime_len``: the
    shortest pack's length minus its sequence count). ``min_packed_runtime_len`` is
    new in format 1.1 and None when read from a 1.0 shard.
    """

    pack_count: int
    sequence_count: int
    token_count: int
    loss_token_count: int
    max_samples_per_bin: int
    dataset_max_seqlen: int
    min_seqlen: int
    min_packed_seqlen: int
    max_packed_seqlen: int
    packing_factor: float       # sequences per pack
    packing_efficiency: float   # tokens / (packs * pack_size); null without pack_size
    min_packed_runtime_len: Optional[int] = None  # min over packs of (packed_len - sequences); 1.1

    @classmethod
    def from_counts(cls, *, pack_count: int, sequence_count: int, token_count: int, loss_token_count: int,
                    max_samples_per_bin: int, dataset_max_seqlen: int, min_seqlen: int,
                    min_packed_seqlen: int, max_packed_seqlen: int, min_packed_runtime_len: Optional[int],
                    pack_size: Optional[int]) -> "PackingStats":
        """The statistics with the two ratios derived (rounded to 6 places, as stored)."""
        efficiency = round(token_count / (pack_count * pack_size), 6) if pack_size else None
        return cls(pack_count=pack_count, sequence_count=sequence_count, token_count=token_count,
                   loss_token_count=loss_token_count, max_samples_per_bin=max_samples_per_bin,
                   dataset_max_seqlen=dataset_max_seqlen, min_seqlen=min_seqlen,
                   min_packed_seqlen=min_packed_seqlen, max_packed_seqlen=max_packed_seqlen,
                   packing_factor=round(sequence_count / pack_count, 6), packing_efficiency=efficiency,
                   min_packed_runtime_len=min_packed_runtime_len)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Optional[str] = None) -> "PackingStats":
        values = {}
        for name, kind in cls.__annotations__.items():
            # Every key is required (null is not absence), but for the one format 1.1 added.
            if not isinstance(raw, Mapping) or (name not in raw and name not in _NEW_IN_1_1):
                raise MetadataError("packing statistic missing", path=path, field=f"stats.{name}", expected=kind)
            value = raw.get(name)
            if name in _NULLABLE_STATS and value is None:
                values[name] = None
                continue
            expected = (int,) if kind in ("int", "Optional[int]") else (int, float)
            if isinstance(value, bool) or not isinstance(value, expected):
                raise MetadataError("packing statistic missing or of the wrong type", path=path,
                                    field=f"stats.{name}", expected=kind, actual=value)
            if kind in ("int", "Optional[int]"):
                _check_range(value, "stats.*", f"stats.{name}", path)
            values[name] = value
        return cls(**values)


_NULLABLE_STATS = ("packing_efficiency", "min_packed_runtime_len")
#: Statistics a format 1.0 shard does not have (read as None).
_NEW_IN_1_1 = ("min_packed_runtime_len",)


@dataclass(frozen=True)
class ShardSet:
    """The set a shard was written in: shards a producer writes together as one output
    (the shards of one split of a run), so a reader can tell a whole set from part of
    one, or from shards of two generations (docs/FORMAT.md "Sets").

    ``id`` names the set: equal ids mean one set of one generation (a producer derives
    it from what decides the bytes, never from time or chance). The set has ``count``
    shards; this one is number ``index`` (``0 <= index < count``). ``name`` says which
    part of the output the set is (``"train"``, ``"valid"``, ...), for messages only.
    """

    id: str
    index: int
    count: int
    name: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"id": self.id, "index": self.index, "count": self.count}
        if self.name is not None:
            out["name"] = self.name
        return out

    def describe(self) -> str:
        """``set 3f9a0c1e2b7d (train)``: the id's first 12 characters and the name."""
        return f"set {self.id[:12]}" + (f" ({self.name})" if self.name else "")

    @classmethod
    def from_dict(cls, raw: Any, path: Optional[str] = None, field: str = "set") -> "ShardSet":
        """Parse a ``set`` object strictly (types, ranges, ``index < count``).

        Raises:
            MetadataError: naming ``field`` and the key at fault.
        """
        if not isinstance(raw, Mapping):
            raise MetadataError(f"metadata key '{field}' must be an object", path=path, field=field,
                                expected="object", actual=raw)
        values = {}
        for key in ("id", "name"):
            value = raw.get(key)
            if value is None and key == "name":
                values[key] = None
                continue
            if not isinstance(value, str) or not 1 <= len(value.encode("utf-8", "surrogatepass")) <= MAX_SET_TEXT:
                raise MetadataError(f"metadata key '{field}.{key}' must be a string of 1 to {MAX_SET_TEXT} "
                                    "bytes", path=path, field=f"{field}.{key}", actual=value)
            values[key] = value
        for key in ("count", "index"):
            value = raw.get(key)
            if not _is_int(value):
                raise MetadataError(f"metadata key '{field}.{key}' has the wrong type", path=path,
                                    field=f"{field}.{key}", expected="int", actual=value)
            _check_range(value, f"set.{key}", f"{field}.{key}", path)
            values[key] = value
        if values["index"] >= values["count"]:
            raise MetadataError(f"metadata key '{field}.index' is not below '{field}.count'", path=path,
                                field=f"{field}.index", expected=f"0..{values['count'] - 1}", actual=values["index"])
        return cls(**values)


@dataclass(frozen=True)
class ShardSource:
    """One source of a shard that records its sequences' sources (format 1.2, metadata ``sources``):
    its ``name`` (1 to 256 bytes of UTF-8, unique in the shard), how many of the shard's sequences
    are from it (``sequences``), and what else the producer records of it (``extra``: e.g. the
    ``store_id`` of the sequence store it was read from). Source id ``j`` of a sequence names
    ``sources[j]``."""

    name: str
    sequences: int
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.extra, name=self.name, sequences=self.sequences)

    @classmethod
    def from_dict(cls, raw: Any, path: Optional[str], field: str, counted: bool = True) -> "ShardSource":
        """Parse one ``sources`` entry (``counted``: ``sequences`` is required, as in a shard).

        Raises:
            MetadataError: naming ``field`` and the key at fault.
        """
        if not isinstance(raw, Mapping):
            raise MetadataError(f"metadata key '{field}' must be an object", path=path, field=field, actual=raw)
        name = raw.get("name")
        if not isinstance(name, str) or not 1 <= len(name.encode("utf-8", "surrogatepass")) <= MAX_SET_TEXT:
            raise MetadataError(f"metadata key '{field}.name' must be a string of 1 to {MAX_SET_TEXT} bytes",
                                path=path, field=f"{field}.name", actual=name)
        sequences = raw.get("sequences", 0 if not counted else None)
        if not _is_int(sequences):
            raise MetadataError(f"metadata key '{field}.sequences' has the wrong type", path=path,
                                field=f"{field}.sequences", expected="int", actual=sequences)
        _check_range(sequences, "sources[].sequences", f"{field}.sequences", path)
        return cls(name, sequences, {k: v for k, v in raw.items() if k not in ("name", "sequences")})


def parse_sources(raw: Any, path: Optional[str], counted: bool = True) -> Tuple[ShardSource, ...]:
    """The metadata's ``sources``: 1 to :data:`~megatron_sft_idx.format.MAX_SOURCES` entries of
    distinct names (:class:`ShardSource`).

    Raises:
        MetadataError: not a list of that length, an entry malformed, a name given twice.
    """
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_SOURCES:
        raise MetadataError(f"metadata key 'sources' must be a list of 1 to {MAX_SOURCES} sources", path=path,
                            field="sources", actual=type(raw).__name__ if not isinstance(raw, list) else len(raw))
    out = tuple(ShardSource.from_dict(item, path, f"sources[{k}]", counted) for k, item in enumerate(raw))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise MetadataError("metadata key 'sources' names a source twice", path=path, field="sources", actual=dup)
    return out


@dataclass(frozen=True)
class FileDigest:
    size: int
    crc32: int


@dataclass(frozen=True)
class ShardMetadata:
    """The parsed metadata of one shard; ``to_dict()``/``from_dict()`` round-trip it."""

    pack_size: Optional[int]
    token_dtype: str
    vocab_size: Optional[int]
    stats: Optional[PackingStats]  # None only for pretrain data opened without a .seq.idx
    files: Dict[str, FileDigest]
    producer: Dict[str, Any]
    loss_mask_convention: str = LOSS_MASK_CONVENTION
    pad_seq_to_mult: int = 1
    pad_layout: str = PAD_LAYOUT_STORED
    tokenizer: Optional[Dict[str, Any]] = None
    packing: Optional[Dict[str, Any]] = None
    parallelism: Optional[Dict[str, Any]] = None
    source: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    shard_set: Optional[ShardSet] = None  # metadata key "set"
    #: "sft" for shards of this format; "pretrain" when the reader synthesised it for bin/idx only.
    kind: str = "sft"
    #: format 1.2: the source each sequence's id names (None: the shard records no sources)
    sources: Optional[Tuple[ShardSource, ...]] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "format": FORMAT_NAME,
            "pack_size": self.pack_size,
            "token_dtype": self.token_dtype,
            "vocab_size": self.vocab_size,
            "loss_mask_convention": self.loss_mask_convention,
            "pad_seq_to_mult": self.pad_seq_to_mult,
            "pad_layout": self.pad_layout,
            "stats": asdict(self.stats),
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "producer": dict(self.producer),
        }
        for key in ("tokenizer", "packing", "parallelism", "source"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.shard_set is not None:
            out["set"] = self.shard_set.to_dict()
        if self.sources is not None:
            out["sources"] = [s.to_dict() for s in self.sources]
        if self.extra:
            out["extra"] = self.extra
        return out

    def encode(self) -> bytes:
        """Canonical UTF-8 JSON: sorted keys, no whitespace, so equal metadata gives equal bytes."""
        try:
            return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise MetadataError(f"metadata is not JSON-serialisable: {exc}", field="metadata",
                                hint="pass only str/int/float/bool/None/list/dict values") from None

    @classmethod
    def decode(cls, raw: bytes, path: Optional[str] = None) -> "ShardMetadata":
        """Parse the metadata bytes of a ``.seq.idx`` (see :func:`~megatron_sft_idx.jsondoc.parse_json`
        and :meth:`from_dict`).

        Raises:
            MetadataError: not UTF-8 JSON, a required key missing or of the wrong type or range;
            MetadataLimitError (a MetadataError): beyond the format's limits.
        """
        return cls.from_dict(jsondoc.parse_json(raw, path), path=path)

    @classmethod
    def from_dict(cls, obj: Any, path: Optional[str] = None) -> "ShardMetadata":
        if not isinstance(obj, dict):
            raise MetadataError("metadata must be a JSON object", path=path, field="metadata",
                                expected="object", actual=type(obj).__name__)

        def need(key, types, allow_none=False):
            if key not in obj:
                raise MetadataError(f"required metadata key '{key}' is missing", path=path, field=key)
            value = obj[key]
            if value is None and allow_none:
                return None
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                raise MetadataError(f"metadata key '{key}' has the wrong type", path=path, field=key,
                                    expected=" or ".join(t.__name__ for t in types), actual=value)
            if key in METADATA_FIELD_RANGES:
                _check_range(value, key, key, path)
            return value

        if obj.get("format") != FORMAT_NAME:
            raise MetadataError("metadata does not declare this format", path=path, field="format",
                                expected=FORMAT_NAME, actual=obj.get("format"))
        pack_size = need("pack_size", (int,), allow_none=True)
        token_dtype = need("token_dtype", (str,))
        if token_dtype not in {d.name for d in TOKEN_DTYPES}:
            raise MetadataError("unknown token dtype", path=path, field="token_dtype",
                                expected=[d.name for d in TOKEN_DTYPES], actual=token_dtype)
        vocab_size = need("vocab_size", (int,), allow_none=True)
        convention = need("loss_mask_convention", (str,))
        if convention != LOSS_MASK_CONVENTION:
            raise MetadataError("unknown loss-mask convention", path=path, field="loss_mask_convention",
                                expected=LOSS_MASK_CONVENTION, actual=convention)
        pad = need("pad_seq_to_mult", (int,))
        layout = obj.get("pad_layout", PAD_LAYOUT_STORED)  # absent in format 1.0
        if layout not in PAD_LAYOUTS:
            raise MetadataError("unknown padding layout", path=path, field="pad_layout",
                                expected=list(PAD_LAYOUTS), actual=layout)
        stats = PackingStats.from_dict(need("stats", (dict,)), path=path)
        raw_files = need("files", (dict,))
        files = {}
        for suffix in CHECKSUMMED_SUFFIXES:
            entry = raw_files.get(suffix)
            if (not isinstance(entry, dict) or not _is_int(entry.get("size"))
                    or not _is_int(entry.get("crc32"))):
                raise MetadataError(f"size/crc32 of '{suffix}' missing or malformed", path=path,
                                    field=f"files.{suffix}", actual=entry)
            _check_range(entry["size"], "files.*.size", f"files.{suffix}.size", path)
            _check_range(entry["crc32"], "files.*.crc32", f"files.{suffix}.crc32", path)
            files[suffix] = FileDigest(size=entry["size"], crc32=entry["crc32"])
        producer = need("producer", (dict,))
        optional = {}
        for key in ("tokenizer", "packing", "parallelism", "source", "extra"):
            value = obj.get(key)
            if value is not None and not isinstance(value, dict):
                raise MetadataError(f"metadata key '{key}' must be an object", path=path, field=key,
                                    actual=value)
            optional[key] = value
        shard_set = None if obj.get("set") is None else ShardSet.from_dict(obj["set"], path)
        sources = None if obj.get("sources") is None else parse_sources(obj["sources"], path)
        if sources is not None and sum(s.sequences for s in sources) != stats.sequence_count:
            raise MetadataError("the sources' sequences do not add up to stats.sequence_count", path=path,
                                field="sources", expected=stats.sequence_count,
                                actual=sum(s.sequences for s in sources))
        return cls(pack_size=pack_size, token_dtype=token_dtype, vocab_size=vocab_size, stats=stats,
                   files=files, producer=producer, loss_mask_convention=convention, pad_seq_to_mult=pad,
                   pad_layout=layout,
                   tokenizer=optional["tokenizer"], packing=optional["packing"],
                   parallelism=optional["parallelism"], source=optional["source"],
                   extra=optional["extra"] or {}, shard_set=shard_set, sources=sources)


def _check_range(value: int, rule: str, key: str, path: Optional[str]) -> None:
    low, high = METADATA_FIELD_RANGES[rule]
    if not low <= value <= high:
        raise MetadataError(f"metadata key '{key}' is out of range", path=path, field=key,
                            expected=f"{low}..{high}", actual=value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def split_user_metadata(metadata: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Sort a caller's ``metadata=`` into known optional keys and ``extra``.

    Raises:
        MetadataError: a reserved key is set, or a known key has the wrong type.
    """
    known: Dict[str, Any] = {"pad_seq_to_mult": 1, "pad_layout": PAD_LAYOUT_STORED, "extra": {}}
    if not metadata:
        return known
    if not isinstance(metadata, Mapping):
        raise MetadataError("metadata must be a mapping", field="metadata", actual=type(metadata).__name__)
    clash = RESERVED_KEYS.intersection(metadata)
    if clash:
        raise MetadataError(f"metadata keys {sorted(clash)} are written by the builder itself",
                            field="metadata", hint="pass pack_size/vocab_size/dtype as builder arguments")
    extra = metadata.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise MetadataError("metadata['extra'] must be a mapping", field="extra", actual=extra)
    extra = dict(extra)
    for key, value in metadata.items():
        if key == "pad_seq_to_mult":
            low, high = METADATA_FIELD_RANGES[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise MetadataError(f"pad_seq_to_mult must be an int in {low}..{high}", field=key, actual=value)
            known[key] = value
        elif key == "pad_layout":
            if value not in PAD_LAYOUTS:
                raise MetadataError("unknown padding layout", field=key, expected=list(PAD_LAYOUTS),
                                    actual=value)
            known[key] = value
        elif key in ("tokenizer", "packing", "parallelism", "source"):
            if not isinstance(value, Mapping):
                raise MetadataError(f"metadata['{key}'] must be a mapping", field=key, actual=value)
            known[key] = dict(value)
        elif key == "set":
            known[key] = None if value is None else ShardSet.from_dict(value).to_dict()
        elif key == "sources":   # the builder counts each source's sequences
            known[key] = None if value is None else [s.to_dict() for s in parse_sources(value, None, counted=False)]
        elif key != "extra":
            extra[key] = value
    known["extra"] = extra
    check_user_limits(known)
    return known


def check_user_limits(known: Mapping[str, Any]) -> None:
    """Refuse, when the builder is created, metadata a reader would refuse once written.

    ``known`` holds keys that sit at the top level of the shard's metadata, so its
    encoding nests exactly as deep as they will.

    Raises:
        MetadataError: not JSON-serialisable (e.g. NaN or an object), or beyond the limits.
    """
    try:
        raw = json.dumps(dict(known), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                         allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise MetadataError(f"metadata is not JSON-serialisable: {exc}", field="metadata",
                            hint="pass only str/int/float/bool/None/list/dict values, finite floats") from None
    jsondoc.parse_json(raw)
