"""The pack plan file (``*.plan``): which store sequences make each pack, for every split.

Layout, version 1.0 (``docs/STORE.md`` is the specification): the container of
:mod:`megatron_sft_idx._container` (a 64-byte header with both CRC-32s, then the arrays, then the
metadata; integers little-endian) with magic ``MSFTPLN\\x00``.

Per split the metadata names three arrays, ``[offset, count, dtype]`` each:
``shard_starts`` (int64[S+1]: first pack of each output shard, then the pack count),
``pack_offsets`` (int64[P+1]: CSR pointers into ``sequence_ids``), ``pack_loads`` (int32[P]:
padded tokens per pack) and ``sequence_ids`` (int32, or int64 past 2**31 - 2 store
sequences: the store sequences of each pack, ascending inside a pack, in pack order).
The file is written under a temporary name, fsynced and renamed: it exists whole or not at all.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Dict, List, Optional

import numpy as np

from .. import _atomic
from .._container import ALIGN as _ALIGN
from .._container import HEADER, HEADER_SIZE, Kind  # (HEADER: the container's layout, named here too)
from ..errors import HeaderError, ShardError
from ..jsondoc import HEX, Doc, check_int, parse_json
from .config import PlanSettings
from .mixture import UNITS

PLAN_MAGIC = b"MSFTPLN\x00"
PLAN_VERSION = (1, 0)
#: A mixture's plan (:mod:`.mixplan`): ``stores`` instead of ``store``, per split ``sources`` and
#: ``pack_measures`` (a plan of one store is still written as 1.0, byte for byte as before).
MIX_PLAN_VERSION = (1, 1)
PLAN_FORMAT = "megatron_sft_idx.plan"
_KIND = Kind(PLAN_MAGIC, PLAN_VERSION, "plan", "a plan", "a pack plan", "re-plan with this version")
_KINDS = {PLAN_VERSION: _KIND, MIX_PLAN_VERSION: Kind(PLAN_MAGIC, MIX_PLAN_VERSION, "plan", "a plan", "a pack plan",
                                                      "re-plan with this version")}
_DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
_VALIDATE_PACKS = 1 << 18   # packs whose sequence ids are checked at once
SPLIT_NAMES = ("train", "valid", "test", "all")
_ARRAYS = ("shard_starts", "pack_offsets", "pack_loads", "sequence_ids")
_MIX_ARRAYS = _ARRAYS + ("pack_measures",)


class PlanWriter:
    """Streams the arrays of each split, then the metadata; :meth:`close` publishes the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp = _atomic.temporary_path(path)
        self.file = open(self.tmp, "wb")
        self.file.write(b"\0" * HEADER_SIZE)
        self.offset = HEADER_SIZE
        self.crc = 0

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.offset += view.nbytes

    def _pad(self) -> None:
        gap = -self.offset % _ALIGN
        if gap:
            self._write(b"\0" * gap)

    def array(self, values: np.ndarray, dtype: str) -> list:
        """Append one whole array; returns its ``[offset, count, dtype]`` locator."""
        return self.array_chunks([values], dtype)

    def array_chunks(self, chunks, dtype: str) -> list:
        """Append an array given as consecutive chunks (bounded memory); returns its locator."""
        self._pad()
        start, count = self.offset, 0
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk, dtype=_DTYPES[dtype])
            self._write(chunk)
            count += chunk.size
        return [start, count, dtype]

    def close(self, metadata: dict, version=PLAN_VERSION) -> None:
        meta = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
        meta_offset = self.offset
        self._write(meta)
        self.file.seek(0)
        self.file.write(_KINDS[tuple(version)].pack_header(meta_offset, len(meta), self.crc))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        _atomic.fsync_dir(self.path)

    def abort(self) -> None:
        self.file.close()
        _atomic.remove_quietly([self.tmp])


