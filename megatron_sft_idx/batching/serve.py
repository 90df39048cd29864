"""Finding and checking a balanced order for the data a training adapter serves.

An order file sits beside the data it was planned for (``preprocess-sft`` / ``repack-sft
--balance-for`` write it there): ``P.order`` beside a shard ``P``, ``B.order`` beside a set's
manifest ``B.json``. The adapters take an order as an :class:`~.order.Order`, a path, or
``"auto"`` (that file, found by name beside the data path), local or in object storage
(``s3://`` / ``msc://``: read whole through the storage layer, with its deadlines). A manifest written with an order
records it (:data:`MANIFEST_KEY`: the file's name, size and CRC-32, its topology, cost model,
seed and epochs); an order found beside such a manifest that is not that file (re-planned for
another topology with ``plan-batches --out``) is served after the checks below, with an
:class:`OrderRecordWarning` saying so.

Before an order is served, :func:`checked_order` proves it belongs to the data and the run:

* its seed is the run's data seed (the order starts from the shuffle that seed draws: another
  seed would be another run's optimisation);
* every pack's cost, recomputed from the data's index with the order's cost model, is the
  recorded one (:meth:`~.order.Order.check_costs`): an order of other packs is refused;
* a topology other than the planned one warns (:class:`~.order.TopologyMismatchWarning`).
"""

from __future__ import annotations

import os
import warnings
import zlib
from typing import Optional, Union

from ..errors import ShardError
from ..format import ORDER_SUFFIX
from ..manifest import MAX_MANIFEST_BYTES, ORDER_KEY, OrderRecord, parse_manifest
from .cost import shard_pack_costs
from .layout import Topology
from .order import MAX_ORDER_BYTES, Order, read_file

__all__ = ["ORDER_SUFFIX", "MANIFEST_KEY", "AUTO", "order_path_for", "resolve_order", "checked_order",
           "served_order", "order_record", "OrderRecordWarning"]


class OrderRecordWarning(UserWarning):
    """The order beside a manifest is not the one the manifest records (it was re-planned)."""

#: The key under which a manifest records the set's order (:class:`~megatron_sft_idx.manifest.OrderRecord`).
MANIFEST_KEY = ORDER_KEY
#: The order spec that means "the order file beside the data path".
AUTO = "auto"

OrderSpec = Union[Order, str, os.PathLike, None]


def order_path_for(data_path: str) -> str:
    """Where the order of ``data_path`` (a shard prefix or a manifest ``.json``) lives."""
    data_path = os.fspath(data_path)
    if data_path.endswith(".json"):
        return data_path[:-len(".json")] + ORDER_SUFFIX
    return data_path + ORDER_SUFFIX


def order_record(order: Order, name: str, size: int) -> OrderRecord:
    """What a manifest records of its set's order (``name`` relative to the manifest)."""
    return OrderRecord(file=name, size=int(size), crc32=int(order.file_crc32), seed=int(order.seed),
                       epochs=int(order.epochs), first_epoch=int(order.first_epoch),
                       topology=order.topology.to_dict(), cost_model=order.cost_model.to_dict(),
                       exchange_window=int(order.exchange_window))


def _manifest_record(manifest: str) -> Optional[OrderRecord]:
    try:
        data = read_file(manifest, MAX_MANIFEST_BYTES, "manifest")
        if data is None:
            return None
        return parse_manifest(data, manifest).order
    except ShardError:
        return None   # the reader of the data refuses a bad manifest, naming it


def resolve_order(spec: OrderSpec, data_path: Optional[str] = None) -> Optional[Order]:
    """The :class:`Order` ``spec`` names: an Order as is, a path loaded, ``"auto"`` the order file
    beside ``data_path`` (checked against the manifest's record when the manifest has one); None
    for None.

    Raises:
        ShardError: ``"auto"`` without one shard prefix or manifest path (local or a URL), no
            order file there, or an order file that does not parse. OrderRecordWarning (a warning): the file is
            not the order the manifest records.
    """
    if spec is None or isinstance(spec, Order):
        return spec
    spec = os.fspath(spec)
    if spec != AUTO:
        return Order.load(spec)
    if not isinstance(data_path, str):
        raise ShardError("pack order \"auto\" needs one data path (a shard prefix or a manifest)",
                         path=str(data_path), field="pack_order_file",
                         hint="name the order file instead of \"auto\"")
    path = order_path_for(data_path)
    data = read_file(path, MAX_ORDER_BYTES, "order file")
    if data is None:
        raise ShardError("no balanced order beside the data (looked for this file)", path=path,
                         field="pack_order_file",
                         hint="write one with preprocess-sft/repack-sft --balance-for or plan-batches --out, "
                              "or name the order file; a split smaller than one global batch gets none (it "
                              "has no step to balance: the run's summary names it): train it without one")
    record = _manifest_record(data_path) if data_path.endswith(".json") else None
    order = Order.from_bytes(data, path)   # (its own CRCs: a corrupt or truncated file is refused here)
    if record is not None and (record.size != len(data) or record.crc32 != zlib.crc32(data)):
        warnings.warn(f"{path}: not the order {data_path} records (CRC-32 {zlib.crc32(data)}, recorded "
                      f"{record.crc32}): it was re-planned since; it is served once its seed and pack "
                      "costs check against the data", OrderRecordWarning, stacklevel=2)
    return order


def checked_order(order: Order, source, *, seed: int, topology: Optional[Topology] = None,
                  path: Optional[str] = None) -> Order:
    """``order``, once proven to belong to ``source`` and the run (module doc).

    Raises:
        ShardError: another seed; a pack count or any pack's cost that differs.
    """
    where = path or (order.source or {}).get("path")
    if int(seed) != order.seed:
        raise ShardError("the balanced order was planned from another data seed than this run's", path=where,
                         field="seed", expected=order.seed, actual=int(seed),
                         hint="train with the order's seed (Megatron-LM --seed, Bridge's dataset seed), or "
                              "re-plan the order with --balance-seed set to the run's seed")
    order.check_costs(shard_pack_costs(source, order.cost_model), path=where)
    if topology is not None:
        order.warn_if_mismatch(topology)
    return order


def served_order(spec: OrderSpec, source, *, seed: int, data_path: Optional[str] = None,
                 topology: Optional[Topology] = None, path: Optional[str] = None) -> Optional[Order]:
    """The order ``spec`` names for the data ``source`` holds (:func:`resolve_order`), proven to
    belong to it and the run (:func:`checked_order`): what an adapter serves through
    :func:`~.samples.sample_index`. None for None.

    ``path`` is the file a refusal names; by default ``data_path`` for ``"auto"``, else the
    data the order records it was planned for.

    Raises:
        ShardError: see :func:`resolve_order` and :func:`checked_order`.
    """
    order = resolve_order(spec, data_path)
    if order is None:
        return None
    if path is None and isinstance(spec, str) and spec == AUTO:
        path = data_path
    return checked_order(order, source, seed=seed, topology=topology, path=path)
