"""What a merge will write, decided from the inputs' headers alone (no data is read).

:func:`plan_merge` opens each input's headers once, in order, refuses inputs that
cannot become one shard, and folds everything the output needs into running
totals, so its memory is one path and one pack count per input, whatever the
inputs hold. The rules, by metadata key:

=========================  ============================================================
key                        rule
=========================  ============================================================
tokenizer, vocab_size,     the one comparison every reader of several shards makes
token_dtype,               (:class:`megatron_sft_idx.sets.Agreement`, ``widen`` from
loss_mask_convention,      ``--widen``): a difference is an :class:`IncompatibleShardsError`
pad_seq_to_mult,           naming the key, the first input and the one that differs, and
pad_layout, parallelism    saying in words what differs
any key not listed here    equal, else :class:`IncompatibleShardsError`: a key a newer
                           format adds is never mixed silently
token_dtype                int32 when any input is int32 (with ``widen``)
parallelism, pad_layout    without padding ``parallelism`` is kept when equal, else
                           dropped (noted), and the first input's ``pad_layout`` is kept
tokenizer                  an input without one makes the output's unknown (noted)
pack_size                  the largest (or the caller's, if no pack is longer)
vocab_size                 the largest when all are known, else unknown (noted)
packing                    kept when equal, else dropped (noted)
set                        dropped: the output is one shard, no member of a set
source                     ``{"merged": {"inputs": [...], "shards": K}}`` plus the inputs'
                           common source when they share one
extra                      the entries every input agrees on
stats, files, producer     recomputed by the merge
=========================  ============================================================

Inputs named by a directory, a glob or a manifest must form whole sets, as for every
reader (:func:`~megatron_sft_idx.sets.require_whole_sets`); a shard named by its prefix is
merged whatever set it belongs to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import IncompatibleShardsError, InvariantError, ShardError
from ..format import DType
from ..reader import MMapIndexedDataset
from ..storage.destination import destination_for
from ..metadata import ShardSet
from ..sets import Agreement, ShardIdentity, whole_sets
from ..multi import Selection, check_selections, require_present, select_shards, selection_identities

#: Keys the merge recomputes, combines by its own rule or compares through ``sets.Agreement``;
#: every other key must be equal.
_COMBINED_KEYS = frozenset({"format", "stats", "files", "producer", "source", "extra", "packing",
                            "pack_size", "vocab_size", "token_dtype", "tokenizer", "parallelism",
                            "pad_layout", "pad_seq_to_mult", "loss_mask_convention", "set"})


@dataclass
class MergePlan:
    """The inputs in order and everything the output's header and metadata need."""

    prefixes: List[str]
    packs: np.ndarray                 # int64 pack count per input
    dtype: DType                      # output token dtype
    metadata: Dict[str, Any]          # the output's metadata but stats, files and producer
    totals: Dict[str, int]            # packs, sequences, tokens, loss_tokens, max_packed, uint16_inputs
    notes: List[str] = field(default_factory=list)

    @property
    def pack_size(self) -> Optional[int]:
        return self.metadata["pack_size"]


def resolve_selections(inputs: Sequence[str]) -> List[Selection]:
    """What each input names (prefixes, globs, directories and manifests, local paths or
    ``s3://`` / ``msc://`` URLs), in the order given; a shard named twice is refused.

    Raises:
        ShardNotFoundError: an input names no shard.
        ShardError: a manifest is malformed, or a shard is named twice.
    """
    selections = select_shards([os.fspath(part) for part in inputs])
    seen: Dict[str, str] = {}
    for prefix in (p for s in selections for p in s.prefixes):
        key = destination_for(prefix).key(prefix)
        if key in seen:
            raise ShardError("the same shard is named twice", path=prefix, field="inputs",
                             expected="each shard once", actual=f"also named as {seen[key]}",
                             hint="list each shard once; weight data with blends, not duplicates")
        seen[key] = prefix
    return selections


def resolve_inputs(inputs: Sequence[str]) -> List[str]:
    """Shard prefixes named by prefixes, globs, directories and manifests, in the order given
    (see :func:`resolve_selections`); the shards of each directory, glob and manifest must
    form whole sets (their headers are read once to check, unless a manifest records them).

    Raises:
        ShardNotFoundError: an input names no shard.
        ShardError: a manifest is malformed, or a shard is named twice; ShardSetError: a
            directory, glob or manifest holds part of a set, or several sets.
    """
    selections = resolve_selections(inputs)
    require_present(selections)
    check_selections(selections, selection_identities(selections))
    return [p for s in selections for p in s.prefixes]