class PackPlan:
    """A plan file opened for reading: ``metadata``, its ``settings`` (a
    :class:`~megatron_sft_idx.preprocess.config.PlanSettings`, parsed once at open) and the arrays
    of each split (mapped).

    Opening checks the header, the body CRC-32 (``verify``) and the metadata as strictly as a
    shard header: every key the tools read, its type and range, and every array inside the
    arrays section with its expected dtype and a count that agrees with the split's counts.
    :meth:`validate` checks the arrays' values (once per run, by whoever makes packs from them).

    Raises:
        ShardError (HeaderError, VersionError): not a plan, a corrupt or malformed one (naming
            the field), or an unknown major.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
                header = self._parse_header(raw, size)
                f.seek(header["metadata_offset"])
                meta = f.read(header["metadata_length"])
        except OSError as exc:
            raise ShardError(f"cannot read the pack plan ({exc.strerror or exc})", path=self.path) from None
        self._map: Optional[np.ndarray] = None
        self._arrays_end = header["metadata_offset"]
        if verify:
            self._verify_body(header["body_crc32"], size)
        try:
            self.metadata = parse_json(meta, self.path)
        except ShardError as exc:
            raise HeaderError(f"plan metadata: {exc.message}", path=self.path, field="metadata") from None
        if not isinstance(self.metadata, dict) or self.metadata.get("format") != PLAN_FORMAT:
            raise HeaderError("plan metadata names another format", path=self.path, field="format",
                              expected=PLAN_FORMAT)
        self._check_metadata()

    def _parse_header(self, raw: bytes, size: int) -> dict:
        meta_off, meta_len, body_crc = _KIND.parse_header(raw, size, self.path)
        return {"metadata_offset": meta_off, "metadata_length": meta_len, "body_crc32": body_crc}

    def _verify_body(self, expected: int, size: int) -> None:
        crc = 0
        with open(self.path, "rb") as f:
            f.seek(HEADER_SIZE)
            for block in iter(lambda: f.read(1 << 22), b""):
                crc = zlib.crc32(block, crc)
        if crc != expected:
            raise HeaderError("plan body CRC-32 mismatch: the file was modified or is corrupt", path=self.path,
                              field="body_crc32", expected=expected, actual=crc)

    # ------------------------------------------------------------------ structure (at open)

    def _check_metadata(self) -> None:
        """Types, ranges and cross-references of the metadata; the arrays located and sized."""
        doc = Doc(self.metadata, self.path, error=HeaderError)
        self.settings = PlanSettings.from_doc(doc.doc("settings"))
        pack_size = self.settings.pack_size
        self.mixed = "stores" in self.metadata
        if self.mixed:   # a mixture's plan (MIX_PLAN_VERSION): its stores, one after another
            sequences = self._check_stores(doc)
            conversations = doc.int("conversations", lo=0)
        else:
            store = doc.doc("store")
            store.str("store_id", pattern=HEX[32])
            sequences = store.int("sequences", lo=0)
            conversations = doc.int("conversations", lo=0, hi=sequences)
        for key in ("truncated", "padding_tokens"):
            doc.int(key, lo=0)
        doc.ints("skipped", lo=0)
        doc.strs("first_skipped")
        empty = doc.list("empty_splits")
        for k, name in enumerate(empty):
            if name not in SPLIT_NAMES:
                raise HeaderError("unknown split name", path=self.path, field=f"empty_splits[{k}]", actual=name)
        splits = doc.docs("splits")
        names = [s.str("name", choices=SPLIT_NAMES) for s in splits]
        if not splits or len(set(names)) != len(names) or set(names) & set(map(str, empty)):
            raise HeaderError("a plan names each split once (and not as empty)", path=self.path, field="splits",
                              actual=names)
        total = 0
        for i, split in enumerate(splits):
            total += self._check_split(split, pack_size, sequences)
        if total != conversations:
            raise HeaderError("the splits' conversations do not add up", path=self.path, field="conversations",
                              expected=total, actual=conversations)

    def _check_stores(self, doc: Doc) -> int:
        """A mixture's ``stores`` (name, store id, sequences each) and ``mixture``; returns the
        total of the stores' sequences (the range of the global ids)."""
        stores = doc.docs("stores")
        if not stores:
            raise doc.fail("a mixture's plan names at least one store", "stores")
        names = []
        for st in stores:
            names.append(st.str("name"))
            st.str("store_id", pattern=HEX[32])
            st.int("sequences", lo=0)
        if len(set(names)) != len(names):
            raise doc.fail("a mixture's plan names each source once", "stores", actual=names)
        mixture = doc.doc("mixture")
        mixture.str("unit", choices=UNITS)
        if len(mixture.list("sources")) != len(stores):
            raise doc.fail("the mixture's sources are not the plan's stores", "mixture.sources",
                           expected=len(stores), actual=len(mixture.list("sources")))
        self.store_offsets = np.concatenate(([0], np.cumsum([st.obj["sequences"] for st in stores]))).astype(np.int64)
        return int(self.store_offsets[-1])

    def _check_sources(self, split: Doc, conversations: int) -> None:
        """A mixture split's ``sources``: one record per store, whose sequences add up."""
        sources = split.docs("sources")
        if len(sources) != len(self.metadata["stores"]):
            raise split.fail("one record per source", "sources", expected=len(self.metadata["stores"]),
                             actual=len(sources))
        total = 0
        for src in sources:
            src.str("name")
            for key in ("members", "sequences", "epoch_amount", "amount", "tokens", "trained_tokens", "epoch_tokens",
                        "epoch_trained_tokens"):
                src.int(key, lo=0)
            src.number("target_epochs", 0.0, float("inf"))
            alone = src.doc("packed_alone")
            for key in ("packs", "tokens", "trained_tokens", "amount"):
                alone.int(key, lo=0)
            total += src.obj["sequences"]
        if total != conversations:
            raise split.fail("the sources' sequences do not add up to the split's", "sources",
                             expected=conversations, actual=total)

    def _check_split(self, split: Doc, pack_size: int, sequences: int) -> int:
        conversations = split.int("conversations", lo=1, hi=None if self.mixed else sequences)
        packs = split.int("packs", lo=1, hi=conversations)
        shards = split.int("shards", lo=1, hi=packs)
        split.number("packing_efficiency", 0.0, 1.0)
        split.number("bins_over_lower_bound", 0.0, float("inf"))
        arrays = split.doc("arrays")
        expected = {"shard_starts": (shards + 1, ("int64",)), "pack_offsets": (packs + 1, ("int64",)),
                    "pack_loads": (packs, ("int32",)), "sequence_ids": (conversations, ("int32", "int64"))}
        if self.mixed:
            self._check_sources(split, conversations)
            expected["pack_measures"] = (packs * len(self.metadata["stores"]), ("int32",))
        spans = []
        for name, (count, dtypes) in expected.items():
            entry = arrays.list(name, length=3)
            where = arrays.field(name)
            offset = check_int(entry[0], self.path, where + "[0]", HEADER_SIZE, self._arrays_end, HeaderError)
            check_int(entry[1], self.path, where + "[1]", count, count, HeaderError)
            if entry[2] not in dtypes:
                raise HeaderError(f"plan array {name} has an unexpected dtype", path=self.path, field=where + "[2]",
                                  expected=list(dtypes), actual=entry[2])
            end = offset + count * _DTYPES[entry[2]].itemsize
            if offset % _DTYPES[entry[2]].itemsize or end > self._arrays_end:
                raise HeaderError(f"plan array {name} lies outside the arrays section", path=self.path, field=where,
                                  expected=f"{HEADER_SIZE}..{self._arrays_end}", actual=[offset, end])
            spans.append((offset, end, name))
        spans.sort()
        for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
            if b_start < a_end:
                raise HeaderError(f"plan arrays {a} and {b} overlap", path=self.path, field=arrays.field(b))
        return conversations

    # ------------------------------------------------------------------ values (once per run)

    def validate(self, store=None) -> None:
        """Check every array's values: shard starts and pack offsets rising from 0 to their
        counts, pack loads in ``[1, pack_size]``, sequence ids in the store's range, ascending
        inside each pack and used once in the whole plan; with the ``store`` (a
        :class:`~megatron_sft_idx.preprocess.store.SequenceStore`) also its id and size, and
        every pack's load equal to its sequences' lengths cut and padded by the plan's
        settings, none of them one the settings drop. Memory: ~5 bytes per store sequence
        (a bitmap, and the padded lengths with ``store``) plus a chunk of packs.

        Raises:
            HeaderError: the first value that breaks a rule, naming the split and the array.
        """
        meta = self.metadata
        sequences = int(self.store_offsets[-1]) if self.mixed else meta["store"]["sequences"]
        padded = None
        if store is not None:
            padded = self._store_lengths(store)
        if not self.mixed and meta["conversations"] + sum(meta["skipped"].values()) != sequences:
            raise HeaderError("planned and skipped conversations do not add up to the store's", path=self.path,
                              field="conversations", expected=sequences - sum(meta["skipped"].values()),
                              actual=meta["conversations"])
        # one plan: each sequence planned once; a mixture's: in one split only (1 + its split), per
        # source as often as the split records
        seen = np.zeros(sequences, dtype=np.int8 if self.mixed else np.bool_)
        for i, split in enumerate(self.splits):
            self._validate_split(i, split, seen, padded)
        if not self.mixed and int(np.count_nonzero(seen)) != meta["conversations"]:
            raise HeaderError("a store sequence is planned twice", path=self.path, field="sequence_ids",
                              expected=meta["conversations"], actual=int(np.count_nonzero(seen)))

    def _fail(self, i: int, name: str, rule: str, **kw) -> HeaderError:
        return HeaderError(f"plan split {self.splits[i]['name']}: {rule}", path=self.path,
                           field=f"splits[{i}].arrays.{name}", hint="write the plan again (repack-sft --plan-only, "
                           "or rerun with --resume, which re-plans)", **kw)

    def _store_lengths(self, store) -> np.ndarray:
        """Padded, cut length of every store sequence, or -1 for one the settings drop."""
        meta, s = self.metadata, self.settings
        if self.mixed:
            mine = [[st["name"], st["store_id"], st["sequences"]] for st in meta["stores"]]
            theirs = [[n, st.store_id, st.sequence_count] for n, st in zip(getattr(store, "names", [None]),
                                                                             getattr(store, "stores", [store]))]
            if mine != theirs:
                raise HeaderError("the plan was made from other sequence stores", path=self.path, field="stores",
                                  expected=theirs, actual=mine)
        elif meta["store"]["store_id"] != store.store_id or meta["store"]["sequences"] != store.sequence_count:
            raise HeaderError("the plan was made from another sequence store", path=self.path, field="store",
                              expected=[store.store_id, store.sequence_count],
                              actual=[meta["store"]["store_id"], meta["store"]["sequences"]])
        trunc = s.truncate_to
        out = np.empty(store.sequence_count, dtype=np.int32)
        at = 0
        for k in range(len(store.partitions)):
            rows = store.rows(k)
            full = rows["length"].astype(np.int64)
            cut = s.padded(np.minimum(full, trunc))
            over = s.padded(full) > s.pack_size
            drop = over if s.overlong != "truncate" else over & (rows["first_trained"] >= trunc - 1)
            out[at:at + rows.size] = np.where(drop, -1, cut)
            at += rows.size
        return out

    def _validate_split(self, i: int, split: dict, seen: np.ndarray, padded) -> None:
        a = self.arrays(i)
        starts, offsets, loads, ids = a["shard_starts"], a["pack_offsets"], a["pack_loads"], a["sequence_ids"]
        for name, arr, end in (("shard_starts", starts, split["packs"]), ("pack_offsets", offsets, ids.size)):
            if arr[0] != 0 or arr[-1] != end or (np.diff(arr) <= 0).any():
                raise self._fail(i, name, f"must rise strictly from 0 to {end}")
        pack_size = self.settings.pack_size
        counted = np.zeros(self.store_offsets.size - 1 if self.mixed else 0, dtype=np.int64)
        if loads.min() < 1 or loads.max() > pack_size:
            raise self._fail(i, "pack_loads", f"every load must be in [1, {pack_size}]",
                             actual=[int(loads.min()), int(loads.max())])
        for p0 in range(0, loads.size, _VALIDATE_PACKS):
            p1 = min(p0 + _VALIDATE_PACKS, loads.size)
            s0, s1 = int(offsets[p0]), int(offsets[p1])
            chunk = np.asarray(ids[s0:s1], dtype=np.int64)
            if chunk.min() < 0 or chunk.max() >= seen.size:
                raise self._fail(i, "sequence_ids", f"ids must be in [0, {seen.size})",
                                 actual=[int(chunk.min()), int(chunk.max())])
            first = np.asarray(offsets[p0:p1], dtype=np.int64) - s0   # each pack's first id in ``chunk``
            rising = np.diff(chunk) >= 0 if self.mixed else np.diff(chunk) > 0   # (a mixture may repeat one)
            rising[first[1:] - 1] = True                               # a new pack may start lower
            if not rising.all():
                raise self._fail(i, "sequence_ids", "ids must ascend inside each pack",
                                 pack=int(np.searchsorted(first, np.flatnonzero(~rising)[0], side="right") - 1 + p0))
            if self.mixed:
                other = (seen[chunk] != 0) & (seen[chunk] != i + 1)
                if other.any():
                    raise self._fail(i, "sequence_ids", "a store sequence is planned in two splits",
                                     actual=int(chunk[other][0]))
                seen[chunk] = i + 1
                counted += np.bincount(np.searchsorted(self.store_offsets, chunk, side="right") - 1,
                                       minlength=counted.size)
            elif seen[chunk].any():
                raise self._fail(i, "sequence_ids", "a store sequence is planned twice",
                                 actual=int(chunk[seen[chunk]][0]))
            else:
                seen[chunk] = True
            if padded is not None:
                lengths = padded[chunk]
                if lengths.min() < 0:
                    raise self._fail(i, "sequence_ids", "plans a sequence its settings drop (overlong)",
                                     actual=int(chunk[lengths < 0][0]))
                want = np.add.reduceat(lengths.astype(np.int64), first)
                bad = np.flatnonzero(want != loads[p0:p1])
                if bad.size:
                    raise self._fail(i, "pack_loads", "a pack's load is not its sequences' padded lengths",
                                     pack=int(bad[0] + p0), expected=int(want[bad[0]]),
                                     actual=int(loads[p0 + bad[0]]))
        if self.mixed:
            recorded = [src["sequences"] for src in split["sources"]]
            if counted.tolist() != recorded:
                raise self._fail(i, "sequence_ids", "the sequences of each source are not what the split records",
                                 expected=recorded, actual=counted.tolist())
            if (a["pack_measures"] < 0).any():
                raise self._fail(i, "pack_measures", "a pack's measure of a source is negative")

    # ------------------------------------------------------------------ access

    @property
    def splits(self) -> List[dict]:
        return self.metadata["splits"]

    def split_index(self, name: str) -> int:
        for i, split in enumerate(self.splits):
            if split["name"] == name:
                return i
        raise ShardError(f"the plan has no split {name!r}", path=self.path, field="split",
                         expected=[s["name"] for s in self.splits], actual=name)

    def arrays(self, split: int) -> Dict[str, np.ndarray]:
        """Read-only views of split ``split``'s arrays, mapped (nothing is read until used);
        located and sized at open (:meth:`_check_metadata`)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            if self._map.shape[0] < self._arrays_end:
                raise HeaderError("the plan file shrank after it was opened", path=self.path, field="file_size")
        known = _MIX_ARRAYS if self.mixed else _ARRAYS   # (only the arrays checked at open)
        return {name: np.frombuffer(self._map, dtype=_DTYPES[dtype], count=count, offset=offset)
                for name, (offset, count, dtype) in self.splits[split]["arrays"].items() if name in known}

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state) -> None:
        self.__init__(state["path"], verify=False)
