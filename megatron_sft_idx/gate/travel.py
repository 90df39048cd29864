"""Manifests and balanced orders travel with the shards they belong to when ``check-idx
--promote`` moves them, and the destination is read back before the run passes.

A manifest (``BASE.json``, :mod:`megatron_sft_idx.manifest`) lists shards by prefix; moving
the shards without it would leave it pointing at nothing. So promotion:

1. finds the manifests that list a promoted shard: every ``*.json`` manifest in the
   directories the shards come from, and every manifest given as an input;
2. refuses, before anything moves, to promote part of what a manifest lists (the shards it
   lists that are not promoted -- not given, or failing -- are named), to put a manifest or an
   order where one of that name exists (without ``--replace``), or to carry an order that is
   not whole (its own CRC-32s and step denominators, :meth:`megatron_sft_idx.batching.Order.from_bytes`),
   is not the order its manifest records (size and CRC-32), or is not these shards' (every
   pack's cost, and every sequence's trained tokens when it records them, recomputed from the
   shards): ``TRAVELLER_INVALID``;
3. commits everything as one set (:func:`megatron_sft_idx.publishing.commit_set`): the
   manifests withdrawn at the destination, what of an old generation the new one does not
   bring removed (with ``--replace``: an order beside a manifest or shard that now has none,
   the shards of the set's name, ``BASE_NNNNNN``, that the new manifest does not list),
   the shards, then the orders (a set's ``BASE.order``, a single shard's ``P.order``), then the
   manifests, listing the promoted shards relative to themselves and keeping their ``"order"``
   record;
4. reads the destination back: every shard placed (sizes, headers, metadata), every order and
   manifest written, and nothing stale left; whatever is missing or different is a
   ``DESTINATION_INCOMPLETE`` finding on the shards it concerns, naming the file and saying what
   is there now and how to finish, and the run fails;
5. for a move (not ``--link``), removes the source manifests and orders, and only then the
   source shards -- but only of what arrived whole: a manifest whose shards did not all arrive
   stays where it was, and so do its shards (a complete copy is left at both places, as for a
   crash between commit and removal).

A manifest found beside the shards that does not parse refuses the promotion of the
shards in its directory: it might list them.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import publishing
from ..batching.order import MAX_ORDER_BYTES, Order, read_file
from ..batching.trained import TrainedCounts, trained_counts
from ..errors import ShardError
from ..format import ALL_SUFFIXES, ORDER_SUFFIX
from ..reader import MMapIndexedDataset
from ..manifest import MANIFEST_SUFFIX, MAX_MANIFEST_BYTES, MANIFEST_FORMAT, OrderRecord, parse_manifest
from ..storage.destination import Destination, LocalDestination
from .report import Report, ShardReport, make_finding

_MARK = MANIFEST_FORMAT.encode("utf-8")
_PEEK = 4096


@dataclass
class Travelling:
    """One manifest that lists promoted shards: its source path, the (absolute, normalised)
    prefixes it lists, in order, and its path at the destination."""

    source: str
    listed: List[str]
    dest: str
    record: Optional[OrderRecord] = None   # the manifest's order record, kept when its order travels
    order: Optional[str] = None     # the balanced order beside it (BASE.order), if any
    order_dest: str = ""            # where an order beside it goes (or an old one is removed, --replace)
    order_bytes: bytes = b""        # the order, read and verified before anything moves


@dataclass
class Plan:
    manifests: List[Travelling] = field(default_factory=list)
    refused: Dict[str, Tuple[str, str]] = field(default_factory=dict)   # shard prefix -> (code, why)
    orders: Dict[str, Tuple[str, bytes]] = field(default_factory=dict)  # shard key -> its own order (P.order), verified
    stale: List[str] = field(default_factory=list)   # old orders at the destination the new generation does not bring


def _key(prefix: str) -> str:
    return os.path.normpath(os.path.abspath(prefix))


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
    return [_key(p) if os.path.isabs(p) else p for p in m.prefixes], m.order


def plan(shards: Sequence[ShardReport], dest: str, destination: Destination, *, replace: bool,
         inputs: Sequence[str] = ()) -> Plan:
    """Which manifests and orders travel with ``shards`` (the ones about to be promoted), which
    shards must not be promoted (a manifest would be stranded, a file is in the way, an order is
    not whole) and which old orders ``--replace`` removes (see the module docstring)."""
    out = Plan()
    keys = {_key(s.prefix): s.prefix for s in shards}
    given = [p for p in inputs if p.endswith(MANIFEST_SUFFIX) and os.path.isfile(p)]
    beside = [m for d in sorted({os.path.dirname(k) for k in keys}) for m in _manifests_in(d)]
    paths = list({_key(p): p for p in reversed(given + beside)}.values())[::-1]  # each once, as given
    found = []
    for path in paths:
        try:
            read = _read(path)
        except ShardError as exc:
            for k, prefix in keys.items():
                if os.path.dirname(k) == os.path.dirname(_key(path)):
                    out.refused[prefix] = ("PROMOTION_REFUSED",
                                           f"a manifest beside it does not parse, so it cannot travel: {exc}")
            continue
        if read is not None and any(p in keys for p in read[0]):
            m = Travelling(path, read[0], destination.join(dest, os.path.basename(path)), read[1])
            order = path[: -len(MANIFEST_SUFFIX)] + ORDER_SUFFIX
            m.order_dest = destination.join(dest, os.path.basename(order))
            if os.path.isfile(order):
                m.order = order
            found.append(m)
    destinations: Dict[str, str] = {}
    for m in found:
        why, code = None, "PROMOTION_REFUSED"
        if m.dest in destinations:
            why = f"manifests {destinations[m.dest]} and {m.source} would both be promoted as {m.dest}"
        elif not replace and destination.exists(m.dest):
            why = f"a manifest exists at {m.dest} (pass --replace to replace it)"
        elif not replace and destination.exists(m.order_dest):
            why = f"a balanced order exists at {m.order_dest} (pass --replace to replace it)"
        else:
            why = _travelling_order(m)
            code = "TRAVELLER_INVALID"
        destinations.setdefault(m.dest, m.source)
        if why:
            _refuse(out, keys, m, code, why)
    changed = True
    while changed:  # refusing a shard can strand another manifest that lists it
        changed = False
        for m in found:
            left = [p for p in m.listed if p not in keys or keys[p] in out.refused]
            if left and any(p in keys and keys[p] not in out.refused for p in m.listed):
                _refuse(out, keys, m, "PROMOTION_REFUSED",
                        f"manifest {m.source} also lists {_names(left)}, not promoted with it: "
                        "promoting part of what a manifest lists would strand it; promote every "
                        "shard it lists (give the manifest to check-idx)")
                changed = True
    out.manifests = [m for m in found if all(p in keys and keys[p] not in out.refused for p in m.listed)]
    out.stale = [m.order_dest for m in out.manifests if m.order is None and destination.exists(m.order_dest)]
    if replace:
        for m in out.manifests:
            out.stale += _old_members(m, [keys[p] for p in m.listed], dest, destination)
    listed = {p for m in found for p in m.listed}
    for k, prefix in keys.items():   # a single shard's own order (P.order) follows it
        if k in listed or prefix in out.refused:
            continue
        order = prefix + ORDER_SUFFIX
        target = destination.join(dest, os.path.basename(order))
        there = destination.exists(target)
        if there and not replace:
            out.refused[prefix] = ("PROMOTION_REFUSED", f"a balanced order exists at {target} "
                                   "(pass --replace to replace it)")
        elif os.path.isfile(order):
            data, why = _verified_order(order, None, [prefix])
            if why:
                out.refused[prefix] = ("TRAVELLER_INVALID", why)
            else:
                out.orders[k] = (order, data)
        elif there:
            out.stale.append(target)
    return out


def _old_members(m: Travelling, prefixes: Sequence[str], dest: str, destination: Destination) -> List[str]:
    """Files at ``dest`` of shards named like the set of manifest ``m`` (``BASE_NNNNNN``) that the
    new manifest does not list: an old generation's (``--replace`` removes them)."""
    base = os.path.basename(m.dest)[: -len(MANIFEST_SUFFIX)]
    ours = re.compile(re.escape(base) + r"_\d{6}(" + "|".join(re.escape(x) for x in (*ALL_SUFFIXES, ORDER_SUFFIX))
                      + ")")
    new = {os.path.basename(p) for p in prefixes}
    out = []
    for path in destination.listing(destination.join(dest, base)):
        match = ours.fullmatch(destination.name(path))
        if match and destination.name(path)[: -len(match.group(1))] not in new:
            out.append(path)
    return sorted(out)


