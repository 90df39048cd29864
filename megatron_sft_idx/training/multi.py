"""Many shards read as one dataset, opened lazily, located in O(log n).

Sources: a list of prefixes, a glob of prefixes, a directory (every shard in it,
sorted by name) or a *manifest*: a small JSON file listing each shard with its
pack count and summary, written once by :func:`write_manifest` /
``tools/write_manifest.py``. Opening a manifest is one file read however many
shards it lists; a list, glob or directory costs one header read per shard.

Pack ``i`` lives in shard ``k = searchsorted(starts, i, "right") - 1`` at local
index ``i - starts[k]``. A shard is mapped the first time one of its packs is
read, in the process that reads it: a DataLoader worker or a rank maps only the
shards its samples fall in. The dataset pickles as its prefixes and counts (no
open files, no manifest re-read).

Manifest (version 1)::

    {"format": "megatron_sft_idx.manifest", "version": 1,
     "shards": [{"prefix": "train_000", "packs": 5000, "summary": {...PackSummary...}}, ...]}

A relative ``prefix`` is relative to the manifest's directory. Opening a shard
whose pack count differs from its manifest entry raises :class:`SizeMismatchError`
(the manifest is stale: rewrite it).
"""

from __future__ import annotations

import glob as _glob
import json
import os
from typing import Dict, List, Sequence, Union

import numpy as np

from .._atomic import write_file_atomically
from ..errors import ShardError, ShardNotFoundError, SizeMismatchError
from ..format import IDX_SUFFIX, SEQ_IDX_SUFFIX
from ..reader import MMapIndexedDataset, pack_index, pack_indices
from ..storage import is_remote
from ._sources import PackSummary, summarize

__all__ = ["MultiShardDataset", "write_manifest", "read_manifest", "is_manifest", "expand_shards",
           "MANIFEST_FORMAT"]

MANIFEST_FORMAT = "megatron_sft_idx.manifest"
MANIFEST_VERSION = 1


def is_manifest(path: str) -> bool:
    """True when ``path`` names a manifest: an existing ``*.json`` file (nothing is read)."""
    return path.endswith(".json") and os.path.isfile(path)


def _shards_in_dir(directory: str) -> List[str]:
    """Every shard prefix in ``directory``: names with an ``.idx`` that is not a ``.seq.idx``."""
    names = sorted(os.listdir(directory))
    return [os.path.join(directory, n[: -len(IDX_SUFFIX)]) for n in names
            if n.endswith(IDX_SUFFIX) and not n.endswith(SEQ_IDX_SUFFIX)]


def expand_shards(spec: Union[str, Sequence[str]]) -> List[str]:
    """Shard prefixes named by a prefix, a directory, a glob of prefixes, or a list of those.

    A glob may name prefixes (``/d/train_*``) or index files (``/d/train_*.idx``).

    Raises:
        ShardNotFoundError: a part of ``spec`` names no shard.
    """
    parts = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: List[str] = []
    for part in parts:
        part = os.fspath(part)
        if is_remote(part):  # s3:// / msc://: a prefix, a "directory" or a glob, by listing
            from ..storage.discover import expand_remote

            found = expand_remote(part)
        elif os.path.isdir(part) and not os.path.exists(part + IDX_SUFFIX):
            found = _shards_in_dir(part)
        elif _glob.has_magic(part):
            pattern = part if part.endswith(IDX_SUFFIX) else part + IDX_SUFFIX
            found = sorted(p[: -len(IDX_SUFFIX)] for p in _glob.glob(pattern)
                           if not p.endswith(SEQ_IDX_SUFFIX))
        else:
            found = [part]
        if not found:
            raise ShardNotFoundError("no shard matches", path=part,
                                     hint="a glob or directory must contain at least one P.idx")
        out.extend(found)
    return out


# --------------------------------------------------------------------------- manifest


def write_manifest(path, shards: Union[str, Sequence[str]], *, relative: bool = True) -> dict:
    """Write a manifest listing ``shards`` (anything :func:`expand_shards` takes).

    Opens each shard's headers once (nothing else) to record its pack count and
    summary; writes atomically. Returns the manifest object.

    Raises:
        ShardError (any subclass): a shard does not open.
    """
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    entries = []
    for prefix in expand_shards(shards):
        shard = MMapIndexedDataset(prefix)
        stored = prefix if is_remote(prefix) else os.path.abspath(prefix)
        if relative and not is_remote(stored):
            stored = os.path.relpath(stored, base)
        entries.append({"prefix": stored, "packs": len(shard), "summary": summarize(shard).to_dict()})
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "shards": entries}
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    write_file_atomically(path, lambda f: f.write(data))
    return manifest


