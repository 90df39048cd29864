"""The sequence store: every conversation tokenized once, unpacked, in input order.

Layout of a store directory ``S`` (``docs/STORE.md`` is the specification)::

    S/store.json                        identity, inputs (name, sha256, bytes), partitions
    S/parts/part_NNNNNN.{bin,idx,loss.bin,seq.idx,seq.bin}
                                        partition NNNNNN as a shard of this project's format
                                        with pack_size null: one "pack" per conversation,
                                        seq_start_id [0], label-aligned loss mask
    S/parts/part_NNNNNN.rows            ROW_DTYPE per conversation, same order
    S/receipts/index/NNNNNN.json        per input file: sha256, size, mtime, partitions
    S/receipts/tokenize/NNNNNN.json     per partition: counts, skips; the commit point
    S/lock                              pid of the process writing the store

Sequence ``g`` of the store is conversation ``g - starts[k]`` of the partition ``k`` with
``starts[k] <= g < starts[k+1]`` (``starts``: cumulative sequence counts by partition).
A partition whose records were all skipped has no shard, an empty ``.rows`` and a receipt.
The store is complete when every partition has a valid receipt; only a complete store is
planned from. Nothing in it depends on the pack size, padding, split or algorithm.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np

from .._atomic import write_file_atomically
from ..errors import ShardError
from ..reader import MMapIndexedDataset
from .partitions import Partition
from .receipts import ReceiptBook, settings_key

STORE_FORMAT = "megatron_sft_idx.store"
STORE_VERSION = [1, 0]
STORE_FILE = "store.json"
ROWS_SUFFIX = ".rows"
#: One record per conversation in ``part_NNNNNN.rows`` (little-endian, 16 bytes).
ROW_DTYPE = np.dtype([("line", "<i8"), ("length", "<i4"), ("first_trained", "<i4")])


def part_prefix(directory: str, unit: int) -> str:
    return os.path.join(directory, "parts", f"part_{unit:06d}")


def write_store_file(directory: str, identity: dict, inputs: List[dict], partitions: List[Partition],
                     tokenizer_path: Optional[str], input_paths: List[str]) -> str:
    """Write ``store.json`` (atomically); returns the store id, a digest of everything that
    determines the store's content (not of where the tokenizer was found)."""
    body = {"format": STORE_FORMAT, "version": STORE_VERSION, "identity": identity, "inputs": inputs,
            "partitions": [p.to_list() for p in partitions]}
    body["store_id"] = settings_key(body)
    body["tokenizer_path"] = tokenizer_path  # where things were found, not what the store holds
    body["input_paths"] = input_paths
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    os.makedirs(directory, exist_ok=True)
    write_file_atomically(os.path.join(directory, STORE_FILE), lambda f: f.write(data))
    return body["store_id"]


def tokenize_book(directory: str, store_id: str) -> ReceiptBook:
    return ReceiptBook(os.path.join(directory, "receipts"), "tokenize", store_id, directory)


class SequenceStore:
    """A store opened for reading (planning, materializing, virtual packs).

    Raises:
        ShardError: no store here, an unknown format version, or (``require_complete``)
            partitions without a receipt.
    """

    def __init__(self, directory: str, *, require_complete: bool = True) -> None:
        self.directory = os.path.abspath(directory)
        path = os.path.join(self.directory, STORE_FILE)
        try:
            with open(path, "rb") as f:
                body = json.loads(f.read())
        except FileNotFoundError:
            raise ShardError("no sequence store here (store.json is missing)", path=path,
                             hint="give the --store directory of a preprocess_sft run") from None
        except (OSError, ValueError) as exc:
            raise ShardError(f"cannot read the store description ({exc})", path=path) from None
        if not isinstance(body, dict) or body.get("format") != STORE_FORMAT:
            raise ShardError("not a megatron_sft_idx sequence store", path=path, field="format",
                             expected=STORE_FORMAT)
        version = body.get("version")
        if not isinstance(version, list) or not version or version[0] != STORE_VERSION[0]:
            raise ShardError(f"unsupported store version {version}; supported major: {STORE_VERSION[0]}",
                             path=path, field="version", hint="rebuild the store with this version")
        self.body = body
        self.store_id: str = body["store_id"]
        self.identity: dict = body["identity"]
        self.inputs: List[dict] = body["inputs"]
        self.partitions = [Partition.from_list(p) for p in body["partitions"]]
        self.book = tokenize_book(self.directory, self.store_id)
        self._receipts: Dict[int, dict] = self.book.completed(range(len(self.partitions)))
        if require_complete:
            self.require_complete()
        self._parts: Dict[int, Optional[MMapIndexedDataset]] = {}

    # ------------------------------------------------------------------ completeness

    @property
    def missing(self) -> List[int]:
        return [k for k in range(len(self.partitions)) if k not in self._receipts]

    def require_complete(self) -> None:
        missing = self.missing
        if missing:
            raise ShardError(f"the sequence store is incomplete: {len(missing)} of {len(self.partitions)} "
                             f"partitions have no receipt (e.g. {missing[0]})", path=self.directory,
                             hint="finish it with the same preprocess_sft command plus --resume")

    @property
    def receipts(self) -> List[dict]:
        return [self._receipts[k] for k in range(len(self.partitions))]

    def counts(self) -> np.ndarray:
        """Conversations per partition (int64)."""
        return np.array([r["sequences"] for r in self.receipts], dtype=np.int64)

    def starts(self) -> np.ndarray:
        """First store sequence of each partition, plus the total (int64[K+1])."""
        return np.concatenate(([0], np.cumsum(self.counts()))).astype(np.int64)

    @property
    def sequence_count(self) -> int:
        return int(self.counts().sum())

    # ------------------------------------------------------------------ data

    def rows(self, unit: int) -> np.ndarray:
        """The ROW_DTYPE records of partition ``unit``.

        Raises:
            ShardError: the file is missing or its size disagrees with the receipt.
        """
        path = part_prefix(self.directory, unit) + ROWS_SUFFIX
        expected = self._receipts[unit]["sequences"]
        try:
            rows = np.fromfile(path, dtype=ROW_DTYPE)
        except OSError as exc:
            raise ShardError(f"cannot read store rows ({exc.strerror})", path=path) from None
        if rows.size != expected:
            raise ShardError("store rows disagree with the partition's receipt", path=path, field="rows",
                             expected=expected, actual=rows.size, hint="rebuild the store")
        return rows

    def part(self, unit: int) -> Optional[MMapIndexedDataset]:
        """Partition ``unit`` as a mapped shard (opened once per process), None when empty."""
        if unit not in self._parts:
            self._parts[unit] = (MMapIndexedDataset(part_prefix(self.directory, unit))
                                 if self._receipts[unit]["sequences"] else None)
        return self._parts[unit]

    @property
    def vocab_size(self) -> Optional[int]:
        return self.identity["encode"]["vocab_size"]

    @property
    def tokenizer(self) -> Optional[dict]:
        """The tokenizer identity as shards record it (no local path), or None."""
        return self.identity.get("tokenizer")

    def input_path(self, file: int) -> str:
        """Where input ``file`` was read from (absolute), for re-reading a record."""
        paths = self.body.get("input_paths") or []
        return paths[file] if file < len(paths) else self.inputs[file]["name"]

    @property
    def tokenizer_path(self) -> Optional[str]:
        """Where the tokenizer was when the store was written (for --verify-masks)."""
        return self.body.get("tokenizer_path")

    def __getstate__(self):
        return {"directory": self.directory}

    def __setstate__(self, state) -> None:
        self.__init__(state["directory"])