def _travelling_order(m: Travelling) -> Optional[str]:
    """Read and verify the order that travels with manifest ``m`` (kept in ``m.order_bytes``);
    why it cannot travel, or None."""
    if m.order is None:
        if m.record is not None:
            return (f"manifest {m.source} records the balanced order {m.record.file!r}, which is not "
                    "beside it: promoting the manifest would point training at nothing; restore the order "
                    "(or re-plan it with plan-batches --out) and check again")
        return None
    data, why = _verified_order(m.order, m.record, m.listed)
    m.order_bytes = data
    return why


def _verified_order(path: str, record: Optional[OrderRecord],
                    prefixes: Sequence[str] = ()) -> Tuple[bytes, Optional[str]]:
    """``(bytes, None)`` of the balanced order at ``path`` when it is whole (its own CRC-32s), is
    the order ``record`` (a manifest's) names, and is the order of the shards ``prefixes`` (its
    pack costs, and its trained-token counts when it records them, recomputed from them); else
    ``(b"", why)``."""
    try:
        data = _bytes_of(path)
        order = Order.from_bytes(data, path)
    except ShardError as exc:
        return b"", (f"the balanced order that travels with it is not whole: {exc}; re-plan it "
                     "(preprocess/repack --balance-for, or plan-batches --out) and check again")
    try:
        if prefixes:
            _check_order_data(order, prefixes, path)
    except ShardError as exc:
        return b"", (f"the balanced order that travels with it is not the order of these shards: {exc}; re-plan it "
                     "(preprocess/repack --balance-for, or plan-batches --out) and check again")
    if record is not None and (record.size != len(data) or record.crc32 != zlib.crc32(data)):
        return b"", (f"the balanced order {path} is not the one its manifest records (size {len(data)}, "
                     f"CRC-32 {zlib.crc32(data)}; recorded {record.size}, {record.crc32}): it "
                     "was replaced or altered since; re-plan it with the run that wrote the manifest")
    return data, None


