"""The mirrored engine: any engine's units run on mirrors of object storage.

Where a run's store or work directory is in object storage (a bucket workspace,
:mod:`..workspace`), every step keeps working on local paths: the driver's paths under its
mirrors (:class:`~megatron_sft_idx.storage.mirror.Mirror`). :class:`MirroredEngine` wraps the
local or the Ray engine so that every step it maps runs as :class:`Mirrored`, on whichever node:

1. the step's paths are *rebased* from the driver's local roots to this node's
   (:func:`rebase`, over the step's dataclass fields and the receipt books it carries), and
   every :class:`~..files.Files` view in it becomes this node's (:class:`~..files.MirroredFiles`);
2. what the unit reads is pulled: the URLs the engine was told the step reads whole, or --
   for a step that names its reads (``reads(unit)``: local paths) -- the mirrors' metadata
   (receipts, ``store.json``) and those files alone;
3. the unit runs (holding this node's copies: :meth:`~megatron_sft_idx.storage.mirror.Mirror.in_use`);
   a step with a ``book`` then pushes the artifacts its receipt lists (commit
   points last) and then its receipt -- only while the run that started it still holds its
   locks (checked before the artifacts and again before the receipt), so a task a killed
   driver left running never commits into the run that took over. A step without a ``book``
   is a check: its unit returns a verdict and pushes nothing.

Before each step the driver's own changes are synced to the bucket; after it, the receipts the
units pushed are pulled: the driver holds receipts and ``store.json`` only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Callable, Dict, List, Sequence, Tuple

from ...errors import ShardError
from ...storage.lease import ObjectLock
from ..files import MirroredFiles, is_files, is_metadata
from ..receipts import ReceiptBook
from .base import Engine, OnDone, OnProgress


def rebase(obj, roots: Dict[str, str], files=None):
    """``obj`` with every path under a key of ``roots`` moved under its value (strings, tuples,
    lists, dicts, dataclass fields and :class:`ReceiptBook` attributes, recursively), and every
    :class:`~..files.Files` view replaced by ``files`` (when given)."""
    if isinstance(obj, str):
        for old, new in roots.items():
            if obj == old or obj.startswith(old + os.sep):
                return new + obj[len(old):]
        return obj
    if files is not None and is_files(obj):
        return files
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(rebase(x, roots, files) for x in obj)
    if isinstance(obj, list):
        return [rebase(x, roots, files) for x in obj]
    if isinstance(obj, dict):
        return {k: rebase(v, roots, files) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: rebase(getattr(obj, f.name), roots, files) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, ReceiptBook):
        out = copy.copy(obj)
        out.directory, out.base = rebase(obj.directory, roots), rebase(obj.base, roots)
        out.files = files if files is not None else obj.files
        out.rejected = {}
        return out
    return obj


@dataclasses.dataclass(frozen=True)
class Mirrored:
    """``step`` with its unit's inputs pulled from, and its outputs pushed to, ``mirrors`` (module
    doc). ``roots``: each mirror's local root on the driver (rebased to this node's own);
    ``pulls``: the URLs (a root or a prefix under it) the units read whole."""

    step: object
    mirrors: Tuple[object, ...]
    roots: Tuple[str, ...]
    pulls: Tuple[str, ...] = ()
    skeleton: Tuple[Tuple[str, ...], ...] = ()   # per mirror: its directories on the driver (made on every node)
    held: Tuple[Tuple[str, str], ...] = ()        # (lock URL, nonce) of the locks the run holds

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def writes_to(self) -> str:
        return getattr(self.step, "writes_to", "")

    def prepare(self) -> None:
        prepare = getattr(self.step, "prepare", None)
        if prepare is not None:
            prepare()

    def run(self, unit: int) -> dict:
        here = self.mirrors   # (unpickled on a node, a mirror's local root is that node's)
        roots = {old: m.local for old, m in zip(self.roots, here) if old != m.local}
        step = rebase(self.step, roots, MirroredFiles(tuple(here)))
        with contextlib.ExitStack() as held:   # (no other run's cleanup removes this node's copy meanwhile)
            for mirror in here:
                held.enter_context(mirror.in_use())
            return self._run(step, unit)

    def _run(self, step, unit: int) -> dict:
        here = self.mirrors
        self._pull(step, unit)
        receipt = step.run(unit)
        book = getattr(step, "book", None)
        if book is None:   # a unit that checks (a verdict) and writes nothing
            return receipt
        files = [os.path.join(book.base, *rel.split("/")) for rel in receipt["artifacts"]]
        self._still_held(unit)
        for mirror in here:
            mirror.push(mirror.in_order(p for p in files if mirror.rel(p) is not None))
        self._still_held(unit)   # (again, just before the commit point)
        for mirror in here:
            if mirror.rel(book.path(unit)) is not None:
                mirror.push([book.path(unit)])
        return receipt

    def _pull(self, step, unit: int) -> None:
        """What the unit reads, then the mirrors' directories as the driver has them."""
        here = self.mirrors
        for url in self.pulls:
            for mirror in here:
                if url == mirror.url or url.startswith(mirror.url + "/"):
                    mirror.pull(url[len(mirror.url) + 1:])
        if hasattr(step, "reads"):   # a unit that names what it reads: the metadata, then those files
            for mirror in here:
                mirror.pull(only=is_metadata)
            paths = list(step.reads(unit))
            for mirror in here:
                mirror.fetch_paths(paths)
        for k, mirror in enumerate(here):
            os.makedirs(mirror.local, exist_ok=True)
            for rel in (self.skeleton[k] if k < len(self.skeleton) else ()):
                os.makedirs(mirror.child(rel), exist_ok=True)

    def _still_held(self, unit: int) -> None:
        """Refuse to push for a run that no longer holds its locks: a task left running by a
        killed driver must not commit into the mirror of the run that took the lock over.

        Raises:
            ShardError: a lock is gone or another run's, naming it."""
        for url, nonce in self.held:
            holder = ObjectLock(url, "").owner()
            if holder is None or holder["nonce"] != nonce:
                raise ShardError(f"{self.name} unit {unit}: the run that started it no longer holds its lock; "
                                 "nothing of the unit was committed", path=url, field="lock",
                                 expected=nonce, actual=None if holder is None else holder["nonce"],
                                 hint="another run took the work over (its driver was killed); nothing to do")


