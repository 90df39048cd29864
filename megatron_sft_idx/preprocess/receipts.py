"""Receipts: the completion marker of one unit of work.

A step writes a unit's artifacts first (each published atomically), then its receipt
``<dir>/<step>/<unit:06d>.json`` with :func:`~megatron_sft_idx._atomic.write_file_atomically`:
the receipt is the unit's commit point. It records the *key* of the settings the unit ran
with and the size of every artifact; a rerun with ``--resume`` trusts a receipt only when the
key matches and every artifact is still there with its recorded size, and redoes the unit
otherwise. Receipts are small JSON objects; the driver keeps nothing else per unit.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Iterable, Mapping, Optional

from .._atomic import write_file_atomically


def settings_key(settings: Mapping) -> str:
    """A short digest of JSON-able settings: equal settings, equal key."""
    raw = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


class ReceiptBook:
    """Receipts of one step.

    Args:
        directory: the receipts root (``<store>/receipts`` or ``<work>/receipts``).
        step: the step's name (a subdirectory).
        key: the settings key every receipt of this book must carry.
        base: artifacts are recorded relative to this directory (so a store can move).
    """

    def __init__(self, directory: str, step: str, key: str, base: str) -> None:
        self.directory = os.path.join(directory, step)
        self.step = step
        self.key = key
        self.base = base

    def path(self, unit: int) -> str:
        return os.path.join(self.directory, f"{unit:06d}.json")

    def write(self, unit: int, body: Mapping, artifacts: Iterable[str] = ()) -> dict:
        """Record ``unit`` as done; ``artifacts`` are paths whose sizes the receipt pins."""
        sizes = {}
        for path in artifacts:
            sizes[os.path.relpath(path, self.base)] = os.path.getsize(path)
        receipt = dict(body)
        receipt.update(step=self.step, unit=unit, key=self.key, artifacts=sizes)
        data = json.dumps(receipt, sort_keys=True).encode()
        os.makedirs(self.directory, exist_ok=True)
        write_file_atomically(self.path(unit), lambda f: f.write(data))
        return receipt

    def read(self, unit: int) -> Optional[dict]:
        """The receipt of ``unit`` when it is valid (key and artifacts check out), else None."""
        try:
            with open(self.path(unit), "rb") as f:
                receipt = json.loads(f.read())
        except (OSError, ValueError):
            return None
        if not isinstance(receipt, dict) or receipt.get("key") != self.key or receipt.get("unit") != unit:
            return None
        for rel, size in (receipt.get("artifacts") or {}).items():
            try:
                if os.path.getsize(os.path.join(self.base, rel)) != size:
                    return None
            except OSError:
                return None
        return receipt

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