def _check_order_data(order, prefixes: Sequence[str], path: str) -> None:
    """Refuse an order whose pack costs or trained-token counts (its step denominators) are not
    those of the shards ``prefixes``, in order (reads their indexes, and their loss masks when
    the order records counts).

    Raises:
        ShardError: naming the first pack that differs.
    """
    from ..batching.cost import shard_pack_costs   # (start-up: the numba kernels, only when an order travels)

    shards = [MMapIndexedDataset(p) for p in prefixes]
    order.check_costs(np.concatenate([shard_pack_costs(s, order.cost_model) for s in shards]), path=path)
    if order.trained is not None:
        order.check_trained(TrainedCounts.concat(trained_counts(s, eos_id=order.trained.eos_id) for s in shards),
                            path=path)


def _refuse(out: Plan, keys: Dict[str, str], m: Travelling, code: str, why: str) -> None:
    for p in m.listed:
        if p in keys and keys[p] not in out.refused:
            out.refused[keys[p]] = (code, why)


def _names(prefixes: Sequence[str], limit: int = 3) -> str:
    names = [os.path.basename(p) for p in prefixes]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def commit(the_plan: Plan, shards: Sequence[ShardReport], report: Report, destination: Destination, dest: str,
           place: Callable[[ShardReport], bool], *, link: bool) -> List[ShardReport]:
    """Commit ``shards`` (placed by ``place``) with the orders and manifests of ``the_plan`` at
    ``dest`` as one set, read the destination back, and record it in ``report``. Returns the
    shards whose source files may go (a move): those that arrived and that nothing found at the
    destination concerns; the travelling sources of those are removed here (for a move)."""
    keys = [_key(s.prefix) for s in shards]
    index = {k: i for i, k in enumerate(keys)}
    finals = [destination.join(dest, os.path.basename(s.prefix)) for s in shards]
    files: List[publishing.SetFile] = []
    sources: Dict[str, str] = {}    # destination path -> its source (orders, manifests)
    for m in the_plan.manifests:
        needs = tuple(index[p] for p in m.listed)
        after: Tuple[str, ...] = ()
        if m.order:   # after the shards, before the manifest that records it
            files.append(publishing.SetFile(m.order_dest, lambda m=m: m.order_bytes, "pack order", needs))
            sources[m.order_dest], after = m.order, (m.order_dest,)

        def manifest(m=m, needs=needs) -> bytes:
            return publishing.manifest_bytes(m.dest, [(finals[i], shards[i].prefix) for i in needs],
                                             order=m.record if m.order else None)
        files.append(publishing.SetFile(m.dest, manifest, "manifest", needs, after, commit_point=True))
        sources[m.dest] = m.source
    for k, (order, data) in the_plan.orders.items():
        target = finals[index[k]] + ORDER_SUFFIX
        files.append(publishing.SetFile(target, lambda data=data: data, "pack order", (index[k],)))
        sources[target] = order
    outcome = publishing.commit_set(destination, list(zip([s.prefix for s in shards], finals)),
                                    place=lambda i: place(shards[i]), files=files, replaced=the_plan.stale,
                                    lenient=True)
    concerns = _concerns(outcome, files, finals)
    concerned = set().union(*concerns.values()) if concerns else set()
    for f in files:
        if f.final in outcome.written:
            report.manifests.append({"source": sources[f.final], "promoted": f.final})
        else:
            report.manifests.append({"source": sources[f.final], "left": outcome.left.get(
                f.final, "not written") + "; the shards it concerns stay at the source too"})
    for path in the_plan.stale:
        if path not in {p for p, _ in outcome.problems}:
            what = "an old order" if path.endswith(ORDER_SUFFIX) else "an old shard's file"
            report.manifests.append({"source": path, "removed": f"{what} the new generation does not bring"})
    _findings(outcome, shards, concerns, dest)
    placed = set(outcome.placed)
    whole = [i for i in range(len(shards)) if i in placed and i not in concerned]
    if not link:
        gone = set(whole)
        for f in files:
            if f.final in outcome.written and all(i in gone for i in f.needs):
                LocalDestination().remove([sources[f.final]])
    return [shards[i] for i in whole]