def resolve_sets(inputs: Sequence[str]) -> List[Tuple[Optional[ShardSet], List[str]]]:
    """Like :func:`resolve_inputs`, for a tool that shows each set on its own: one directory
    or glob holding several whole sets of distinct names (the splits of one run:
    ``chat_train``, ``chat_valid``, ``chat_test``) gives each set with its prefixes; every
    other input gives one group ``(None, prefixes)``.

    Raises:
        as :func:`resolve_inputs` (a partial set, two sets of one name, shards of no set
        beside a set: ShardSetError).
    """
    selections = resolve_selections(inputs)
    if len(selections) != 1 or selections[0].kind not in ("directory", "glob"):
        require_present(selections)
        check_selections(selections, selection_identities(selections))
        return [(None, [p for s in selections for p in s.prefixes])]
    only = selections[0]
    identities = selection_identities(selections)
    groups = whole_sets([(p, identities[p].shard_set) for p in only.prefixes], source=only.source,
                        selected_by=only.kind)
    return groups if len(groups) > 1 else [(None, groups[0][1])]


#: The loss policy preprocess records in ``extra`` (``loss_on``, ``loss_policy``: defaults left
#: out), as the flags that set it and their defaults.
_POLICY_FLAGS = (("loss_on", "--loss-on", None), ("tool_calls", "--tool-call-loss", "train"),
                 ("reasoning", "--reasoning-loss", "train"), ("empty_reasoning", "--empty-reasoning-loss", "mask"),
                 ("reasoning_tags", "--reasoning-tags", None))


def _loss_policy(extra: Any) -> Optional[Dict[str, Any]]:
    """``{flag: value}`` of the loss policy ``extra`` records, or None (not written by preprocess)."""
    if not isinstance(extra, dict) or "loss_on" not in extra:
        return None
    policy = extra.get("loss_policy") if isinstance(extra.get("loss_policy"), dict) else {}
    return {flag: extra["loss_on"] if key == "loss_on" else policy.get(key, default)
            for key, flag, default in _POLICY_FLAGS}


def _require_same_loss_policy(first: str, first_extra: Any, prefix: str, extra: Any) -> None:
    """Raises: IncompatibleShardsError: both record a loss policy and they differ (named by flag)."""
    mine, theirs = _loss_policy(first_extra), _loss_policy(extra)
    if mine is None or theirs is None or mine == theirs:
        return
    words = ", ".join(f"{flag} {mine[flag]} in {first}, {theirs[flag]} here"
                      for flag in mine if mine[flag] != theirs[flag])
    raise IncompatibleShardsError(
        f"cannot be merged with {first}: loss policy differs: {words}", path=prefix, field="extra.loss_policy",
        hint="a merged shard records one loss policy: re-run preprocess-sft (or repack-sft) for one input "
             "with the other's flags, or train on both as a blend or manifest instead of merging them")


