"""Shards read or merged together: do they agree, and do they form whole sets?

Every reader of several shards (a manifest, a directory, a glob, a list, a Megatron
``data_path`` blend, Bridge's train/valid/test) and ``merge-shards`` ask the same two
questions, answered here once, in words (docs/FORMAT.md "Sets").

**Agreement** (:class:`Agreement`): would one model train on these packs the same way?

=====================  ===================================================================
what                   rule
=====================  ===================================================================
loss-mask convention   equal
tokenizer              equal where both shards record one: the hash of its files, then the
                       hash of its chat template (a record without a files hash is compared
                       whole, without its local ``path``); a shard that records none is not
                       compared
vocabulary size        equal where both are known, unless both shards record the same
                       tokenizer (then ``vocab_size`` is only a bound and may differ)
token dtype            equal, unless ``widen``: readers serve each pack in its shard's dtype
                       (the training adapters widen them to int64), so they pass
                       ``widen=True``; ``merge-shards`` writes one dtype and needs ``--widen``
pad multiple           equal (``pad_seq_to_mult``)
pad layout,            equal when sequences are padded (multiple > 1): the layout and the
parallelism            CP/TP/SP decide what the padding means
=====================  ===================================================================

Each field is compared with the first shard that records it, so a shard that records no
tokenizer between two that record different ones does not hide the difference.

**Sets** (:func:`require_whole_sets`): shards a producer wrote as one output carry a
:class:`~megatron_sft_idx.metadata.ShardSet` (an id, their index and the set's count).
Shards selected by a directory, a glob or a manifest must hold every member of each set
they touch, each once; a directory or a glob must moreover hold one set only (or only
shards that belong to no set). A shard named by its own prefix is read whatever set it
belongs to. Tools that look at each set on its own (``inspect-idx DIR``) take a directory
of several whole sets of distinct names apart with :func:`whole_sets` (the splits of one
run, promoted together).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import IncompatibleShardsError, MetadataError, ShardSetError
from .format import LOSS_MASK_CONVENTION, METADATA_FIELD_RANGES, PAD_LAYOUTS, TOKEN_DTYPES
from .metadata import ShardMetadata, ShardSet

__all__ = ["ShardIdentity", "Agreement", "Difference", "require_compatible", "require_whole_sets",
           "identity_difference", "tokenizer_difference", "whole_sets", "SELECTED_BY"]

#: How shards were named: each kind but ``prefix`` selects shards the caller did not name one by one.
SELECTED_BY = ("prefix", "directory", "glob", "manifest")
_SPLIT_ORDER = {"train": 0, "valid": 1, "test": 2}
_LAYOUT_WORDS = {"stored": "Megatron-LM's 'stored' layout", "runtime": "Megatron-Bridge's 'runtime' layout"}
_HINTS = {
    "token_dtype": "pass --widen to write int32 tokens for all inputs",
    "pad_seq_to_mult": "shards padded for different context parallelism cannot be used as one; "
                       "re-pack them with one --cp/--pad-seq-to-mult (repack-sft), or train on each group alone",
    "parallelism": "shards padded for different CP/TP/SP layouts cannot be used as one; re-pack them "
                   "with one --cp/--tp/--sp (repack-sft)",
    "pad_layout": "Megatron-LM (stored) and Megatron-Bridge (runtime) padding cannot be used as one; "
                  "re-pack them with one --pad-layout (repack-sft)",
    "tokenizer": "shards tokenized with different tokenizers cannot be trained together; re-tokenize "
                 "the inputs of one of them with the other's tokenizer",
    "chat_template": "shards rendered with different chat templates cannot be trained together; re-run "
                     "preprocess-sft on one of them with the other's --chat-template",
    "vocab_size": "these shards declare different vocabularies (different tokenizers); re-tokenize one "
                  "of them, or give both runs the same --vocab-size if the tokenizer really is the same",
    "loss_mask_convention": "re-run preprocessing for one of them",
}


# --------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class ShardIdentity:
    """What of a shard's metadata decides whether it may be read or merged with others, and
    the set it belongs to. Built from a shard's metadata (:meth:`of`) or from a manifest
    entry (:meth:`from_dict`: parsed as strictly as the metadata itself)."""

    token_dtype: str
    vocab_size: Optional[int]
    loss_mask_convention: str
    pad_seq_to_mult: int
    pad_layout: str
    parallelism: Optional[Dict[str, Any]]
    tokenizer: Optional[Dict[str, Any]]
    shard_set: Optional[ShardSet] = None
    kind: str = "sft"

    @classmethod
    def of(cls, metadata: ShardMetadata) -> "ShardIdentity":
        return cls(token_dtype=metadata.token_dtype, vocab_size=metadata.vocab_size,
                   loss_mask_convention=metadata.loss_mask_convention, pad_seq_to_mult=metadata.pad_seq_to_mult,
                   pad_layout=metadata.pad_layout, parallelism=metadata.parallelism,
                   tokenizer=metadata.tokenizer, shard_set=metadata.shard_set, kind=metadata.kind)

    def to_dict(self) -> Dict[str, Any]:
        return {"token_dtype": self.token_dtype, "vocab_size": self.vocab_size,
                "loss_mask_convention": self.loss_mask_convention, "pad_seq_to_mult": self.pad_seq_to_mult,
                "pad_layout": self.pad_layout, "parallelism": self.parallelism, "tokenizer": self.tokenizer,
                "set": None if self.shard_set is None else self.shard_set.to_dict(), "kind": self.kind}

    @classmethod
    def from_dict(cls, raw: Any, path: Optional[str] = None, field: str = "identity") -> "ShardIdentity":
        """Parse an identity strictly (every key of :data:`_IDENTITY_RULES` present, of its
        type and range).

        Raises:
            MetadataError: naming ``path`` and the dotted ``field`` at fault.
        """
        if not isinstance(raw, Mapping):
            raise MetadataError("must be an object", path=path, field=field, actual=raw)
        values = {}
        for key, (check, expected) in _IDENTITY_RULES.items():
            if key not in raw:
                raise MetadataError(f"'{key}' is missing", path=path, field=f"{field}.{key}", expected=expected)
            value = raw[key]
            if not check(value):
                raise MetadataError(f"'{key}' is not {expected}", path=path, field=f"{field}.{key}",
                                    expected=expected, actual=value)
            values[key] = value
        raw_set = values.pop("set")
        values["shard_set"] = None if raw_set is None else ShardSet.from_dict(raw_set, path, f"{field}.set")
        return cls(**values)


def _int_in(name: str, nullable: bool):
    low, high = METADATA_FIELD_RANGES[name]
    return lambda v: (v is None and nullable) or (type(v) is int and low <= v <= high)


def _one_of(*names: str):
    return lambda v: isinstance(v, str) and v in names


def _object_or_null(v: Any) -> bool:
    return v is None or isinstance(v, dict)


#: What each key of a recorded identity must be: ``key -> (check, expected in words)``.
_IDENTITY_RULES = {
    "token_dtype": (_one_of(*(d.name for d in TOKEN_DTYPES)), "'uint16' or 'int32'"),
    "vocab_size": (_int_in("vocab_size", True), "an int in 1..2^31-1 or null"),
    "loss_mask_convention": (_one_of(LOSS_MASK_CONVENTION), repr(LOSS_MASK_CONVENTION)),
    "pad_seq_to_mult": (_int_in("pad_seq_to_mult", False), "an int in 1..2^31-1"),
    "pad_layout": (_one_of(*PAD_LAYOUTS), " or ".join(map(repr, PAD_LAYOUTS))),
    "parallelism": (_object_or_null, "an object or null"),
    "tokenizer": (_object_or_null, "an object or null"),
    "set": (_object_or_null, "an object or null"),
    "kind": (_one_of("sft", "pretrain"), "'sft' or 'pretrain'"),
}


# --------------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class Difference:
    """Why two shards cannot be used as one: ``field``, the two values, and ``words``."""

    field: str
    mine: Any
    theirs: Any
    words: str

    @property
    def hint(self) -> Optional[str]:
        return _HINTS.get(self.field)


def _tokenizer_name(tokenizer: Mapping) -> str:
    name = tokenizer.get("name")
    return repr(name) if isinstance(name, str) and name else "a tokenizer"


def _tokenizer_words(tokenizer: Mapping) -> str:
    """``'name' (files sha256 3f9a0c1e2b7d, vocab 32,000)``: what tells two tokenizers apart."""
    vocab = tokenizer.get("vocab_size")
    facts = [f"files sha256 {_short(tokenizer.get('files_sha256'))}"]
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        facts.append(f"vocab {vocab:,}")
    return f"{_tokenizer_name(tokenizer)} ({', '.join(facts)})"


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest else "none"


def tokenizer_difference(a: Mapping, b: Mapping) -> Optional[Difference]:
    """Tokenizer files first (named with their hashes), then the chat template, in words."""
    if a.get("files_sha256") and b.get("files_sha256"):
        if a["files_sha256"] != b["files_sha256"]:
            return Difference("tokenizer", _short(a["files_sha256"]), _short(b["files_sha256"]),
                              f"tokenized with different tokenizers: {_tokenizer_words(a)} and "
                              f"{_tokenizer_words(b)}")
        ta, tb = a.get("chat_template_sha256"), b.get("chat_template_sha256")
        if ta != tb:
            if ta and tb:
                words = (f"chat template differs: the same tokenizer ({_tokenizer_name(a)}) with "
                         f"different chat templates (sha256 {_short(ta)} and {_short(tb)})")
            else:
                words = (f"chat template differs: the same tokenizer ({_tokenizer_name(a)}), "
                         f"{'only the first' if ta else 'only the second'} rendered with a chat template")
            return Difference("chat_template", _short(ta), _short(tb), words)
        return None
    bare_a = {k: v for k, v in a.items() if k != "path"}  # where the files were is not what they are
    bare_b = {k: v for k, v in b.items() if k != "path"}
    if bare_a != bare_b:
        return Difference("tokenizer", a.get("name"), b.get("name"),
                          f"tokenized with different tokenizers: {_tokenizer_words(a)} and "
                          f"{_tokenizer_words(b)} (their recorded identities differ)")
    return None


def _same_tokenizer(a: Optional[Mapping], b: Optional[Mapping]) -> bool:
    return a is not None and b is not None and tokenizer_difference(a, b) is None


def parallelism_words(value: Optional[Mapping]) -> str:
    if not value:
        return "no recorded CP/TP/SP"
    parts = [f"CP {value.get('cp', 1)}", f"TP {value.get('tp', 1)}"]
    if value.get("sp"):
        parts.append("SP")
    if value.get("fp8"):
        parts.append(f"FP8 {value['fp8']}")
    return ", ".join(parts)


class Agreement:
    """The running comparison of shards read or merged together (see the module table).

    ``add(prefix, identity)`` compares each field with the first shard that recorded it
    and raises on the first disagreement, naming both shards and what differs in words.
    """

    def __init__(self, *, widen: bool = True, doing: str = "read together") -> None:
        self.widen = widen
        self.doing = doing
        self.first: Dict[str, Tuple[str, ShardIdentity]] = {}   # field -> (prefix, identity) that set it

    def _refuse(self, prefix: str, diff: Difference) -> IncompatibleShardsError:
        ref = self.first.get(diff.field, self.first["pad_seq_to_mult"])[0]
        return IncompatibleShardsError(f"cannot be {self.doing} with {ref}: {diff.words}", path=prefix,
                                       field=diff.field, expected=diff.mine, actual=diff.theirs, hint=diff.hint)

    def add(self, prefix: str, identity: ShardIdentity) -> None:
        """Raises: IncompatibleShardsError: ``identity`` disagrees with an earlier shard."""
        diff = self.difference(identity)
        if diff is not None:
            raise self._refuse(prefix, diff)
        for name, known in (("pad_seq_to_mult", True), ("loss_mask_convention", True),
                            ("token_dtype", True), ("tokenizer", identity.tokenizer is not None),
                            ("vocab_size", identity.vocab_size is not None)):
            if known and name not in self.first:
                self.first[name] = (prefix, identity)
        if "chat_template" not in self.first and identity.tokenizer is not None:
            self.first["chat_template"] = (prefix, identity)

    def difference(self, b: ShardIdentity) -> Optional[Difference]:
        """What ``b`` differs in from the shards added so far, or None."""
        ref = {k: ident for k, (_, ident) in self.first.items()}
        a = ref.get("pad_seq_to_mult")
        if a is None:
            return None
        if a.loss_mask_convention != b.loss_mask_convention:
            return Difference("loss_mask_convention", a.loss_mask_convention, b.loss_mask_convention,
                              "different loss-mask conventions")
        if "tokenizer" in ref and b.tokenizer is not None:
            diff = tokenizer_difference(ref["tokenizer"].tokenizer, b.tokenizer)
            if diff is not None:
                return diff
        v = ref.get("vocab_size")
        if v is not None and b.vocab_size is not None and v.vocab_size != b.vocab_size \
                and not _same_tokenizer(v.tokenizer, b.tokenizer):
            return Difference("vocab_size", v.vocab_size, b.vocab_size,
                              f"different vocabularies: {v.vocab_size:,} and {b.vocab_size:,} token ids")
        if a.token_dtype != b.token_dtype and not self.widen:
            return Difference("token_dtype", a.token_dtype, b.token_dtype,
                              f"tokens stored as {a.token_dtype} and as {b.token_dtype}")
        if a.pad_seq_to_mult != b.pad_seq_to_mult:
            return Difference("pad_seq_to_mult", a.pad_seq_to_mult, b.pad_seq_to_mult,
                              f"sequences padded to different multiples: {a.pad_seq_to_mult} and "
                              f"{b.pad_seq_to_mult} tokens (context parallelism)")
        if a.pad_seq_to_mult > 1 and a.pad_layout != b.pad_layout:
            return Difference("pad_layout", a.pad_layout, b.pad_layout,
                              f"padded in {_LAYOUT_WORDS.get(a.pad_layout, a.pad_layout)} and in "
                              f"{_LAYOUT_WORDS.get(b.pad_layout, b.pad_layout)}")
        if a.pad_seq_to_mult > 1 and a.parallelism != b.parallelism:
            return Difference("parallelism", a.parallelism, b.parallelism,
                              f"padded for different parallelism: {parallelism_words(a.parallelism)} and "
                              f"{parallelism_words(b.parallelism)}")
        return None


def require_compatible(shards: Sequence[Tuple[str, ShardIdentity]], *, widen: bool = True,
                       doing: str = "read together") -> None:
    """Refuse shards that disagree (see :class:`Agreement`); readers keep ``widen=True``.

    Raises:
        IncompatibleShardsError: naming the shard, the first one it disagrees with, the
            field, and what differs in words.
    """
    agreement = Agreement(widen=widen, doing=doing)
    for prefix, identity in shards:
        agreement.add(prefix, identity)


def identity_difference(recorded: ShardIdentity, actual: ShardIdentity) -> Optional[str]:
    """In words, how a shard differs from what a manifest recorded for it, or None."""
    if recorded == actual:
        return None
    diff = Agreement(widen=False)
    diff.add("recorded", recorded)
    found = diff.difference(actual)
    if found is not None:
        return found.words
    if recorded.shard_set != actual.shard_set:
        return (f"it belongs to {_set_words(actual.shard_set)}, the manifest lists "
                f"{_set_words(recorded.shard_set)}")
    keys = sorted(k for k, v in recorded.to_dict().items() if actual.to_dict()[k] != v)
    return "its " + ", ".join(keys) + " differ" + ("s" if len(keys) == 1 else "")


# --------------------------------------------------------------------------- sets


def _set_words(s: Optional[ShardSet]) -> str:
    return "no set" if s is None else f"shard {s.index} of {s.describe()}"


def _names(prefixes: Sequence[str], limit: int = 3) -> str:
    names = [os.path.basename(p.rstrip("/")) or p for p in prefixes]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _ranges(values: Sequence[int], limit: int = 6) -> str:
    """``0-7, 9, 12-19`` (the first ``limit`` runs)."""
    runs: List[Tuple[int, int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")


@dataclass
class _Found:
    """The members of one set among the selected shards."""

    shard_set: ShardSet
    by_index: Dict[int, List[str]]

    def present(self) -> int:
        return len(self.by_index)

    def describe(self) -> str:
        return (f"{self.shard_set.describe()}: {self.present()} of its {self.shard_set.count} shards "
                f"({_names([p for k in sorted(self.by_index) for p in self.by_index[k]])})")


def _group(members: Sequence[Tuple[str, Optional[ShardSet]]], source: str):
    """``({id: _Found}, strangers)``; refuses members that disagree on their set's count or name."""
    found: Dict[str, _Found] = {}
    strangers: List[str] = []
    for prefix, s in members:
        if s is None:
            strangers.append(prefix)
            continue
        group = found.setdefault(s.id, _Found(s, {}))
        if (s.count, s.name) != (group.shard_set.count, group.shard_set.name):
            first = next(p for ps in group.by_index.values() for p in ps)
            raise ShardSetError(f"two shards of {s.describe()} disagree about the set: {first} says "
                                f"{group.shard_set.count} shards named {group.shard_set.name!r}, this one "
                                f"{s.count} named {s.name!r}", path=prefix, field="set",
                                expected=group.shard_set.to_dict(), actual=s.to_dict(),
                                hint="the shards' metadata was edited or written by another tool: "
                                     f"rebuild the set read from {source}")
        group.by_index.setdefault(s.index, []).append(prefix)
    return found, strangers


