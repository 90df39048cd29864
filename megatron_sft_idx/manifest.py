"""Manifests: a set of shards listed once, opened with one read, parsed strictly -- the format,
stated once, for every reader and writer (storage, preprocess, publishing, training).

A manifest is the commit point of a multi-shard output (written after its last shard is in
place) and the cheap way to open many shards: each entry records a shard's prefix, pack
count, summary and *identity* (what decides whether it may be read with the others, and the
set it belongs to), so a reader checks the whole set without opening a shard.

Version 1::

    {"format": "megatron_sft_idx.manifest", "version": 1,
     "shards": [{"prefix": "train_000000", "packs": 5000,
                 "summary": {...PackSummary...}, "identity": {...ShardIdentity...}}, ...]}

Rules (a violation is one :class:`~megatron_sft_idx.errors.ShardError` naming the file and
the field, e.g. ``shards[3].summary.token_count``):

* at most :data:`MAX_MANIFEST_BYTES` of strict UTF-8 JSON (no ``NaN``, integers within int64,
  containers nested at most 64 deep); ``format`` and ``version`` as above; ``shards`` a
  non-empty list of objects;
* ``prefix`` a non-empty string without NUL (relative: to the manifest's directory or URL),
  each shard listed once; ``packs`` an int >= 1;
* ``summary``: every :class:`PackSummary` field of its type and range, and consistent:
  ``pack_count == packs``, ``sequence_count >= packs``, ``token_count >= sequence_count``,
  ``1 <= max_samples_per_bin <= sequence_count``, ``min_packed_seqlen <= max_packed_seqlen <=
  pack_size`` (when known), ``dataset_max_seqlen <= max_packed_seqlen``,
  ``min_packed_runtime_len <= min_packed_seqlen - 1``;
* ``identity`` (written since sets were introduced; a manifest without it is read by opening
  each shard's headers once): parsed by :meth:`ShardIdentity.from_dict`, and agreeing with the
  summary's pad multiple and layout;
* across entries: the shards agree (:mod:`megatron_sft_idx.sets`) and form whole sets
  (checked here when every entry has an identity; else by the reader once it has opened them).

Unknown keys are ignored, as in shard metadata. A set written with a balanced pack order records
it under ``"order"`` (docs/FORMAT.md): an :class:`OrderRecord` -- the order file's name (relative
to the manifest), size and CRC-32, and the seed, epochs, topology, cost model and exchange window
it was planned with -- written and parsed here only (``Manifest.order``; None when the set has no
order), checked by the adapters' ``"auto"`` order and carried by a promotion.

A manifest is parsed from its bytes (:func:`parse_manifest`), wherever they came from: a local
file or an object (:func:`load_manifest` reads either, at most :data:`MAX_MANIFEST_BYTES`). It is
written as bytes (:func:`encode_manifest`) from the shards it lists, opened; where those bytes go
(a local file, atomically, or an object, last of its set) is :mod:`megatron_sft_idx.publishing`'s
business, and :func:`megatron_sft_idx.publishing.write_manifest` writes one for a spec of shards.
(Its old name ``megatron_sft_idx.training.manifest`` warns once: :mod:`megatron_sft_idx._moved`.)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import IncompleteShardError, MetadataError, ShardError, ShardNotFoundError
from .jsondoc import Doc, parse_json
from .packed import PackSummary, summarize
from .sets import ShardIdentity, require_compatible, require_whole_sets
from .storage.paths import beside, comparable, idx_missing, normal, read_whole, relative_name

__all__ = ["Manifest", "OrderRecord", "ORDER_KEY", "parse_manifest", "missing_entry", "open_entry", "require_entries_present", "load_manifest", "read_manifest", "is_manifest", "check_manifest_set",
           "manifest_entry", "manifest_document", "encode_manifest", "listed_prefix", "MANIFEST_FORMAT", "MANIFEST_VERSION",
           "MAX_MANIFEST_BYTES", "MANIFEST_SUFFIX"]

MANIFEST_FORMAT = "megatron_sft_idx.manifest"
MANIFEST_VERSION = 1
#: A manifest's file name ends so (a set's manifest is ``BASE.json`` beside ``BASE_NNNNNN`` shards).
MANIFEST_SUFFIX = ".json"
#: Largest manifest read: about 60,000 shards with their identities (parsing costs up to ~25x this).
MAX_MANIFEST_BYTES = 64 << 20
_REWRITE = "rewrite it with write-sft-manifest (or rerun the run that wrote it)"


#: The key under which a manifest records its set's balanced order.
ORDER_KEY = "order"


@dataclass(frozen=True)
class OrderRecord:
    """What a manifest records of its set's balanced order (``"order"``): the file (``file``,
    relative to the manifest; ``size`` bytes; ``crc32`` of its bytes) and what it was planned
    with (``topology`` and ``cost_model`` as their ``to_dict()``, parsed by ``batching``)."""

    file: str
    size: int
    crc32: int
    seed: int
    epochs: int
    first_epoch: int
    topology: Dict[str, Any]
    cost_model: Dict[str, Any]
    exchange_window: int

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: Any, path: str) -> "OrderRecord":
        """The record ``obj`` (a manifest's ``"order"``) of the manifest ``path``.

        Raises:
            ShardError: not an object, or a field missing, mistyped or out of range (naming
                ``order.<field>``).
        """
        doc = Doc(obj, path, ORDER_KEY, error=ShardError)
        name = doc.str("file")
        if not name or "/" in name or "\0" in name:
            raise doc.fail("must be a file name beside the manifest", "file", actual=name)
        return cls(file=name, size=doc.int("size", lo=1), crc32=doc.int("crc32", lo=0, hi=0xFFFFFFFF),
                   seed=doc.int("seed"), epochs=doc.int("epochs", lo=1), first_epoch=doc.int("first_epoch", lo=0),
                   topology=doc.doc("topology").obj, cost_model=doc.doc("cost_model").obj,
                   exchange_window=doc.int("exchange_window", lo=1))


@dataclass
class Manifest:
    """A parsed manifest: per shard its prefix (resolved), pack count, summary and identity
    (None for entries of a manifest written before identities were recorded); the set's
    balanced ``order`` record, if it has one."""

    path: str
    prefixes: List[str]
    counts: List[int]
    summaries: List[PackSummary]
    identities: List[Optional[ShardIdentity]]
    order: Optional[OrderRecord] = None


def is_manifest(path: str) -> bool:
    """True when ``path`` names a local manifest: an existing ``*.json`` file (nothing is read)."""
    return path.endswith(MANIFEST_SUFFIX) and os.path.isfile(path)


def _fail(path: str, field: str, message: str, actual: Any = None, expected: Any = None) -> ShardError:
    return ShardError(f"manifest {message}", path=path, field=field, actual=actual, expected=expected,
                      hint=_REWRITE)


def load_manifest(path, *, url: Optional[str] = None) -> Manifest:
    """Read and parse the manifest at ``path``, a local file or an ``s3://`` / ``msc://`` URL
    (one read; see the module rules).

    Relative prefixes resolve against the manifest's directory (or URL), or against ``url``
    when ``path`` is a local copy of the manifest at that URL (messages then name the URL).

    Raises:
        ShardNotFoundError: no object at the URL.
        ShardError: naming ``path`` and the field at fault.
    """
    location = os.fspath(path)
    named = url or location
    try:
        size, raw = read_whole(location, MAX_MANIFEST_BYTES)
    except ShardError:   # (the store's errors: ShardNotFoundError is an OSError too)
        raise
    except OSError as exc:
        raise ShardError(f"cannot read manifest ({exc.strerror or exc})", path=named, field="manifest") from None
    if size is None:
        raise ShardNotFoundError("no manifest here (no such file or object)", path=named)
    if raw is None:
        raise _too_large(named, size)
    return parse_manifest(raw, url or normal(location), named=named)


def _too_large(path: str, size: Optional[int] = None) -> ShardError:
    return _fail(path, "manifest", f"is larger than {MAX_MANIFEST_BYTES >> 20} MiB", actual=size,
                 expected="a manifest")


def parse_manifest(raw: bytes, location: str, *, named: Optional[str] = None) -> Manifest:
    """The manifest whose bytes are ``raw`` (see the module rules).

    ``location`` is where it lives, an absolute path or a URL: relative prefixes resolve
    against its directory. Messages name ``named`` (default: ``location``).

    Raises:
        ShardError: naming the manifest and the field at fault.
    """
    path = named or location
    try:
        obj = parse_json(raw, path, max_length=MAX_MANIFEST_BYTES, what="manifest")
    except MetadataError as exc:
        raise ShardError(f"manifest is not valid JSON: {exc.message}", path=path, field="manifest",
                         hint=_REWRITE) from None
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ShardError("not a megatron_sft_idx manifest", path=path, field="format",
                         expected=MANIFEST_FORMAT, actual=obj.get("format") if isinstance(obj, dict) else None)
    if obj.get("version") != MANIFEST_VERSION or isinstance(obj.get("version"), bool):
        raise ShardError(f"unsupported manifest version; supported: ({MANIFEST_VERSION},)", path=path,
                         field="version", expected=MANIFEST_VERSION, actual=obj.get("version"),
                         hint="it was written by another megatron_sft_idx version; use a matching one")
    shards = obj.get("shards")
    if not isinstance(shards, list) or not shards:
        raise _fail(path, "shards", "lists no shards", actual=type(shards).__name__)
    out = Manifest(path, [], [], [], [])
    if obj.get(ORDER_KEY) is not None:
        out.order = OrderRecord.from_dict(obj[ORDER_KEY], path)
    seen = {}
    for k, entry in enumerate(shards):
        prefix, packs, summary, identity = _entry(path, k, entry)
        resolved = beside(location, prefix)
        key = comparable(resolved)
        if key in seen:
            raise _fail(path, f"shards[{k}].prefix", f"lists the shard {prefix!r} twice (entries {seen[key]} "
                        f"and {k})", actual=prefix)
        seen[key] = k
        out.prefixes.append(resolved)
        out.counts.append(packs)
        out.summaries.append(summary)
        out.identities.append(identity)
    if all(i is not None for i in out.identities):
        check_manifest_set(out, out.identities)
    return out


def check_manifest_set(manifest: Manifest, identities: Sequence[ShardIdentity]) -> None:
    """The shards of ``manifest`` (with these identities) agree and form whole sets.

    Raises:
        IncompatibleShardsError, ShardSetError: naming the shards and the manifest.
    """
    members = list(zip(manifest.prefixes, identities))
    require_compatible(members)
    require_whole_sets([(p, i.shard_set) for p, i in members], source=manifest.path, selected_by="manifest")


def missing_entry(manifest: str, prefix: str, k: Optional[int] = None, what: str = ".idx missing") -> ShardNotFoundError:
    """The error for entry ``k`` of ``manifest`` whose shard ``prefix`` is not there: it names
    the manifest and the entry, so a user knows which file points at nothing."""
    return ShardNotFoundError(f"manifest {manifest} lists {prefix}: no shard at this prefix ({what})",
                              field=None if k is None else f"shards[{k}].prefix",
                              hint="the shard was moved or deleted after the manifest was written: restore it, "
                                   "or rewrite the manifest with write-sft-manifest (check-idx --promote moves "
                                   "a set's manifest with its shards)")


def require_entries_present(manifest: str, prefixes: Sequence[str], *, urls: bool = False) -> None:
    """Every local shard ``manifest`` lists has its ``.idx`` (one ``stat`` each; for tools that
    open every shard anyway). URLs are left to the reader, which names the manifest when it
    opens one lazily, unless ``urls`` (one listing each: the gate, which reads every shard).

    Raises:
        ShardNotFoundError: :func:`missing_entry` for the first entry that is not there.
    """
    for k, prefix in enumerate(prefixes):
        missing = idx_missing(prefix, urls=urls)
        if missing:
            raise missing_entry(manifest, prefix, k, missing)


def open_entry(manifest: str, prefix: str, k: Optional[int], opener):
    """``opener(prefix)`` for entry ``k`` of ``manifest``; a shard that is not there (no ``.idx``)
    raises :func:`missing_entry` instead of the reader's bare "no shard at this prefix".

    Raises:
        ShardNotFoundError: naming the manifest and the entry; anything ``opener`` raises else.
    """
    try:
        return opener(prefix)
    except ShardNotFoundError:
        raise missing_entry(manifest, prefix, k, ".idx missing") from None
    except IncompleteShardError:
        raise missing_entry(manifest, prefix, k, ".idx missing, other files of the shard present") from None


def _entry(path: str, k: int, entry: Any):
    """``(prefix, packs, summary, identity)`` of entry ``k``, checked (see the module rules)."""
    where = f"shards[{k}]"
    if not isinstance(entry, dict):
        raise _fail(path, where, f"entry {k} is malformed (not an object)", actual=type(entry).__name__)
    prefix = entry.get("prefix")
    if not isinstance(prefix, str) or not prefix or "\0" in prefix:
        raise _fail(path, f"{where}.prefix", f"entry {k} is malformed (prefix is not a path)", actual=prefix)
    packs = entry.get("packs")
    if isinstance(packs, bool) or not isinstance(packs, int) or not 1 <= packs < 2 ** 63:
        raise _fail(path, f"{where}.packs", f"entry {k} is malformed (packs is not a positive int)", actual=packs)
    summary = PackSummary.from_dict(entry.get("summary"), path=path, field=f"{where}.summary")
    _check_summary(path, f"{where}.summary", summary, packs)
    identity = None
    if entry.get("identity") is not None:
        try:
            identity = ShardIdentity.from_dict(entry["identity"], path, f"{where}.identity")
        except MetadataError as exc:
            raise _fail(path, exc.field, f"entry {k}: identity {exc.message}", actual=exc.actual,
                        expected=exc.expected) from None
        for name in ("pad_seq_to_mult", "pad_layout"):
            if getattr(identity, name) != getattr(summary, name):
                raise _fail(path, f"{where}.identity.{name}", f"entry {k}: identity and summary disagree on {name}",
                            expected=getattr(summary, name), actual=getattr(identity, name))
    return prefix, packs, summary, identity


def _check_summary(path: str, where: str, s: PackSummary, packs: int) -> None:
    """The cross-field rules of a summary (its fields' types were checked by ``from_dict``)."""
    rules = [
        ("pack_count", s.pack_count == packs, f"== packs ({packs})"),
        ("sequence_count", s.sequence_count >= s.pack_count, f">= pack_count ({s.pack_count})"),
        ("token_count", s.token_count >= s.sequence_count, f">= sequence_count ({s.sequence_count})"),
        ("max_samples_per_bin", 1 <= s.max_samples_per_bin <= s.sequence_count,
         f"1..sequence_count ({s.sequence_count})"),
        ("min_packed_seqlen", 1 <= s.min_packed_seqlen <= s.max_packed_seqlen,
         f"1..max_packed_seqlen ({s.max_packed_seqlen})"),
        ("dataset_max_seqlen", 1 <= s.dataset_max_seqlen <= s.max_packed_seqlen,
         f"1..max_packed_seqlen ({s.max_packed_seqlen})"),
        ("max_packed_seqlen", s.pack_size is None or s.max_packed_seqlen <= s.pack_size,
         f"<= pack_size ({s.pack_size})"),
        ("pad_seq_to_mult", s.pad_seq_to_mult >= 1, ">= 1"),
        ("min_packed_runtime_len", s.min_packed_runtime_len is None
         or s.min_packed_runtime_len <= s.min_packed_seqlen - 1, f"<= min_packed_seqlen - 1 ({s.min_packed_seqlen - 1})"),
    ]
    for name, ok, expected in rules:
        if not ok:
            raise _fail(path, f"{where}.{name}", f"summary field {name} is inconsistent",
                        actual=getattr(s, name), expected=expected)


def read_manifest(path) -> tuple:
    """``(prefixes, counts, summaries)`` from a manifest, with one file read (see :func:`load_manifest`).

    Raises:
        ShardError: not a manifest of a supported version, or an entry is malformed.
    """
    m = load_manifest(path)
    return m.prefixes, m.counts, m.summaries


def listed_prefix(prefix: str, manifest: str, relative: bool = True) -> str:
    """How a manifest at ``manifest`` lists the shard ``prefix``: relative to the manifest's
    directory when ``relative`` and both are local (or both URLs of one bucket), else absolute."""
    return relative_name(prefix, manifest, relative)


def manifest_entry(listed: str, shard) -> Dict[str, Any]:
    """The entry of an opened shard (a :class:`~megatron_sft_idx.reader.MMapIndexedDataset`), listed
    as ``listed``: its pack count, summary and identity, from its headers (no pack read)."""
    return {"prefix": listed, "packs": len(shard), "summary": summarize(shard).to_dict(),
            "identity": ShardIdentity.of(shard.metadata).to_dict()}


def manifest_document(path: str, members: Sequence[Tuple[str, Any]], *, relative: bool = True,
                      order: Optional[OrderRecord] = None) -> Dict[str, Any]:
    """The manifest at ``path`` listing ``members`` (``(prefix, opened shard)``, in order), after
    checking that the shards agree and form whole sets: a manifest a reader would refuse is
    never written. ``relative``: list prefixes relative to the manifest (:func:`listed_prefix`);
    ``order``: the set's balanced order, recorded.

    Raises:
        IncompatibleShardsError, ShardSetError: the shards cannot be read as one set.
    """
    identities = [(p, ShardIdentity.of(s.metadata)) for p, s in members]
    require_compatible(identities)
    require_whole_sets([(p, i.shard_set) for p, i in identities], source=path, selected_by="manifest")
    entries = [manifest_entry(listed_prefix(p, path, relative), shard) for p, shard in members]
    document = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "shards": entries}
    if order is not None:
        document[ORDER_KEY] = order.to_dict()
    return document


def encode_manifest(document: Dict[str, Any]) -> bytes:
    """The bytes of a manifest (:func:`manifest_document`), as every writer writes them."""
    return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")
