"""Many shards read as one dataset, opened lazily, located in O(log n).

Sources: a list of prefixes, a glob of prefixes, a directory (every shard in it,
sorted by name) or a *manifest* (:mod:`megatron_sft_idx.manifest`): a small JSON file listing
each shard with its pack count, summary and identity, written once by :func:`megatron_sft_idx.publishing.write_manifest` /
``write-sft-manifest``. Each may be local or in object storage (listed by
:mod:`megatron_sft_idx.storage.discover`). :func:`select_shards` says what a spec names, in one
place; opening a manifest is one read however many shards it lists; a list, glob or directory
costs one header read per shard.

Before anything is read, the shards must agree and form whole sets
(:mod:`megatron_sft_idx.sets`): every shard's tokenizer, chat template, vocabulary,
loss convention, pad multiple and layout agree (token dtypes may differ: each pack is
served in its own); a directory, a glob or a manifest holds every shard of each set it
touches, each once, and a directory or a glob holds one set only.

Pack ``i`` lives in shard ``k = searchsorted(starts, i, "right") - 1`` at local
index ``i - starts[k]``. A shard is mapped the first time one of its packs is
read, in the process that reads it: a DataLoader worker or a rank maps only the
shards its samples fall in. The dataset pickles as its prefixes, counts and identities
(no open files, no manifest re-read). Opening a shard whose pack count or identity
differs from its manifest entry raises (the manifest is stale: rewrite it).

(Its old name ``megatron_sft_idx.training.multi`` warns once: :mod:`megatron_sft_idx._moved`.)
"""

from __future__ import annotations

import dataclasses
import glob as _glob
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import IncompatibleShardsError, ShardNotFoundError, ShardSetError, SizeMismatchError
from .format import IDX_SUFFIX, SEQ_IDX_SUFFIX
from .manifest import (MANIFEST_FORMAT, MANIFEST_SUFFIX, Manifest, is_manifest, load_manifest,
                       manifest_document, open_entry, read_manifest, require_entries_present)
from .packed import PackSummary, summarize
from .reader import MMapIndexedDataset, pack_index, pack_indices
from .sets import ShardIdentity, identity_difference, require_compatible, require_whole_sets
from .storage.urls import is_remote

__all__ = ["MultiShardDataset", "manifest_for", "read_manifest", "is_manifest", "expand_shards",
           "select_shards", "check_selections", "require_present", "selection_identities", "identities_of", "Selection",
           "MANIFEST_FORMAT"]


def _shards_in_dir(directory: str) -> List[str]:
    """Every shard prefix in ``directory``: names with an ``.idx`` that is not a ``.seq.idx``."""
    names = sorted(os.listdir(directory))
    return [os.path.join(directory, n[: -len(IDX_SUFFIX)]) for n in names
            if n.endswith(IDX_SUFFIX) and not n.endswith(SEQ_IDX_SUFFIX)]


@dataclass(frozen=True)
class Selection:
    """Shards named by one part of a spec, and how: ``kind`` is ``"prefix"``,
    ``"directory"``, ``"glob"`` or ``"manifest"`` (then ``manifest`` holds its entries)."""

    kind: str
    source: str
    prefixes: Tuple[str, ...]
    manifest: Optional[Manifest] = None


def select_shards(spec: Union[str, Sequence[str]], *, manifests: bool = True) -> List[Selection]:
    """What each part of ``spec`` (a prefix, directory, glob or manifest, local or a URL, a
    :class:`Selection` already made, or a list of those) names, in order. With
    ``manifests=False`` a ``.json`` part is a prefix.

    Raises:
        ShardNotFoundError: a part names no shard; ShardError: a manifest is malformed.
    """
    parts = [spec] if isinstance(spec, (str, os.PathLike, Selection)) else list(spec)
    out: List[Selection] = []
    for part in parts:
        if isinstance(part, Selection):  # already resolved (e.g. a remote listing done by the caller)
            out.append(part)
            continue
        part = os.fspath(part)
        if manifests and part.endswith(MANIFEST_SUFFIX) and (is_remote(part) or is_manifest(part)):
            m = load_manifest(part)  # a local file or an object: parsed from its bytes
            out.append(Selection("manifest", part, tuple(m.prefixes), m))
            continue
        if is_remote(part):  # s3:// / msc://: a prefix, a "directory" or a glob, by listing
            from .storage.discover import select_remote   # (start-up: the object-store clients load only for a URL)

            kind, found = select_remote(part)
        elif os.path.isdir(part) and not os.path.exists(part + IDX_SUFFIX):
            kind, found = "directory", _shards_in_dir(part)
        elif _glob.has_magic(part):
            pattern = part if part.endswith(IDX_SUFFIX) else part + IDX_SUFFIX
            kind, found = "glob", sorted(p[: -len(IDX_SUFFIX)] for p in _glob.glob(pattern)
                                         if not p.endswith(SEQ_IDX_SUFFIX))
        else:
            kind, found = "prefix", [part]
        if not found:
            raise ShardNotFoundError("no shard matches", path=part,
                                     hint="a glob or directory must contain at least one P.idx")
        out.append(Selection(kind, part, tuple(found)))
    return out