def require_whole_sets(members: Sequence[Tuple[str, Optional[ShardSet]]], *, source: str,
                       selected_by: str) -> None:
    """Refuse shards that do not form whole sets (see the module docstring).

    Args:
        members: ``(prefix, set or None)`` of every shard the selection names.
        source: the directory, glob or manifest as the caller gave it (for messages).
        selected_by: one of :data:`SELECTED_BY`; ``"prefix"`` checks nothing, ``"manifest"``
            completeness, ``"directory"``/``"glob"`` also that one set is selected.

    Raises:
        ShardSetError: a set has members missing or named twice, or a directory or glob holds
            several sets (or a set and shards of no set); the message names the sets (id,
            name), how many of each set's shards are present, and which.
    """
    if selected_by not in SELECTED_BY:
        raise ValueError(f"selected_by must be one of {SELECTED_BY}")
    if selected_by == "prefix":
        return
    found, strangers = _group(members, source)
    if selected_by in ("directory", "glob") and (len(found) > 1 or (found and strangers)):
        parts = [g.describe() for g in sorted(found.values(), key=lambda g: g.shard_set.id)]
        if strangers:
            parts.append(f"{len(strangers)} shard{'s' if len(strangers) > 1 else ''} of no set "
                         f"({_names(strangers)})")
        raise ShardSetError(
            f"this {selected_by} holds shards of more than one set (two generations, or two outputs "
            f"of one run): {'; '.join(parts)}", path=source, field="set", expected="one set",
            actual=f"{len(found)} sets" + (f" and {len(strangers)} shards of no set" if strangers else ""),
            hint="after an interrupted run, rerun it with --resume (or rerun it) to finish the set; "
                 "to read one set, give its manifest (BASE.json) or a glob that names only its shards")
    for group in sorted(found.values(), key=lambda g: g.shard_set.id):
        twice = {k: ps for k, ps in group.by_index.items() if len(ps) > 1}
        if twice:
            k, ps = min(twice.items())
            raise ShardSetError(f"shard {k} of {group.shard_set.describe()} is named more than once: "
                                f"{', '.join(ps)}", path=source, field="set.index", expected="each index once",
                                actual=k, hint="list each shard of the set once")
        missing = sorted(set(range(group.shard_set.count)) - set(group.by_index))
        if missing:
            raise ShardSetError(
                f"{group.describe()} is incomplete: shard{'s' if len(missing) > 1 else ''} "
                f"{_ranges(missing)} of the set {'are' if len(missing) > 1 else 'is'} missing",
                path=source, field="set", expected=f"{group.shard_set.count} shards",
                actual=f"{group.present()} shards",
                hint="the set was not completely published or copied (an interrupted run: rerun it with "
                     "--resume; a copy: copy every shard); to read part of a set on purpose, name its "
                     "shards' prefixes one by one")



