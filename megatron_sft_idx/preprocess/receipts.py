"""Receipts: the completion marker of one unit of work.

A step writes a unit's artifacts first (each published atomically), then its receipt
``<dir>/<step>/<unit:06d>.json`` with :func:`~megatron_sft_idx._atomic.write_file_atomically`:
the receipt is the unit's commit point. It records the *key* of the settings the unit ran
with, the size of every artifact (``artifacts``: path relative to the book's base -> bytes)
and the CRC-32 of the small ones the step pins (``crc32``: path -> CRC-32). A rerun with
``--resume`` trusts a receipt only when it parses strictly (types and ranges of every field,
the step's own fields through its ``schema``), its key matches and every artifact is still
there with its recorded size; it redoes the unit otherwise. :meth:`ReceiptBook.verify` checks
the pinned CRC-32s, once per run, before the artifacts are used again. Receipts are small JSON
objects; the driver keeps nothing else per unit.

An artifact's size is what the book's :class:`~.files.Files` view says: the local file's, or,
where the directory is the mirror of object storage whose data the mirror does not hold (the
driver pulls receipts and ``store.json`` alone), the size the bucket lists for its object: a
receipt is valid when its artifacts are there with their recorded sizes, wherever the bytes are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable, Dict, Iterable, Mapping, Optional

from .._atomic import write_file_atomically
from ..errors import MetadataError, ShardError
from ..jsondoc import Doc, check_int, load_json
from .files import LOCAL, Files
from .integrity import check_crc, crc32_file

log = logging.getLogger("megatron_sft_idx.preprocess")

#: The hint of a resumed unit whose artifacts do not verify (logged; the unit is redone).
REDO_HINT = "the unit is done again"
#: ``schema(doc)`` checks a step's own fields of a receipt (raising a ShardError naming the field).
Schema = Callable[[Doc], None]


def settings_key(settings: Mapping) -> str:
    """A short digest of JSON-able settings: equal settings, equal key."""
    raw = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _relative(rel, path: str, field: str) -> str:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise MetadataError("an artifact must be a path relative to the run's directory", path=path, field=field,
                            actual=rel)
    return rel


class ReceiptBook:
    """Receipts of one step.

    Args:
        directory: the receipts root (``<store>/receipts`` or ``<work>/receipts``).
        step: the step's name (a subdirectory).
        key: the settings key every receipt of this book must carry.
        base: artifacts are recorded relative to this directory (so a store can move).
        schema: checks the step's own fields (default: none beyond the common ones).
        files: how artifacts are seen (default: local files; a mirror's view, :mod:`.files`).
    """

    def __init__(self, directory: str, step: str, key: str, base: str, schema: Optional[Schema] = None,
                 files: Files = LOCAL) -> None:
        self.directory = os.path.join(directory, step)
        self.step = step
        self.key = key
        self.base = base
        self.schema = schema
        self.files = files
        self.rejected: Dict[int, str] = {}   # unit -> why its receipt was malformed

    def path(self, unit: int) -> str:
        return os.path.join(self.directory, f"{unit:06d}.json")

    def write(self, unit: int, body: Mapping, artifacts: Iterable[str] = (), pinned: Iterable[str] = ()) -> dict:
        """Record ``unit`` as done; ``artifacts`` are paths whose sizes the receipt pins, ``pinned``
        those of them whose CRC-32 it pins too (small files: each is read once here)."""
        sizes = {}
        for path in artifacts:
            sizes[os.path.relpath(path, self.base)] = os.path.getsize(path)
        receipt = dict(body)
        receipt.update(step=self.step, unit=unit, key=self.key, artifacts=sizes)
        crcs = {os.path.relpath(path, self.base): crc32_file(path) for path in pinned}
        if crcs:
            receipt["crc32"] = crcs
        data = json.dumps(receipt, sort_keys=True).encode()
        os.makedirs(self.directory, exist_ok=True)
        write_file_atomically(self.path(unit), lambda f: f.write(data))
        return receipt

    def parse(self, unit: int) -> Optional[dict]:
        """The receipt of ``unit`` parsed strictly; None when there is none, or it is another run's
        (another key).

        Raises:
            ShardError: the receipt is malformed (naming the file and the field).
        """
        path = self.path(unit)
        try:
            receipt = load_json(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ShardError(f"cannot read the receipt ({exc.strerror or exc})", path=path) from None
        doc = Doc(receipt, path)
        if doc.str("key") != self.key:
            return None
        doc.str("step", choices=[self.step])
        check_int(doc.raw("unit"), path, "unit", unit, unit)
        sizes = doc.ints("artifacts", lo=0)
        for rel in sizes:
            _relative(rel, path, "artifacts")
        crcs = doc.ints("crc32", lo=0, hi=0xFFFFFFFF, default={})
        for rel in crcs:
            if rel not in sizes:
                raise MetadataError("a pinned CRC-32 names no artifact of the receipt", path=path, field="crc32",
                                    actual=rel)
        if self.schema is not None:
            self.schema(doc)
        return receipt

    def read(self, unit: int, artifacts: bool = True) -> Optional[dict]:
        """The receipt of ``unit`` when it is valid (it parses, its key matches and, with
        ``artifacts``, every artifact has its recorded size), else None: the unit is redone.
        A malformed receipt is logged once (naming the file and field), never raised."""
        try:
            receipt = self.parse(unit)
        except ShardError as exc:
            if self.rejected.get(unit) != str(exc):   # (logged once per book and receipt)
                log.warning("receipt ignored (its unit counts as not done): %s", exc)
            self.rejected[unit] = str(exc)
            return None
        if receipt is None:
            return None
        if artifacts:
            for rel, size in receipt["artifacts"].items():
                if self.files.size(os.path.join(self.base, rel)) != size:
                    return None
        return receipt

    def verify(self, receipt: dict, hint: str) -> None:
        """Check the CRC-32 of every artifact ``receipt`` pins.

        Raises:
            ChecksumError: an artifact's bytes changed since the receipt was written.
        """
        for rel, crc in receipt.get("crc32", {}).items():
            check_crc(os.path.join(self.base, rel), crc, f"{self.step} artifact {rel}", hint)

    def discard(self, unit: int) -> None:
        """Remove ``unit``'s receipt: the unit is no longer done (its artifacts did not verify)."""
        try:
            os.unlink(self.path(unit))
        except FileNotFoundError:
            pass

    def present(self) -> Dict[int, dict]:
        """``{unit: receipt}`` of every valid receipt on disk (when the unit count is not known)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        units = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
        return self.completed(sorted(units))

    def completed(self, units: Iterable[int]) -> Dict[int, dict]:
        """``{unit: receipt}`` of the units already done."""
        out = {}
        for unit in units:
            receipt = self.read(unit)
            if receipt is not None:
                out[unit] = receipt
        return out
