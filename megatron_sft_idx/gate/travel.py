"""Manifests travel with the shards they list when ``check-idx --promote`` moves them.

A manifest (``BASE.json``, :mod:`megatron_sft_idx.manifest`) lists shards by prefix; moving
the shards without it would leave it pointing at nothing. So promotion:

1. finds the manifests that list a promoted shard: every ``*.json`` manifest in the
   directories the shards come from, and every manifest given as an input;
2. refuses, before anything moves, to promote part of what a manifest lists (the shards it
   lists that are not promoted -- not given, or failing -- are named), or to put a manifest
   where one of that name exists (without ``--replace``);
3. after the shards are committed at the destination, writes each manifest there, listing
   the promoted shards (relative to it, entries from their headers): a set's commit point
   comes after its shards, the rule of :mod:`megatron_sft_idx.publishing`;
4. for a move (not ``--link``), removes the source manifest, and only then the source
   shards;
5. a balanced pack order beside a travelling manifest (``BASE.order``, written by
   ``--balance-for``) travels with it: copied after the shards and before the manifest, which
   keeps its ``"order"`` record; an order beside a single promoted shard (``P.order``) follows
   the shard. For a move, the source order goes with the source manifest (or shard); a manifest whose shards did not all arrive stays where it was, and so do its
   shards (a complete copy is left at both places, as for a crash between commit and removal).

A manifest found beside the shards that does not parse refuses the promotion of the
shards in its directory: it might list them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .. import publishing
from ..errors import RemoteStorageError, ShardError
from ..format import IDX_SUFFIX, ORDER_SUFFIX
from ..jsondoc import parse_json
from ..manifest import MANIFEST_SUFFIX, MAX_MANIFEST_BYTES, MANIFEST_FORMAT, parse_manifest
from ..storage._url import ObjectURL, is_remote
from .report import Report, ShardReport

_MARK = MANIFEST_FORMAT.encode("utf-8")
_PEEK = 4096


@dataclass
class Travelling:
    """One manifest that lists promoted shards: its source path, the (absolute, normalised)
    prefixes it lists, in order, and its path at the destination."""

    source: str
    listed: List[str]
    dest: str
    record: Optional[dict] = None   # the manifest's "order" record, kept when its order travels
    order: Optional[str] = None     # the balanced order beside it (BASE.order), if any
    order_dest: Optional[str] = None


@dataclass
class Plan:
    manifests: List[Travelling] = field(default_factory=list)
    refused: Dict[str, str] = field(default_factory=dict)   # shard prefix -> why
    orders: Dict[str, str] = field(default_factory=dict)    # shard key -> its own order (P.order), single shards


def _key(prefix: str) -> str:
    return os.path.normpath(os.path.abspath(prefix))


def _dest_path(dest: str, name: str) -> str:
    return str(ObjectURL.parse(dest).join(name)) if is_remote(dest) else os.path.join(dest, name)


def _manifests_in(directory: str) -> List[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names
            if n.endswith(MANIFEST_SUFFIX) and os.path.isfile(os.path.join(directory, n))]


def _read(path: str):
    """``(prefixes, order record)``: the prefixes the manifest at ``path`` lists (normalised) and
    its ``"order"`` record (or None), or None when the file is not a manifest of this project.
    Raises ShardError when it is one but does not parse."""
    try:
        with open(path, "rb") as f:
            head = f.read(_PEEK)  # every writer puts "format" first (sorted keys): other JSON is skipped cheaply
            if _MARK not in head:
                return None
            raw = head + f.read(MAX_MANIFEST_BYTES + 1 - len(head))
    except OSError as exc:
        raise ShardError(f"cannot read the manifest beside the shard ({exc.strerror or exc})", path=path) from None
    m = parse_manifest(raw, os.path.abspath(path), named=path)
    record = parse_json(raw, path, max_length=MAX_MANIFEST_BYTES, what="manifest").get("order")   # parsed above
    return [p if is_remote(p) else _key(p) for p in m.prefixes], record if isinstance(record, dict) else None


def plan(shards: Sequence[ShardReport], dest: str, *, replace: bool, inputs: Sequence[str] = ()) -> Plan:
    """Which manifests travel with ``shards`` (the ones about to be promoted) and which shards
    must not be promoted because a manifest would be stranded (see the module docstring)."""
    out = Plan()
    keys = {_key(s.prefix): s.prefix for s in shards}
    given = [p for p in inputs if not is_remote(p) and p.endswith(MANIFEST_SUFFIX) and os.path.isfile(p)]
    beside = [m for d in sorted({os.path.dirname(k) for k in keys}) for m in _manifests_in(d)]
    paths = list({_key(p): p for p in reversed(given + beside)}.values())[::-1]  # each once, as given
    found = []
    for path in paths:
        try:
            read = _read(path)
        except ShardError as exc:
            for k, prefix in keys.items():
                if os.path.dirname(k) == os.path.dirname(_key(path)):
                    out.refused[prefix] = f"a manifest beside it does not parse, so it cannot travel: {exc}"
            continue
        if read is not None and any(p in keys for p in read[0]):
            m = Travelling(path, read[0], _dest_path(dest, os.path.basename(path)), read[1])
            order = path[: -len(MANIFEST_SUFFIX)] + ORDER_SUFFIX
            if os.path.isfile(order):
                m.order, m.order_dest = order, _dest_path(dest, os.path.basename(order))
            found.append(m)
    destinations: Dict[str, str] = {}
    for m in found:
        why = None
        if m.dest in destinations:
            why = f"manifests {destinations[m.dest]} and {m.source} would both be promoted as {m.dest}"
        elif not replace and publishing.destination_for(m.dest).exists(m.dest):
            why = f"a manifest exists at {m.dest} (pass --replace to replace it)"
        elif m.order and not replace and publishing.destination_for(m.order_dest).exists(m.order_dest):
            why = f"a balanced order exists at {m.order_dest} (pass --replace to replace it)"
        destinations.setdefault(m.dest, m.source)
        if why:
            _refuse(out, keys, m, why)
    changed = True
    while changed:  # refusing a shard can strand another manifest that lists it
        changed = False
        for m in found:
            left = [p for p in m.listed if p not in keys or keys[p] in out.refused]
            if left and any(p in keys and keys[p] not in out.refused for p in m.listed):
                _refuse(out, keys, m, f"manifest {m.source} also lists {_names(left)}, not promoted with it: "
                                      "promoting part of what a manifest lists would strand it; promote every "
                                      "shard it lists (give the manifest to check-idx)")
                changed = True
    out.manifests = [m for m in found if all(p in keys and keys[p] not in out.refused for p in m.listed)]
    listed = {p for m in found for p in m.listed}
    for k, prefix in keys.items():   # a single shard's own order (P.order) follows it
        order = prefix + ORDER_SUFFIX
        if k in listed or prefix in out.refused or not os.path.isfile(order):
            continue
        target = _dest_path(dest, os.path.basename(order))
        if not replace and publishing.destination_for(target).exists(target):
            out.refused[prefix] = f"a balanced order exists at {target} (pass --replace to replace it)"
        else:
            out.orders[k] = order
    return out


def _refuse(out: Plan, keys: Dict[str, str], m: Travelling, why: str) -> None:
    for p in m.listed:
        if p in keys and keys[p] not in out.refused:
            out.refused[keys[p]] = why


def _names(prefixes: Sequence[str], limit: int = 3) -> str:
    names = [os.path.basename(p) for p in prefixes]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def publish(the_plan: Plan, report: Report, *, link: bool) -> List[str]:
    """Write each travelling manifest at the destination once all its shards arrived there and,
    for a move, remove it at the source. Returns the prefixes of promoted shards whose source
    files must stay (a manifest listing them stayed)."""
    promoted = {_key(s.prefix): s for s in report.shards if s.promoted}
    keep: List[str] = []
    for m in the_plan.manifests:
        missing = [p for p in m.listed if p not in promoted]
        if missing:
            report.manifests.append({"source": m.source, "left": f"{_names(missing)} were not promoted; "
                                     "the shards it lists stay at the source too"})
            keep += [promoted[p].prefix for p in m.listed if p in promoted]
            continue
        shards = [promoted[p] for p in m.listed]
        finals = [s.promoted[IDX_SUFFIX][: -len(IDX_SUFFIX)] for s in shards]
        local = [s.prefix if is_remote(f) else f for s, f in zip(shards, finals)]
        try:
            if m.order:   # after the shards, before the manifest that records it
                publishing.write_bytes(m.order_dest, _bytes_of(m.order))
            publishing.write_bytes(m.dest, publishing.manifest_bytes(m.dest, list(zip(finals, local)),
                                                                     order=m.record if m.order else None))
        except (ShardError, RemoteStorageError, OSError) as exc:
            report.manifests.append({"source": m.source, "left": f"writing {m.dest} failed: {exc}; the shards "
                                     "it lists stay at the source too"})
            keep += [s.prefix for s in shards]
            continue
        if not link:
            publishing.LocalDestination().remove([m.source] + ([m.order] if m.order else []))
        report.manifests.append({"source": m.source, "promoted": m.dest})
        if m.order:
            report.manifests.append({"source": m.order, "promoted": m.order_dest})
    keep += _single_orders(the_plan, promoted, report, link)
    return keep


def _bytes_of(path: str) -> bytes:
    """The bytes of the balanced order at ``path``, read as the adapters read one (bounded)."""
    from ..batching.order import MAX_ORDER_BYTES, read_file

    data = read_file(path, MAX_ORDER_BYTES, "balanced order")
    if data is None:
        raise ShardError("the balanced order beside the data is gone", path=path)
    return data


def _single_orders(the_plan: Plan, promoted: Dict[str, ShardReport], report: Report, link: bool) -> List[str]:
    """Copy each promoted single shard's own order next to it; the shards whose copy failed keep
    their source files (returned)."""
    keep = []
    for k, order in the_plan.orders.items():
        shard = promoted.get(k)
        if shard is None:
            continue
        target = shard.promoted[IDX_SUFFIX][: -len(IDX_SUFFIX)] + ORDER_SUFFIX
        try:
            publishing.write_bytes(target, _bytes_of(order))
        except (ShardError, RemoteStorageError, OSError) as exc:
            report.manifests.append({"source": order, "left": f"writing {target} failed: {exc}; the shard "
                                     "stays at the source too"})
            keep.append(shard.prefix)
            continue
        if not link:
            publishing.LocalDestination().remove([order])
        report.manifests.append({"source": order, "promoted": target})
    return keep


__all__ = ["plan", "publish", "Plan", "Travelling"]
