"""A balanced pack order, and its file (``*.order``): the per-epoch permutations of pack ids, with
the topology, cost model and seed they were planned for.

Layout, version 1.0: the container of :mod:`megatron_sft_idx._container` (a 64-byte header with
both CRC-32s, then the arrays, then the metadata; integers little-endian) with magic
``MSFTORD\\x00``.

Metadata (JSON object; unknown keys are ignored): ``format`` (``"megatron_sft_idx.order"``),
``num_packs``, ``first_epoch``, ``epochs``, ``seed``, ``topology`` (:class:`~.layout.Topology`),
``cost_model`` (:class:`~.cost.CostModel`), ``algorithm``, ``exchange_window``, ``source``
(an object naming the data, or null), ``stats``, and ``arrays``: ``permutations``
(``[offset, count, dtype]``, int32 or int64, ``epochs * num_packs`` values, row ``e`` the
order of epoch ``first_epoch + e``) and ``costs`` (float64, ``num_packs`` values). Reading
verifies both CRCs, every field's type, that each row is a permutation and that every cost is
finite and non-negative.
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

__all__ = ["Order", "ORDER_FORMAT", "ALGORITHMS", "TopologyMismatchWarning", "HEADER", "HEADER_SIZE"]

ORDER_MAGIC = b"MSFTORD\x00"
ORDER_VERSION = (1, 0)
ORDER_FORMAT = "megatron_sft_idx.order"
_KIND = Kind(ORDER_MAGIC, ORDER_VERSION, "order", "an order", "a pack order file",
             "re-plan the order with this version")
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
        """The order file's bytes (module doc); :meth:`save` writes them, :meth:`from_bytes` reads them."""
        n = self.num_packs
        dtype = "int32" if n < 2**31 - 1 else "int64"
        perms = np.ascontiguousarray(self.permutations, dtype=_INDEX_DTYPES[dtype])
        costs = np.ascontiguousarray(self.costs, dtype="<f8")
        perm_off = HEADER_SIZE
        cost_off = perm_off + perms.nbytes + (-(perm_off + perms.nbytes) % _ALIGN)
        meta_off = cost_off + costs.nbytes
        meta = json.dumps(self._metadata(dtype, perm_off, cost_off), sort_keys=True,
                          separators=(",", ":")).encode()
        body = b"".join([perms.tobytes(), b"\0" * (cost_off - perm_off - perms.nbytes), costs.tobytes(), meta])
        data = _KIND.pack_header(meta_off, len(meta), zlib.crc32(body)) + body
        self.file_crc32 = zlib.crc32(data)
        return data

    def save(self, path) -> None:
        """Write the order file atomically (temporary name, fsync, rename)."""
        data = self.to_bytes()
        write_file_atomically(os.fspath(path), lambda f: f.write(data))

    def _metadata(self, dtype: str, perm_off: int, cost_off: int) -> dict:
        return {"format": ORDER_FORMAT, "num_packs": self.num_packs, "first_epoch": int(self.first_epoch),
                "epochs": self.epochs, "seed": int(self.seed), "topology": self.topology.to_dict(),
                "cost_model": self.cost_model.to_dict(), "algorithm": self.algorithm,
                "exchange_window": int(self.exchange_window), "source": self.source, "stats": self.stats,
                "arrays": {"permutations": [perm_off, self.epochs * self.num_packs, dtype],
                           "costs": [cost_off, self.num_packs, "float64"]}}

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
        return cls(permutations=perms.astype(np.int64), costs=costs.astype(np.float64), seed=fields["seed"],
                   topology=Topology.from_dict(meta.get("topology"), path=path),
                   cost_model=CostModel.from_dict(meta.get("cost_model"), path=path),
                   first_epoch=fields["first_epoch"], algorithm=fields["algorithm"],
                   exchange_window=fields["exchange_window"], source=fields["source"], stats=fields["stats"],
                   file_crc32=zlib.crc32(data))


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
