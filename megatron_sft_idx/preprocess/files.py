"""How a unit of work sees the run's files: on local disk, or mirrored from object storage.

Every step and every reader of receipts works on local paths. Where those paths are a mirror of
an object-storage prefix (:class:`~megatron_sft_idx.storage.mirror.Mirror`), a unit holds only
what it pulled: the sizes of the other objects come from the mirror's listing, and a unit that
learns what it reads as it goes (``--verify-masks``) fetches it. A :class:`Files` view says both,
and is handed to whoever needs it -- a step's ``files`` field, a :class:`~.receipts.ReceiptBook`,
a :class:`~.store.SequenceStore` -- by the workspace (the driver's view) or by the mirrored
engine (the node's own view, :mod:`.engines.mirrored`). Nothing looks it up globally.

Also here: the order a mirror writes a run's files in (:func:`commit_rank`: data, then a shard's
``.idx``, then receipts -- each unit's commit point -- last) and what the driver pulls of a
mirror (:func:`is_metadata`: receipts and ``store.json``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Tuple

from ..format import IDX_SUFFIX, SEQ_IDX_SUFFIX


class Files(Protocol):
    """A view of the run's files (see the module doc)."""

    def size(self, path: str) -> Optional[int]:
        """The size of ``path`` (bytes), or None when it is not there."""

    def fetch(self, paths: Iterable[str]) -> None:
        """Make the local ``paths`` readable here (a no-op where they are local already)."""


class LocalFiles:
    """Files on a local (or shared) filesystem: everything is where its path says."""

    def size(self, path: str) -> Optional[int]:
        try:
            return os.path.getsize(path)
        except OSError:
            return None

    def fetch(self, paths: Iterable[str]) -> None:
        pass

    def __repr__(self) -> str:
        return "LocalFiles()"

    def __eq__(self, other) -> bool:
        return isinstance(other, LocalFiles)

    def __hash__(self) -> int:
        return hash(LocalFiles)


#: The view of local files (the default everywhere).
LOCAL = LocalFiles()


@dataclass(frozen=True)
class MirroredFiles:
    """Files under the local roots of ``mirrors`` as their mirrors know them; other paths local."""

    mirrors: Tuple[object, ...]

    def _mirror(self, path: str):
        for mirror in self.mirrors:
            if mirror.rel(path) is not None:
                return mirror
        return None

    def size(self, path: str) -> Optional[int]:
        mirror = self._mirror(path)
        return LOCAL.size(path) if mirror is None else mirror.size(path)

    def fetch(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        for mirror in self.mirrors:
            mirror.fetch_paths(paths)


def is_files(obj) -> bool:
    """Whether ``obj`` is a view of files (replaced by the node's own where a unit runs)."""
    return isinstance(obj, (LocalFiles, MirroredFiles))


def is_receipt(rel: str) -> bool:
    return rel.startswith("receipts/") or "/receipts/" in rel


#: The small JSON of a mirror the driver reads besides receipts (a store's description).
_METADATA_NAMES = ("store.json",)


def is_metadata(rel: str) -> bool:
    """What the driver pulls of a mirror: receipts and ``store.json`` -- never a partition, its
    ``.rows``, the plan body or a staged shard (the units read those where they run)."""
    return (is_receipt(rel) and rel.endswith(".json")) or rel.rsplit("/", 1)[-1] in _METADATA_NAMES


def commit_rank(rel: str) -> Tuple[bool, bool]:
    """The order a run's files are written to object storage in: data files, then a shard's
    ``.idx`` (its commit point), then receipts (a unit's); deletions go in the reverse order."""
    return is_receipt(rel), rel.endswith(IDX_SUFFIX) and not rel.endswith(SEQ_IDX_SUFFIX)


__all__ = ["Files", "LocalFiles", "MirroredFiles", "LOCAL", "is_files", "is_receipt", "is_metadata", "commit_rank"]