def expand_shards(spec: Union[str, Sequence[str]]) -> List[str]:
    """Shard prefixes named by a prefix, a directory, a glob of prefixes, or a list of those.

    A glob may name prefixes (``/d/train_*``) or index files (``/d/train_*.idx``). Nothing is
    opened, so nothing is checked here (:meth:`MultiShardDataset.open` checks the sets).

    Raises:
        ShardNotFoundError: a part of ``spec`` names no shard.
    """
    return [p for s in select_shards(spec, manifests=False) for p in s.prefixes]


def require_present(selections: Sequence[Selection]) -> None:
    """The local shards every manifest among ``selections`` lists are there (a ``stat`` each),
    for callers that open every shard anyway: a missing one is named as the manifest's entry.

    Raises:
        ShardNotFoundError: naming the manifest and the entry.
    """
    for s in selections:
        if s.manifest is not None:
            require_entries_present(s.source, s.prefixes)


def check_selections(selections: Sequence[Selection], identities: Dict[str, ShardIdentity]) -> None:
    """Every directory, glob and manifest of ``selections`` holds whole sets (``identities``:
    of their shards, by prefix). Agreement across all of them is the caller's (readers and
    merge compare differently).

    Raises:
        ShardSetError: see :func:`megatron_sft_idx.sets.require_whole_sets`.
    """
    for s in selections:
        if s.kind != "prefix":
            require_whole_sets([(p, identities[p].shard_set) for p in s.prefixes], source=s.source,
                               selected_by=s.kind)


def selection_identities(selections: Sequence[Selection]) -> Dict[str, ShardIdentity]:
    """The identity of every shard a directory, glob or manifest selects: from the manifest
    when it records them, else from the shard's headers (opened once, closed again)."""
    out: Dict[str, ShardIdentity] = {}
    for s in selections:
        if s.kind == "prefix":
            continue
        for j, prefix in enumerate(s.prefixes):
            known = s.manifest.identities[j] if s.manifest is not None else None
            out[prefix] = known if known is not None else ShardIdentity.of(MMapIndexedDataset(prefix).metadata)
    return out


def manifest_for(path, shards, *, relative: bool = True) -> dict:
    """The manifest document for ``path`` (a local file, or an ``s3://`` / ``msc://`` object)
    listing ``shards`` (anything :func:`select_shards` takes, local or URLs); written by
    :func:`megatron_sft_idx.publishing.write_manifest`.

    Opens each shard's headers once (nothing else) to record its pack count, summary and
    identity; refuses shards that do not agree or do not form whole sets (a manifest a
    reader would refuse is never written).

    Raises:
        ShardError (any subclass): a shard does not open; IncompatibleShardsError,
            ShardSetError: the shards cannot be read as one set.
    """
    path = os.fspath(path)
    members = []
    selections = select_shards(shards)
    require_present(selections)
    for selection in selections:
        opened = [(p, MMapIndexedDataset(p)) for p in selection.prefixes]
        require_whole_sets([(p, ShardIdentity.of(s.metadata).shard_set) for p, s in opened],
                           source=selection.source, selected_by=selection.kind)
        members.extend(opened)
    return manifest_document(path, members, relative=relative)


# --------------------------------------------------------------------------- dataset