def _concerns(outcome: publishing.SetOutcome, files: Sequence[publishing.SetFile],
              finals: Sequence[str]) -> Dict[str, set]:
    """``{path: shards (indices)}`` each problem found at the destination concerns: a shard's
    own file, or every shard an order or manifest needs; an unattributed file concerns them all."""
    need = {f.final: f.needs for f in files}
    out: Dict[str, set] = {}
    for path, _ in outcome.problems:
        own = [i for i, f in enumerate(finals) if path.startswith(f + ".")]
        out[path] = set(need.get(path, ()) or own or range(len(finals)))
    return out


def _findings(outcome: publishing.SetOutcome, shards: Sequence[ShardReport], concerns: Dict[str, set],
              dest: str) -> None:
    """A DESTINATION_INCOMPLETE finding per problem on each shard it concerns, naming the file,
    what is at the destination now and how to finish."""
    if not outcome.problems:
        return
    names = lambda paths: ", ".join(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)  # noqa: E731
    now = (f"the destination holds {len(outcome.placed)} of the {len(shards)} shards promoted"
           + (f" and {names(outcome.written)}" if outcome.written else "")
           + (f", not {names(outcome.left)}" if outcome.left else ""))
    finish = f"the sources were kept: fix the cause and rerun check-idx with --promote {dest} --replace to finish"
    for path, why in outcome.problems:
        for i in sorted(concerns[path]):
            shards[i].add(make_finding("DESTINATION_INCOMPLETE", f"{why}; {now}; {finish}", path))


def _bytes_of(path: str) -> bytes:
    """The bytes of the balanced order at ``path``, read as the adapters read one (bounded)."""
    data = read_file(path, MAX_ORDER_BYTES, "balanced order")
    if data is None:
        raise ShardError("the balanced order beside the data is gone", path=path)
    return data


__all__ = ["plan", "commit", "Plan", "Travelling"]