def read_manifest(path) -> tuple:
    """``(prefixes, counts, summaries)`` from a manifest, with one file read.

    Raises:
        ShardError: not a manifest of a supported version, or an entry is malformed.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ShardError(f"cannot read manifest ({exc})", path=path, field="manifest") from None
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ShardError("not a megatron_sft_idx manifest", path=path, field="format",
                         expected=MANIFEST_FORMAT, actual=obj.get("format") if isinstance(obj, dict) else None)
    if obj.get("version") != MANIFEST_VERSION:
        raise ShardError(f"unsupported manifest version; supported: ({MANIFEST_VERSION},)", path=path,
                         field="version", expected=MANIFEST_VERSION, actual=obj.get("version"))
    shards = obj.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ShardError("manifest lists no shards", path=path, field="shards")
    base = os.path.dirname(os.path.abspath(path))
    prefixes, counts, summaries = [], [], []
    for k, entry in enumerate(shards):
        prefix = entry.get("prefix") if isinstance(entry, dict) else None
        packs = entry.get("packs") if isinstance(entry, dict) else None
        if not isinstance(prefix, str) or isinstance(packs, bool) or not isinstance(packs, int) or packs <= 0:
            raise ShardError(f"manifest entry {k} is malformed", path=path, field=f"shards[{k}]",
                             actual=entry, hint="rewrite it with tools/write_manifest.py")
        summary = PackSummary.from_dict(entry.get("summary"), path=path)
        if summary.pack_count != packs:
            raise ShardError(f"manifest entry {k}: packs and summary.pack_count differ", path=path,
                             field=f"shards[{k}].packs", expected=summary.pack_count, actual=packs)
        prefixes.append(prefix if os.path.isabs(prefix) or is_remote(prefix) else os.path.join(base, prefix))
        counts.append(packs)
        summaries.append(summary)
    return prefixes, counts, summaries


# --------------------------------------------------------------------------- dataset


class MultiShardDataset:
    """Packs of many shards, indexed globally in shard order.

    Build with :meth:`open`; ``ds[i] -> Pack``; ``len(ds)``; ``ds.summary``
    (combined); ``ds.shard_of(i) -> (shard, local_index)``.
    """

    def __init__(self, prefixes: Sequence[str], counts: Sequence[int],
                 summaries: Sequence[PackSummary], *, source: str = "<shards>",
                 check_packs: bool = False) -> None:
        if not prefixes:
            raise ShardNotFoundError("no shards given", path=source)
        self.prefixes = [os.fspath(p) for p in prefixes]
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)))
        self.summaries = list(summaries)
        self.summary = PackSummary.combine(self.summaries)
        self.source = source
        self.check_packs = check_packs
        self._open: Dict[int, MMapIndexedDataset] = {}

    @classmethod
    def open(cls, spec, *, check_packs: bool = False) -> "MultiShardDataset":
        """From a manifest path or URL, or from prefixes/globs/directories (one header read per shard)."""
        if isinstance(spec, (str, os.PathLike)) and is_remote(spec) and os.fspath(spec).endswith(".json"):
            from ..storage.discover import read_remote_manifest  # relative prefixes resolve against the URL

            prefixes, counts, summaries = read_remote_manifest(os.fspath(spec))
            return cls(prefixes, counts, summaries, source=os.fspath(spec), check_packs=check_packs)
        if isinstance(spec, (str, os.PathLike)) and is_manifest(os.fspath(spec)):
            prefixes, counts, summaries = read_manifest(spec)
            return cls(prefixes, counts, summaries, source=os.fspath(spec), check_packs=check_packs)
        prefixes = expand_shards(spec)
        shards = [MMapIndexedDataset(p, check_packs=check_packs) for p in prefixes]
        ds = cls(prefixes, [len(s) for s in shards], [summarize(s) for s in shards],
                 source=os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else "<list>",
                 check_packs=check_packs)
        ds._open = dict(enumerate(shards))  # already open: keep them
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
        """Shard ``k``, opened (headers only) on first use in this process."""
        shard = self._open.get(k)
        if shard is None:
            shard = MMapIndexedDataset(self.prefixes[k], check_packs=self.check_packs)
            if len(shard) != int(self.counts[k]):
                raise SizeMismatchError("shard pack count differs from the manifest (stale manifest?)",
                                        path=self.prefixes[k], field="packs",
                                        expected=int(self.counts[k]), actual=len(shard),
                                        hint=f"rewrite {self.source} with tools/write_manifest.py")
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
    def open_shards(self) -> List[int]:
        """Numbers of the shards this process has opened (for tests and diagnostics)."""
        return sorted(self._open)

    def __getstate__(self):
        return {"prefixes": self.prefixes, "counts": self.counts, "summaries": self.summaries,
                "source": self.source, "check_packs": self.check_packs}

    def __setstate__(self, state) -> None:
        self.__init__(state["prefixes"], state["counts"], state["summaries"], source=state["source"],
                      check_packs=state["check_packs"])

    def __repr__(self) -> str:
        return f"MultiShardDataset({self.source!r}, shards={self.num_shards}, packs={len(self)})"
