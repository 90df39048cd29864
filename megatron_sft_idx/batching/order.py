"""A balanced pack order, and its file (``*.order``): the per-epoch permutations of pack ids, with
the topology, cost model and seed they were planned for.

Layout, version 1.1 (1.0 without trained-token counts): the container of
:mod:`megatron_sft_idx._container` (a 64-byte header with both CRC-32s, then the arrays, then the
metadata; integers little-endian) with magic ``MSFTORD\\x00``.

Metadata (JSON object; unknown keys are ignored): ``format`` (``"megatron_sft_idx.order"``),
``num_packs``, ``first_epoch``, ``epochs``, ``seed``, ``topology`` (:class:`~.layout.Topology`),
``cost_model`` (:class:`~.cost.CostModel`), ``algorithm``, ``exchange_window``, ``source``
(an object naming the data, or null), ``stats``, and ``arrays``: ``permutations``
(``[offset, count, dtype]``, int32 or int64, ``epochs * num_packs`` values, row ``e`` the
order of epoch ``first_epoch + e``) and ``costs`` (float64, ``num_packs`` values). Reading
verifies both CRCs, every field's type, that each row is a permutation and that every cost is
finite and non-negative.

Version 1.1 adds, when the order was planned with the data's trained-token counts
(:class:`~.trained.TrainedCounts`), the denominators of every planned step: metadata
``trained`` (``rules``, the rules counted; ``eos_id``, Bridge 0.6's EOS; ``first_step`` and
``steps``, the complete steps of the planned epochs; ``label_balance``, ``{"rule", "slack"}``
when the steps were balanced in trained tokens, else null) and arrays ``sequences_per_pack``
(int32, ``num_packs``), and per rule ``R``: ``trained.R.sequences`` (int32, every sequence's
trained positions, packs in order), ``trained.R.steps`` and ``trained.R.step_sequences``
(int64, ``steps * micro-batches * dp``: per step, micro-batch and rank, the trained positions
and the sequences with at least one). Reading verifies that the step arrays are what the
permutations and the per-sequence counts give (:func:`~.trained.step_table`). A 1.0 reader
ignores all of it; this reader reads 1.0 files (``trained`` is None).
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .._atomic import write_file_atomically
from .._container import ALIGN as _ALIGN
from .._container import HEADER, HEADER_SIZE, Kind  # (HEADER: the container's layout, named here too)
from ..errors import HeaderError, ShardError
from ..jsondoc import parse_json
from ..storage.paths import read_whole
from . import _kernels
from .cost import CostModel
from .layout import Topology
from .trained import RULES, TrainedCounts, step_table

__all__ = ["Order", "ORDER_FORMAT", "ALGORITHMS", "TopologyMismatchWarning", "HEADER", "HEADER_SIZE"]

ORDER_MAGIC = b"MSFTORD\x00"
ORDER_VERSION = (1, 1)
ORDER_FORMAT = "megatron_sft_idx.order"
_KIND = Kind(ORDER_MAGIC, ORDER_VERSION, "order", "an order", "a pack order file",
             "re-plan the order with this version")
_KIND_1_0 = Kind(ORDER_MAGIC, (1, 0), "order", "an order", "a pack order file", "re-plan the order with this version")
_INDEX_DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
#: Balancing algorithms: ``shuffle`` (none: the adapters' order), ``lpt``, ``kk`` (Karmarkar-Karp).
ALGORITHMS = ("shuffle", "lpt", "kk")


class TopologyMismatchWarning(UserWarning):
    """An order is used with a topology other than the one it was balanced for."""


#: The largest order file read (8 bytes per pack and epoch: 1 GiB is 134M pack-epochs).
MAX_ORDER_BYTES = 1 << 30


def read_file(path: str, limit: int, what: str) -> Optional[bytes]:
    """The bytes of a local file or an object (read whole, at most ``limit`` bytes); None when
    there is none.

    Raises:
        ShardError: larger than ``limit``, or unreadable (RemoteStorageError for objects).
    """
    try:
        size, data = read_whole(path, limit)
    except ShardError:   # (the store's errors: ShardNotFoundError is an OSError too)
        raise
    except OSError as exc:
        raise ShardError(f"cannot read the {what} ({exc.strerror or exc})", path=path) from None
    if size is None:
        return None
    if data is None or len(data) > limit:
        raise ShardError(f"the {what} is larger than this reader takes", path=path, expected=f"<= {limit} bytes",
                         actual=size, hint=f"is this the {what}?")
    return data


@dataclass
class Order:
    """Per-epoch pack orders balanced for one topology and cost model (see :mod:`.balance`).

    ``permutations[e]`` is the order of epoch ``first_epoch + e``: position ``i`` of that epoch
    (global position ``epoch * num_packs + i``) serves pack ``permutations[e][i]``.
    """

    permutations: np.ndarray
    costs: np.ndarray
    topology: Topology
    cost_model: CostModel
    seed: int
    first_epoch: int = 0
    algorithm: str = "kk"
    exchange_window: int = 1
    source: Optional[dict] = None
    stats: dict = field(default_factory=dict)
    file_crc32: Optional[int] = field(default=None, compare=False)
    """CRC-32 of the whole file this order was read from or last encoded to (None: neither yet)."""
    trained: Optional[TrainedCounts] = field(default=None, compare=False)
    """The data's trained positions per sequence (None: planned without them, a 1.0 file)."""
    label_balance: Optional[dict] = None
    """``{"rule", "slack"}`` when the steps were also balanced in trained tokens (:mod:`.balance`)."""

    @property
    def num_packs(self) -> int:
        return int(self.permutations.shape[1])

    @property
    def epochs(self) -> int:
        return int(self.permutations.shape[0])

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of absolute epoch ``epoch`` (read-only view).

        Raises:
            ShardError: the epoch is outside the planned ones.
        """
        e = int(epoch) - self.first_epoch
        if not 0 <= e < self.epochs:
            raise ShardError(f"the order holds epochs {self.first_epoch}..{self.first_epoch + self.epochs - 1}, "
                             f"not {epoch}", field="epoch", actual=epoch,
                             hint="plan more epochs (epochs=...) for a longer run")
        return self.permutations[e]

    def sample_index(self, num_samples: int) -> np.ndarray:
        """The first ``num_samples`` global positions' packs (epochs from 0, concatenated), int64.

        Raises:
            ShardError: the order does not start at epoch 0 or holds too few epochs.
        """
        n = self.num_packs
        need = -(-int(num_samples) // n) if n else 0
        if self.first_epoch != 0 or need > self.epochs:
            raise ShardError(f"{num_samples} samples need epochs 0..{need - 1}; the order holds "
                             f"{self.first_epoch}..{self.first_epoch + self.epochs - 1}", field="epochs",
                             hint="plan the order from epoch 0 with enough epochs")
        return self.permutations[:need].reshape(-1)[:num_samples].astype(np.int64)

    # ------------------------------------------------------------------ denominators

    @property
    def first_step(self) -> int:
        """The first complete step of the planned epochs (global step number)."""
        return -(-self.first_epoch * self.num_packs // self.topology.global_batch_size)

    def step_trained(self, rule: str, *, sequences: bool = False) -> np.ndarray:
        """int64 ``[steps, micro-batches, dp]``: per complete planned step (from :attr:`first_step`),
        micro-batch and rank, the trained positions under ``rule`` (``sequences``: the sequences
        training at least one). ``.sum(axis=(1, 2))`` is each step's global denominator.

        Raises:
            ShardError: the order holds no counts, or none under ``rule``.
        """
        counts = self._counts(rule)
        values = counts.pack_sequences(rule) if sequences else counts.pack(rule)
        return step_table(self.permutations.reshape(-1), values, self.topology, self.first_epoch * self.num_packs)

    def _counts(self, rule: Optional[str] = None) -> TrainedCounts:
        if self.trained is None:
            raise ShardError("the order records no trained-token counts (planned without them, or a 1.0 file)",
                             field="trained",
                             hint="re-plan it (plan-batches --out, or --balance-for) with this version")
        if rule is not None:
            self.trained.require(rule)
        return self.trained

    def check_trained(self, counts: TrainedCounts, path: Optional[str] = None) -> None:
        """Refuse trained-token counts (recomputed from the data) that differ from the recorded ones.

        Raises:
            ShardError: the order holds no counts; another number of packs or sequences; any
                pack whose sequences' counts differ (named, with the rule).
        """
        mine = self._counts()
        if counts.num_packs != mine.num_packs:
            raise ShardError("the data has a different number of packs than the order's counts record", path=path,
                             field="num_packs", expected=mine.num_packs, actual=counts.num_packs,
                             hint="re-plan the order for this data")
        other = np.flatnonzero(np.diff(counts.sequence_offsets) != np.diff(mine.sequence_offsets))
        if other.size:
            pack = int(other[0])
            raise ShardError(f"pack {pack} holds another number of sequences than the order's counts record: the "
                             "order was planned for other data", path=path, pack=pack, field="sequences_per_pack",
                             expected=int(np.diff(mine.sequence_offsets)[pack]),
                             actual=int(np.diff(counts.sequence_offsets)[pack]), hint="re-plan the order for this data")
        for rule in mine.rules:
            if rule not in counts.sequence:
                continue
            if rule == "bridge-0.6" and counts.eos_id != mine.eos_id:
                continue
            differs = np.flatnonzero(counts.sequence[rule] != mine.sequence[rule])
            if differs.size:
                s = int(differs[0])
                pack = int(np.searchsorted(mine.sequence_offsets, s, side="right")) - 1
                raise ShardError(f"pack {pack}'s trained tokens ({rule!r} rule) differ from the order's record "
                                 f"({differs.size} sequences differ): the order was planned for other data",
                                 path=path, pack=pack, field=f"trained.{rule}", expected=int(mine.pack(rule)[pack]),
                                 actual=int(counts.pack(rule)[pack]), hint="re-plan the order for this data")

    def topology_mismatch(self, topology: Topology) -> Optional[str]:
        """A sentence saying how ``topology`` differs from the planned one, or None."""
        if topology == self.topology:
            return None
        if self.algorithm == "shuffle" and topology.global_batch_size == self.topology.global_batch_size:
            return None   # (an order that deals no step to ranks fixes steps only: any DP and micro-batch)
        return (f"the pack order was balanced for {self.topology.describe()}, but training runs with "
                f"{topology.describe()}: steps keep their packs but ranks get unbalanced slices; re-plan "
                "the order for this topology")

    def warn_if_mismatch(self, topology: Topology) -> bool:
        """Warn (:class:`TopologyMismatchWarning`) when ``topology`` is not the planned one; True if so."""
        message = self.topology_mismatch(topology)
        if message:
            warnings.warn(message, TopologyMismatchWarning, stacklevel=2)
        return message is not None

    def check_costs(self, costs, path: Optional[str] = None) -> None:
        """Refuse pack costs (recomputed from the data with this order's cost model) that differ
        from the recorded ones: the order was planned for other packs.

        Raises:
            ShardError: a different pack count, or any pack's cost differs.
        """
        costs = np.asarray(costs, dtype=np.float64)
        if costs.shape != self.costs.shape:
            raise ShardError("the data has a different number of packs than the order was planned for",
                             path=path, field="num_packs", expected=self.num_packs, actual=costs.shape[0],
                             hint="re-plan the order for this data")
        bad = np.flatnonzero(~np.isclose(costs, self.costs, rtol=1e-9, atol=0.0))
        if bad.size:
            raise ShardError(f"pack {int(bad[0])}'s cost differs from the order's record ({bad.size} packs differ): "
                             "the order was planned for other data", path=path, pack=int(bad[0]),
                             field="costs", expected=float(self.costs[bad[0]]), actual=float(costs[bad[0]]),
                             hint="re-plan the order for this data")

    # ------------------------------------------------------------------ file

    def to_bytes(self) -> bytes:
        """The order file's bytes (module doc); :meth:`save` writes them, :meth:`from_bytes` reads them.
        Version 1.0 (the same bytes as before counts existed) without :attr:`trained`, else 1.1."""
        n = self.num_packs
        dtype = "int32" if n < 2**31 - 1 else "int64"
        named = [("permutations", np.ascontiguousarray(self.permutations, dtype=_INDEX_DTYPES[dtype]), dtype),
                 ("costs", np.ascontiguousarray(self.costs, dtype="<f8"), "float64")] + self._trained_arrays()
        parts, locators, offset = [], {}, HEADER_SIZE
        for name, array, dt in named:   # each array 64-byte aligned, the metadata right after the last
            pad = -offset % _ALIGN
            parts.append(b"\0" * pad)
            locators[name] = [offset + pad, int(array.size), dt]
            parts.append(array.tobytes())
            offset += pad + array.nbytes
        meta = json.dumps(self._metadata(locators), sort_keys=True, separators=(",", ":")).encode()
        body = b"".join(parts + [meta])
        kind = _KIND if self.trained is not None else _KIND_1_0
        data = kind.pack_header(offset, len(meta), zlib.crc32(body)) + body
        self.file_crc32 = zlib.crc32(data)
        return data

    def save(self, path) -> None:
        """Write the order file atomically (temporary name, fsync, rename)."""
        data = self.to_bytes()
        write_file_atomically(os.fspath(path), lambda f: f.write(data))

    def _trained_arrays(self) -> list:
        if self.trained is None:
            return []
        t = self.trained
        out = [("sequences_per_pack", np.diff(t.sequence_offsets).astype("<i4"), "int32")]
        for rule in t.rules:
            out += [(f"trained.{rule}.sequences", np.ascontiguousarray(t.sequence[rule], dtype="<i4"), "int32"),
                    (f"trained.{rule}.steps", self.step_trained(rule).astype("<i8").ravel(), "int64"),
                    (f"trained.{rule}.step_sequences",
                     self.step_trained(rule, sequences=True).astype("<i8").ravel(), "int64")]
        return out

    def _metadata(self, locators: dict) -> dict:
        meta = {"format": ORDER_FORMAT, "num_packs": self.num_packs, "first_epoch": int(self.first_epoch),
                "epochs": self.epochs, "seed": int(self.seed), "topology": self.topology.to_dict(),
                "cost_model": self.cost_model.to_dict(), "algorithm": self.algorithm,
                "exchange_window": int(self.exchange_window), "source": self.source, "stats": self.stats,
                "arrays": locators}
        if self.trained is not None:
            steps = self.step_trained(self.trained.rules[0]).shape[0]
            meta["trained"] = {"rules": list(self.trained.rules), "eos_id": self.trained.eos_id,
                               "first_step": self.first_step, "steps": int(steps),
                               "label_balance": self.label_balance}
        return meta

    @classmethod
    def load(cls, path) -> "Order":
        """Read and verify an order file, local or an ``s3://`` / ``msc://`` object (module doc). The
        arrays are read whole (no mapping).

        Raises:
            ShardError (HeaderError, VersionError): not an order file, a corrupt or truncated one,
                an unknown major version, a field of the wrong type, a row that is not a permutation.
        """
        path = os.fspath(path)
        data = read_file(path, MAX_ORDER_BYTES, "order file")
        if data is None:
            raise ShardError("cannot read the order file (no such file or object)", path=path)
        return cls.from_bytes(data, path)

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None) -> "Order":
        """Parse and verify an order file's bytes (``path`` names it in errors); see :meth:`load`."""
        meta_off, meta_len = _parse_header(data, path)
        meta = parse_json(data[meta_off:meta_off + meta_len], path, what="order metadata", error=HeaderError,
                          limit_error=None, hint="the order file is corrupt or cut short; plan it again (plan-batches)")
        if not isinstance(meta, dict) or meta.get("format") != ORDER_FORMAT:
            raise HeaderError("order metadata names another format", path=path, field="format", expected=ORDER_FORMAT)
        fields = _fields(meta, path)
        n, epochs = fields["num_packs"], fields["epochs"]
        perms = _array(data, meta, "permutations", epochs * n, _INDEX_DTYPES, meta_off, path).reshape(epochs, n)
        costs = _array(data, meta, "costs", n, {"float64": np.dtype("<f8")}, meta_off, path)
        for e in range(epochs):
            if not _kernels.is_permutation(perms[e]):
                raise HeaderError(f"row {e} of the order is not a permutation of the {n} packs", path=path,
                                  field="permutations", rule="permutation")
        if n and not (np.all(np.isfinite(costs)) and costs.min() >= 0):
            raise HeaderError("the order's pack costs must be finite and >= 0", path=path, field="costs")
        order = cls(permutations=perms.astype(np.int64), costs=costs.astype(np.float64), seed=fields["seed"],
                    topology=Topology.from_dict(meta.get("topology"), path=path),
                    cost_model=CostModel.from_dict(meta.get("cost_model"), path=path),
                    first_epoch=fields["first_epoch"], algorithm=fields["algorithm"],
                    exchange_window=fields["exchange_window"], source=fields["source"], stats=fields["stats"],
                    file_crc32=zlib.crc32(data))
        if meta.get("trained") is not None:
            _read_trained(order, data, meta, meta_off, path)
        return order


def _parse_header(data: bytes, path: str):
    meta_off, meta_len, body_crc = _KIND.parse_header(data, len(data), path)
    if zlib.crc32(memoryview(data)[HEADER_SIZE:]) != body_crc:
        raise HeaderError("order body CRC-32 mismatch: the file was modified or is corrupt", path=path,
                          field="body_crc32")
    return meta_off, meta_len


def _int(meta: dict, key: str, path: str, minimum: Optional[int]) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise HeaderError(f"order field {key!r} is missing or not an integer"
                          + (f" >= {minimum}" if minimum is not None else ""), path=path, field=key, actual=value)
    return value


def _fields(meta: dict, path: str) -> dict:
    out = {"num_packs": _int(meta, "num_packs", path, 0), "epochs": _int(meta, "epochs", path, 1),
           "first_epoch": _int(meta, "first_epoch", path, 0), "seed": _int(meta, "seed", path, None),
           "exchange_window": _int(meta, "exchange_window", path, 1)}
    algorithm = meta.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise HeaderError("order field 'algorithm' is not a known algorithm", path=path, field="algorithm",
                          expected=list(ALGORITHMS), actual=algorithm)
    out["algorithm"] = algorithm
    for key in ("source", "stats"):
        value = meta.get(key)
        if value is not None and not isinstance(value, dict):
            raise HeaderError(f"order field {key!r} must be an object or null", path=path, field=key)
        out[key] = value if key == "source" else (value or {})
    return out


def _array(data: bytes, meta: dict, name: str, count: int, dtypes: dict, bound: int, path: str) -> np.ndarray:
    arrays = meta.get("arrays")
    spec = arrays.get(name) if isinstance(arrays, dict) else None
    if (not isinstance(spec, list) or len(spec) != 3 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                for v in spec[:2]) or spec[2] not in dtypes):
        raise HeaderError(f"order array {name!r} has no valid [offset, count, dtype] locator", path=path,
                          field=f"arrays.{name}", actual=spec)
    offset, found, dtype = spec
    dt = dtypes[dtype]
    if found != count:
        raise HeaderError(f"order array {name!r} holds {found} values, expected {count}", path=path,
                          field=f"arrays.{name}", expected=count, actual=found)
    if offset < HEADER_SIZE or offset % _ALIGN or offset + count * dt.itemsize > bound:
        raise HeaderError(f"order array {name!r} lies outside the arrays section", path=path, field=f"arrays.{name}")
    return np.frombuffer(data, dtype=dt, count=count, offset=offset)