class MultiShardDataset:
    """Packs of many shards, indexed globally in shard order.

    Build with :meth:`open`; ``ds[i] -> Pack``; ``len(ds)``; ``ds.summary``
    (combined); ``ds.shard_of(i) -> (shard, local_index)``. ``identities`` (one per
    shard, or None where unknown) are what each shard must still be when it is opened.
    """

    def __init__(self, prefixes: Sequence[str], counts: Sequence[int],
                 summaries: Sequence[PackSummary], *, source: str = "<shards>",
                 check_packs: bool = False, identities: Optional[Sequence[Optional[ShardIdentity]]] = None,
                 listed_by: Optional[Sequence[Optional[Tuple[str, int]]]] = None) -> None:
        if not prefixes:
            raise ShardNotFoundError("no shards given", path=source)
        self.prefixes = [os.fspath(p) for p in prefixes]
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)))
        self.summaries = list(summaries)
        self.summary = PackSummary.combine(self.summaries)
        self.identities: List[Optional[ShardIdentity]] = (_shared(identities) if identities is not None
                                                          else [None] * len(self.prefixes))
        self.source = source
        #: Per shard, ``(manifest, entry number)`` when a manifest lists it (for messages), else None.
        self.listed_by: List[Optional[Tuple[str, int]]] = (list(listed_by) if listed_by is not None
                                                           else [None] * len(self.prefixes))
        self.check_packs = check_packs
        self._open: Dict[int, MMapIndexedDataset] = {}

    @classmethod
    def open(cls, spec, *, check_packs: bool = False) -> "MultiShardDataset":
        """From manifests (paths or URLs), prefixes, globs and directories, or a list of those.

        A manifest that records its shards' identities costs one read; any other shard is
        opened (headers only) here. Then the shards must agree and form whole sets.

        Raises:
            ShardNotFoundError, ShardError: a part names nothing, or a shard is unreadable.
            IncompatibleShardsError: shards that disagree (tokenizer, template, vocabulary,
                convention, padding); ShardSetError: an incomplete set, or several sets in
                one directory or glob (see :mod:`megatron_sft_idx.sets`).
        """
        selections = select_shards(spec)
        prefixes, counts, summaries, identities, listed_by = [], [], [], [], []
        opened: Dict[int, MMapIndexedDataset] = {}
        for sel in selections:
            m = sel.manifest
            for j, prefix in enumerate(sel.prefixes):
                k = len(prefixes)
                listed_by.append((sel.source, j) if m is not None else None)
                identity = m.identities[j] if m is not None else None
                if identity is None:  # not a manifest, or one written before identities were recorded
                    shard = opened[k] = _open_listed(prefix, listed_by[k], check_packs)
                    if m is not None and len(shard) != m.counts[j]:
                        raise _stale(prefix, sel.source, "packs", m.counts[j], len(shard))
                    identity = ShardIdentity.of(shard.metadata)
                prefixes.append(prefix)
                identities.append(identity)
                counts.append(m.counts[j] if m is not None else len(opened[k]))
                summaries.append(m.summaries[j] if m is not None else summarize(opened[k]))
        checked = len(selections) == 1 and selections[0].manifest is not None and not opened
        if not checked:  # (one manifest recording every identity was checked as it was read)
            check_selections(selections, dict(zip(prefixes, identities)))
            require_compatible(list(zip(prefixes, identities)))
        source = (spec.source if isinstance(spec, Selection) else
                  os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else "<list>")
        ds = cls(prefixes, counts, summaries, source=source,
                 check_packs=check_packs, identities=identities, listed_by=listed_by)
        ds._open = opened  # already open: keep them
        return ds

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.prefixes)

    def shard_of(self, i) -> tuple:
        """``(shard_number, local_index)`` of global pack ``i`` (negative ``i`` counts from the end)."""
        i = pack_index(i, len(self), self.source)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])

    def shard(self, k: int) -> MMapIndexedDataset:
        """Shard ``k``, opened (headers only) on first use in this process.

        Raises:
            SizeMismatchError, ShardSetError: the shard is not the one its manifest lists
                (another pack count, tokenizer, set, ...): the manifest is stale.
        """
        shard = self._open.get(k)
        if shard is None:
            shard = _open_listed(self.prefixes[k], self.listed_by[k], self.check_packs)
            if len(shard) != int(self.counts[k]):
                raise _stale(self.prefixes[k], self.source, "packs", int(self.counts[k]), len(shard))
            recorded = self.identities[k]
            if recorded is not None:
                why = identity_difference(recorded, ShardIdentity.of(shard.metadata))
                if why is not None:
                    raise ShardSetError(f"this shard is not the one {self.source} lists (stale manifest?): {why}",
                                        path=self.prefixes[k], field="identity",
                                        hint=f"the shard was replaced after the manifest was written; rewrite "
                                             f"{self.source} with write-sft-manifest, or restore the shard")
            self._open[k] = shard
        return shard

    def __getitem__(self, i):
        k, local = self.shard_of(i)
        return self.shard(k)[local]

    def get_many(self, indices) -> list:
        """Packs ``indices`` as a list, one ``get_many`` per shard they fall in (so a remote
        shard fetches the batch's blocks in parallel)."""
        idx = pack_indices(indices, len(self), self.source)
        shard_of = np.searchsorted(self.starts, idx, side="right") - 1
        out: list = [None] * idx.size
        for k in np.unique(shard_of).tolist():
            where = np.flatnonzero(shard_of == k)
            for j, pack in zip(where.tolist(), self.shard(k).get_many(idx[where] - int(self.starts[k]))):
                out[j] = pack
        return out

    @property
    def sources(self) -> Optional[tuple]:
        """The names of the sources the shards' source ids name (format 1.2: a mixture's set, whose
        shards share them), None when they record none. Opens the first shard."""
        return self.shard(0).sources

    def source_ids(self, i) -> np.ndarray:
        """Each sequence's source id of global pack ``i`` (uint16; an index into :attr:`sources`).

        Raises:
            ShardError: the shards record no sources; IncompatibleShardsError: the pack's shard names
                other sources than the first shard (shards of different mixtures).
        """
        k, local = self.shard_of(i)
        shard = self.shard(k)
        if shard.sources != self.sources:
            raise IncompatibleShardsError("the shards name different sources (shards of different mixtures?)",
                                          path=self.prefixes[k], field="sources", expected=self.sources,
                                          actual=shard.sources, hint="read the shards of one mixture together")
        return shard.source_ids(local)

    @property
    def open_shards(self) -> List[int]:
        """Numbers of the shards this process has opened (for tests and diagnostics)."""
        return sorted(self._open)

    def __getstate__(self):
        return {"prefixes": self.prefixes, "counts": self.counts, "summaries": self.summaries,
                "source": self.source, "check_packs": self.check_packs, "identities": self.identities,
                "listed_by": self.listed_by}

    def __setstate__(self, state) -> None:
        self.__init__(state["prefixes"], state["counts"], state["summaries"], source=state["source"],
                      check_packs=state["check_packs"], identities=state.get("identities"),
                      listed_by=state.get("listed_by"))

    def __repr__(self) -> str:
        return f"MultiShardDataset({self.source!r}, shards={self.num_shards}, packs={len(self)})"