def whole_sets(members: Sequence[Tuple[str, Optional[ShardSet]]], *, source: str,
               selected_by: str) -> List[Tuple[Optional[ShardSet], List[str]]]:
    """The sets ``members`` hold, each whole: ``[(set, prefixes in index order)]``, ordered
    train, valid, test first, then by name, or ``[(None or the one set, the prefixes as given)]`` when there is one.

    Several sets are accepted (for a caller that shows each on its own) only when every set
    is complete, each index once, their names are distinct (``train``, ``valid``, ``test``
    of one run) and no shard belongs to no set; two sets of one name (two generations) or a
    partial set are refused with :func:`require_whole_sets`'s message.

    Raises:
        ShardSetError: as :func:`require_whole_sets`.
    """
    found, strangers = _group(members, source)
    names = [g.shard_set.name for g in found.values()]
    whole = all(len(ps) == 1 for g in found.values() for ps in g.by_index.values()) and all(
        g.present() == g.shard_set.count for g in found.values())
    if len(found) < 2 or strangers or None in names or len(set(names)) < len(names) or not whole:
        require_whole_sets(members, source=source, selected_by=selected_by)
        return [(next(iter(found.values())).shard_set if found else None, [p for p, _ in members])]
    groups = sorted(found.values(), key=lambda g: (_SPLIT_ORDER.get(g.shard_set.name, len(_SPLIT_ORDER)),
                                                   g.shard_set.name, g.shard_set.id))
    return [(g.shard_set, [g.by_index[k][0] for k in range(g.shard_set.count)]) for g in groups]