_INT32 = {"int32": np.dtype("<i4")}
_INT64 = {"int64": np.dtype("<i8")}


def _read_trained(order: Order, data: bytes, meta: dict, bound: int, path: Optional[str]) -> None:
    """Attach version 1.1's counts to ``order`` once they check (module doc).

    Raises:
        HeaderError: a field or array missing or of the wrong type, a negative count, or step
            denominators that are not what the permutations and per-sequence counts give.
    """
    spec = meta["trained"]
    rules = spec.get("rules") if isinstance(spec, dict) else None
    eos = spec.get("eos_id") if isinstance(spec, dict) else None
    if (not isinstance(rules, list) or not rules or any(r not in RULES for r in rules) or len(set(rules)) != len(rules)
            or (eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)))
            or (("bridge-0.6" in rules) != (eos is not None))):
        raise HeaderError("order field 'trained' must name known rules (Bridge 0.6's with its eos_id)", path=path,
                          field="trained", expected=list(RULES), actual=spec)
    n = order.num_packs
    per_pack = _array(data, meta, "sequences_per_pack", n, _INT32, bound, path).astype(np.int64)
    if n and per_pack.min() < 0:
        raise HeaderError("order array 'sequences_per_pack' holds a negative count", path=path,
                          field="arrays.sequences_per_pack")
    offsets = np.concatenate(([0], np.cumsum(per_pack))).astype(np.int64)
    sequence = {}
    for rule in rules:
        values = _array(data, meta, f"trained.{rule}.sequences", int(offsets[-1]), _INT32, bound, path)
        if values.size and values.min() < 0:
            raise HeaderError(f"order array 'trained.{rule}.sequences' holds a negative count", path=path,
                              field=f"arrays.trained.{rule}.sequences")
        sequence[rule] = values.astype(np.int32)
    order.trained = TrainedCounts(sequence_offsets=offsets, sequence=sequence, eos_id=eos)
    balance = spec.get("label_balance")
    if balance is not None and not (isinstance(balance, dict) and balance.get("rule") in rules
                                    and isinstance(balance.get("slack"), (int, float))
                                    and not isinstance(balance.get("slack"), bool) and balance["slack"] >= 0):
        raise HeaderError("order field 'trained.label_balance' must be null or {rule, slack}", path=path,
                          field="trained.label_balance", actual=balance)
    order.label_balance = balance
    for rule in rules:
        for kind, sequences in (("steps", False), ("step_sequences", True)):
            want = order.step_trained(rule, sequences=sequences)
            got = _array(data, meta, f"trained.{rule}.{kind}", want.size, _INT64, bound, path)
            if not np.array_equal(got, want.ravel()):
                step = int(np.flatnonzero(got != want.ravel())[0] // max(1, want[0].size)) if got.size else 0
                raise HeaderError(f"the order's recorded {kind.replace('_', ' ')} of step {order.first_step + step} "
                                  f"({rule!r} rule) are not what its packs' counts give: the file is inconsistent",
                                  path=path, field=f"arrays.trained.{rule}.{kind}",
                                  hint="re-plan the order (plan-batches --out, or --balance-for)")
    if spec.get("first_step") != order.first_step or spec.get("steps") != order.step_trained(rules[0]).shape[0]:
        raise HeaderError("order field 'trained' names other steps than its epochs hold", path=path,
                          field="trained.steps", expected=[order.first_step, order.step_trained(rules[0]).shape[0]],
                          actual=[spec.get("first_step"), spec.get("steps")])
