"""Virtual packs: a pack plan served straight from the sequence store, gathered at read time.

``VirtualPackedDataset(store, plan)`` has the reader's interface — ``len``, ``ds[i] -> Pack``
(``input_ids``, ``loss_mask``, ``seq_start_id``), slices, ``sequence_lengths``,
``pack_size`` — and returns, for every pack, exactly the arrays the materialized shard would
hold (same token dtype, padding, truncation), so trying a new pack size or CP layout costs a
``repack_sft --plan-only`` (seconds) instead of writing every token again. Each read gathers
its sequences from the store's partitions (``pread``), so it costs more than a read from a
materialized shard (``bench/stages.py`` measures by how much). Pickles as its paths, for
DataLoader workers.

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


class VirtualPackedDataset:
    """The packs of one split of a plan (optionally one output shard of it), read from the store.

    Args:
        store: the sequence store directory the plan was made from.
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
        self.store = SequenceStore(store)
        self.plan = PackPlan(plan, verify=verify)
        if self.plan.metadata["store"]["store_id"] != self.store.store_id:
            raise ShardError("the plan was made from another sequence store", path=plan, field="store_id",
                             expected=self.store.store_id, actual=self.plan.metadata["store"]["store_id"])
        if verify:
            self.store.verify()
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
        return (f"VirtualPackedDataset({self.store.directory!r}, {self.plan.path!r}, split={self.split!r}, "
                f"packs={self._n})")


__all__ = ["VirtualPackedDataset"]
