"""Virtual packs: a pack plan served straight from the sequence store, gathered at read time.

``VirtualPackedDataset(store, plan)`` has the reader's interface — ``len``, ``ds[i] -> Pack``
(``input_ids``, ``loss_mask``, ``seq_start_id``), slices, ``sequence_lengths``,
``pack_size`` — and returns, for every pack, exactly the arrays the materialized shard would
hold (same token dtype, padding, truncation), so trying a new pack size or CP layout costs a
``repack_sft --plan-only`` (seconds) instead of writing every token again. Each read gathers
its sequences from the store's partitions (``pread``), so it costs more than a read from a
materialized shard (``bench/stages.py`` measures by how much). Pickles as its paths, for
DataLoader workers.

A mixture's plan (``repack-sft --mix FILE --plan-only``) is served from its stores, given in the
mixture's order; ``sources`` and ``source_ids(i)`` then say where each sequence came from, as a
shard written from it does.

Example::

    repack_sft --store /data/store --plan-only /tmp/cp4.plan --pack-size 8192 --cp 4
    ds = VirtualPackedDataset("/data/store", "/tmp/cp4.plan", split="all")
    pack = ds[0]
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ShardError
from ..format import SEQ_DTYPE, choose_token_dtype
from ..reader import Pack, pack_index
from .materialize import Gatherer
from .planfile import PackPlan
from .store import SequenceStore
from .stores import StoreSet


class VirtualPackedDataset:
    """The packs of one split of a plan (optionally one output shard of it), read from the store.

    Args:
        store: the sequence store directory the plan was made from (a mixture's plan: the list of
            its stores' directories, in the mixture's order).
        plan: the plan file (``repack_sft --plan-only``, or a run's ``plan/out.plan``).
        split: the split's name (``all`` without ``--split``); needed when the plan has several.
        shard: serve only the packs of this output shard of the split.
        pad_id: the pad token (default: the tokenizer's pad, else EOS, as preprocessing does).
        verify: verify every store partition's checksums and every plan array against the
            store before serving (one read of the store; ``docs/STORE.md`` gives the cost).
            Copies made by pickling (DataLoader workers) rely on the original's verification.

    Raises:
        ShardError: the plan was made from another store, a partition or the plan does not
            verify (naming the file and field), an unknown split or shard, no pad id.
    """

    def __init__(self, store: str, plan: str, split: Optional[str] = None, shard: Optional[int] = None,
                 pad_id: Optional[int] = None, verify: bool = True) -> None:
        self._args = (store, plan, split, shard, pad_id)
        self.plan = PackPlan(plan, verify=verify)
        self.store = self._stores(store, plan)
        if verify:
            for one in getattr(self.store, "stores", [self.store]):
                one.verify()
            self.plan.validate(self.store)
        names = [s["name"] for s in self.plan.splits]
        if split is None and len(names) != 1:
            raise ShardError(f"the plan has splits {names}; choose one", path=plan, field="split")
        self.split = names[0] if split is None else split
        self._arrays = self.plan.arrays(self.plan.split_index(self.split))
        starts = self._arrays["shard_starts"]
        if shard is not None and not 0 <= shard < starts.size - 1:
            raise ShardError(f"split {self.split} has {starts.size - 1} shards", path=plan, field="shard", actual=shard)
        self._first = 0 if shard is None else int(starts[shard])
        self._n = int(starts[-1] if shard is None else starts[shard + 1]) - self._first
        settings = self.plan.settings
        self.pack_size = settings.pack_size
        self.pad_seq_to_mult = settings.pad_multiple
        self.vocab_size = self.store.vocab_size
        if pad_id is None:
            pad_id = (self.store.tokenizer or {}).get("pad_id")
        if pad_id is None:
            raise ShardError("no pad id: the store has no tokenizer", field="pad_id", hint="pass pad_id=")
        self.dtype = choose_token_dtype(None if self.vocab_size is None else self.vocab_size - 1).numpy
        self.pad_layout = settings.pad_layout
        self._gather = Gatherer(self.store, self.pack_size, self.pad_seq_to_mult, int(pad_id), self.pad_layout,
                                settings.truncated_turn_loss)

    def _stores(self, store, plan: str):
        """The store (or a mixture's stores) the plan names, by store id.

        Raises:
            ShardError: another store, or one store for a mixture's plan (or several for one store's)."""
        meta = self.plan.metadata
        if isinstance(store, (list, tuple)) != self.plan.mixed:
            raise ShardError("a mixture's plan is served from its stores (a list, in the mixture's order), a plan of "
                             "one store from that store", path=plan, field="store",
                             expected=[s["name"] for s in meta["stores"]] if self.plan.mixed else "one directory")
        if self.plan.mixed:
            out = StoreSet([SequenceStore(d) for d in store], [s["name"] for s in meta["stores"]])
            mine, theirs = [s.store_id for s in out.stores], [s["store_id"] for s in meta["stores"]]
        else:
            out = SequenceStore(store)
            mine, theirs = out.store_id, meta["store"]["store_id"]
        if mine != theirs:
            raise ShardError("the plan was made from another sequence store", path=plan, field="store_id",
                             expected=mine, actual=theirs)
        return out

    @property
    def sources(self) -> Optional[tuple]:
        """A mixture's source names (what :meth:`source_ids` index), None for one store's plan."""
        return tuple(self.store.names) if isinstance(self.store, StoreSet) else None

    def source_ids(self, idx) -> np.ndarray:
        """Each sequence's source of pack ``idx`` (uint16), as a shard of the mixture records it.

        Raises:
            ShardError: a plan of one store (no sources)."""
        if self.sources is None:
            raise ShardError("a plan of one store has no sources", path=self.plan.path, field="sources")
        b = self._first + pack_index(idx, self._n, self.plan.path)
        offsets = self._arrays["pack_offsets"]
        ids = self._arrays["sequence_ids"][int(offsets[b]):int(offsets[b + 1])]
        return self.store.source_of(ids).astype(np.uint16)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._n)
            if step != 1:
                raise ValueError("slices of a dataset must be contiguous (step 1)")
            return [self._pack(i) for i in range(start, stop)]
        return self._pack(idx)

    def _pack(self, idx) -> Pack:
        b = self._first + pack_index(idx, self._n, self.plan.path)
        ids, mask, starts, ends = self._gather.packs(self._arrays, b, b + 1)
        input_ids = ids.astype(self.dtype)
        seq_start_id = (starts[0] - ends[0]).astype(SEQ_DTYPE.numpy)
        for arr in (input_ids, mask, seq_start_id):
            arr.flags.writeable = False
        return Pack(input_ids, mask, seq_start_id)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 packed length of every pack."""
        return self._arrays["pack_loads"][self._first:self._first + self._n]

    def __getstate__(self):
        return {"args": self._args}

    def __setstate__(self, state) -> None:
        self.__init__(*state["args"], verify=False)   # (verified where it was made)

    def __repr__(self) -> str:
        where = getattr(self.store, "directories", None) or self.store.directory
        return (f"VirtualPackedDataset({where!r}, {self.plan.path!r}, split={self.split!r}, "
                f"packs={self._n})")


__all__ = ["VirtualPackedDataset"]