def _open_listed(prefix: str, listed_by: Optional[Tuple[str, int]], check_packs: bool) -> MMapIndexedDataset:
    """Open one shard; one a manifest lists but that is not there is named as its entry."""
    def opener(p: str) -> MMapIndexedDataset:
        return MMapIndexedDataset(p, check_packs=check_packs)

    if listed_by is None:
        return opener(prefix)
    return open_entry(listed_by[0], prefix, listed_by[1], opener)


def _shared(identities: Sequence[Optional[ShardIdentity]]) -> List[Optional[ShardIdentity]]:
    """The identities with equal tokenizer and parallelism records made one object each, so the
    dataset pickles (to every DataLoader worker) one copy of a set's tokenizer, not one per shard."""
    distinct: List[object] = []  # a few at most: one per tokenizer or layout in the data

    def one(record):
        for known in distinct:
            if known is record or known == record:
                return known
        if record is not None and len(distinct) < 64:
            distinct.append(record)
        return record

    return [None if i is None else dataclasses.replace(i, tokenizer=one(i.tokenizer), parallelism=one(i.parallelism))
            for i in identities]


def _stale(prefix: str, source: str, field: str, expected, actual) -> SizeMismatchError:
    return SizeMismatchError("shard pack count differs from the manifest (stale manifest?)", path=prefix,
                             field=field, expected=expected, actual=actual,
                             hint=f"rewrite {source} with write-sft-manifest")


def identities_of(source) -> List[Tuple[str, ShardIdentity]]:
    """``(prefix, identity)`` of every shard of a packed source: a shard, a multi-shard view;
    nothing for in-memory sources (legacy ``.npy``, Parquet), which record no identity."""
    if isinstance(source, MultiShardDataset):
        return [(p, i if i is not None else ShardIdentity.of(source.shard(k).metadata))
                for k, (p, i) in enumerate(zip(source.prefixes, source.identities))]
    if isinstance(source, MMapIndexedDataset):
        return [(source.prefix, ShardIdentity.of(source.metadata))]
    return []