class MirroredEngine:
    """``engine`` whose steps run :class:`Mirrored` on ``mirrors`` (module doc). ``pulls``: step
    name -> the URLs its units read whole; ``locks()``: the locks the run holds now."""

    def __init__(self, engine: Engine, mirrors: Sequence[object], pulls: Dict[str, Tuple[str, ...]],
                 locks: Callable[[], Sequence[ObjectLock]] = tuple) -> None:
        self.engine, self.mirrors, self.pulls, self.locks = engine, tuple(mirrors), dict(pulls), locks
        self.name = engine.name

    def map(self, step, units, on_done: OnDone, on_progress: OnProgress = None) -> None:
        self.sync()
        skeleton = tuple(tuple(_directories(m.local)) for m in self.mirrors)
        held = tuple((str(lock.url), lock.nonce) for lock in self.locks() if lock.held)
        roots = tuple(m.local for m in self.mirrors)
        self.engine.map(Mirrored(step, self.mirrors, roots, self.pulls.get(step.name, ()), skeleton, held), units,
                        on_done, on_progress)
        self.pull()

    def sync(self) -> None:
        for mirror in self.mirrors:
            mirror.sync()

    def pull(self) -> None:
        for mirror in self.mirrors:
            mirror.pull(only=is_metadata)

    def describe(self) -> dict:
        return dict(self.engine.describe(), bucket_areas=[m.url for m in self.mirrors])

    def remove_copies(self) -> None:
        """After the run's success: every node's copy of the mirrors removed, but where a run of
        that node holds one (:meth:`~megatron_sft_idx.storage.mirror.Mirror.remove_if_unused`;
        the driver's own, held until the run ends, is removed by its workspace). An engine whose
        units run on the driver's node alone has nothing to do here."""
        every = getattr(self.engine, "on_every_node", None)
        if every is not None:
            every(_remove_copies, self.mirrors)

    def close(self) -> None:
        self.engine.close()


def _remove_copies(mirrors) -> None:
    """On a node: its copies of ``mirrors`` removed unless a run there holds one."""
    for mirror in mirrors:
        mirror.remove_if_unused()


def _directories(root: str) -> List[str]:
    """The directories under ``root`` (``/``-separated, relative), parents first."""
    out = []
    for directory, names, _ in os.walk(root):
        out.extend(os.path.relpath(os.path.join(directory, n), root).replace(os.sep, "/") for n in sorted(names))
    return out


__all__ = ["Mirrored", "MirroredEngine", "rebase"]