class _Fold:
    """Running comparison and combination of the inputs' metadata (see the module table)."""

    def __init__(self, first: MMapIndexedDataset, widen: bool) -> None:
        self.first = first.prefix
        self.ref = first.metadata.to_dict()
        self.agreement = Agreement(widen=widen, doing="merged")
        self.dtypes = set()
        self.tokenizer = self.ref.get("tokenizer")
        self.tokenizer_missing = False
        self.packing = self.ref.get("packing")
        self.parallelism = self.ref.get("parallelism")
        self.source = self.ref.get("source")
        self.extra = dict(self.ref.get("extra") or {})
        self.vocab: Optional[int] = self.ref.get("vocab_size")
        self.vocab_missing = self.vocab is None
        self.vocab_seen = self.vocab is not None
        self.pack_size: Optional[int] = self.ref.get("pack_size")
        self.notes: List[str] = []

    def add(self, shard: MMapIndexedDataset) -> None:
        """Raises: IncompatibleShardsError: ``shard`` cannot be merged with the inputs before it."""
        self.agreement.add(shard.prefix, ShardIdentity.of(shard.metadata))
        meta = shard.metadata.to_dict()
        for key in sorted((set(meta) | set(self.ref)) - _COMBINED_KEYS):
            if meta.get(key) != self.ref.get(key):
                raise IncompatibleShardsError(
                    f"'{key}' differs between inputs: {self.first} has {self.ref.get(key)!r}, this shard has "
                    f"{meta.get(key)!r}", path=shard.prefix, field=key, expected=self.ref.get(key),
                    actual=meta.get(key))
        self.dtypes.add(meta["token_dtype"])
        tokenizer = meta.get("tokenizer")
        if tokenizer is None:
            self.tokenizer_missing = True
        elif self.tokenizer is None:
            self.tokenizer = tokenizer
        if meta.get("parallelism") != self.parallelism:
            self.parallelism = None  # (padded inputs with different ones were refused above)
        if meta.get("packing") != self.packing:
            self.packing = None
        if meta.get("source") != self.source:
            self.source = None
        extra = meta.get("extra") or {}
        _require_same_loss_policy(self.first, self.ref.get("extra"), shard.prefix, extra)
        self.extra = {k: v for k, v in self.extra.items() if k in extra and extra[k] == v}
        vocab = meta.get("vocab_size")
        self.vocab_seen |= vocab is not None
        if vocab is None:
            self.vocab_missing = True
        elif not self.vocab_missing:
            self.vocab = max(self.vocab, vocab)
        size = meta.get("pack_size")
        self.pack_size = None if size is None or self.pack_size is None else max(self.pack_size, size)

    def result(self, inputs: Sequence[str], shard_count: int, dtype: DType,
               pack_size: Optional[int]) -> Dict[str, Any]:
        """The output's metadata as a dict, without ``stats``/``files``/``producer`` (the merge
        fills those). Built on the first input's, so keys a newer format adds carry over."""
        out = {k: v for k, v in self.ref.items() if k not in ("stats", "files", "producer", "set")}
        if self.tokenizer_missing and self.tokenizer is not None:
            self.notes.append("some inputs record no tokenizer: the output's tokenizer is unknown")
            self.tokenizer = None
        if self.vocab_missing and self.vocab_seen:
            self.notes.append("some inputs record no vocab_size: the output's is unknown")
        if self.packing is None and self.ref.get("packing") is not None:
            self.notes.append("inputs were packed with different settings: 'packing' is not recorded")
        if self.parallelism is None and self.ref.get("parallelism") is not None:
            self.notes.append("inputs record different CP/TP/SP (unpadded): 'parallelism' is not recorded")
        source = dict(self.source or {})
        source["merged"] = {"inputs": [os.fspath(i) for i in inputs], "shards": shard_count}
        out.update(token_dtype=dtype.name, pack_size=pack_size, source=source,
                   vocab_size=None if self.vocab_missing else self.vocab,
                   tokenizer=self.tokenizer, packing=self.packing, parallelism=self.parallelism,
                   extra=self.extra or None)
        return {k: v for k, v in out.items() if v is not None or k in ("pack_size", "vocab_size")}


def plan_merge(inputs: Sequence[str], *, widen: bool = False, pack_size: Optional[int] = None) -> MergePlan:
    """Open every input's headers once and decide the output (see the module table).

    Raises:
        ShardNotFoundError, ShardError: an input is missing or unreadable.
        IncompatibleShardsError: inputs that cannot become one shard.
        InvariantError: ``pack_size`` is shorter than an input's longest pack.
    """
    selections = resolve_selections(inputs)
    require_present(selections)
    prefixes = [p for s in selections for p in s.prefixes]
    packs = np.zeros(len(prefixes), dtype=np.int64)
    totals = {"packs": 0, "sequences": 0, "tokens": 0, "loss_tokens": 0, "max_packed": 0, "uint16_inputs": 0}
    fold: Optional[_Fold] = None
    identities = {}
    for k, prefix in enumerate(prefixes):
        shard = MMapIndexedDataset(prefix)
        if shard.is_pretrain:
            raise IncompatibleShardsError(
                "this input is upstream pretrain data (.bin/.idx only): it has no loss mask or sequence starts",
                path=prefix, field="kind", expected="sft", actual="pretrain",
                hint="convert it first: convert-packed PREFIX OUT --pack-size N")
        identities[prefix] = ShardIdentity.of(shard.metadata)
        fold = fold or _Fold(shard, widen)
        fold.add(shard)
        stats = shard.metadata.stats
        packs[k] = stats.pack_count
        totals["packs"] += stats.pack_count
        totals["sequences"] += stats.sequence_count
        totals["tokens"] += stats.token_count
        totals["loss_tokens"] += stats.loss_token_count
        totals["max_packed"] = max(totals["max_packed"], stats.max_packed_seqlen)
        totals["uint16_inputs"] += shard.dtype == DType.uint16
    check_selections(selections, identities)
    dtype = DType.int32 if "int32" in fold.dtypes else DType.uint16
    out_size = fold.pack_size
    if pack_size is not None:
        if pack_size < totals["max_packed"]:
            raise InvariantError("--pack-size is shorter than the longest pack of the inputs",
                                 field="pack_size", expected=f">= {totals['max_packed']}", actual=pack_size,
                                 rule="PACK_TOO_LONG", hint="leave --pack-size out to keep the inputs' largest")
        out_size = pack_size
    metadata = fold.result(inputs, len(prefixes), dtype, out_size)
    return MergePlan(prefixes, packs, dtype, metadata, totals, fold.notes)
