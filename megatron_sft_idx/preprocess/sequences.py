"""Unpacked sequences for dynamic batching (:mod:`megatron_sft_idx.batching.dynamic`): from a sequence store, or from
shards whose every pack holds one sequence.

:class:`StoreSequences` reads the store that ``preprocess-sft --store DIR`` keeps through the
store's own reader (:class:`~megatron_sft_idx.preprocess.store.SequenceStore`): ``store.json``
and every receipt parsed strictly at open, and every partition's checksums verified once
before a length or token is used (``verify=False`` only in copies made by pickling, for
DataLoader workers). Lengths come from the partitions' ``.rows`` records, never from tokens;
sequence ``g`` is conversation ``g - starts[k]`` of partition ``k``, in input order: the store
ids of ``docs/STORE.md``. Stored sequences are untruncated (a pack size is a plan's choice).

:func:`sequence_lengths` gives the lengths of either kind of source for
:func:`~megatron_sft_idx.batching.dynamic.plan_dynamic`,
refusing a packed shard (a pack of several sequences is not one row of a dynamic micro-batch).

Example::

    seqs = StoreSequences("/data/sft/store")
    plan = plan_dynamic(seqs.lengths, global_batch_size=256, data_parallel_size=dp,
                        max_tokens_per_microbatch=16384, sequence_length_round=64, seed=1234)
    loader = DataLoader(SequenceDataset(seqs), batch_sampler=DynamicBatchSampler(plan, rank),
                        collate_fn=DynamicCollator("megatron"))
"""

from __future__ import annotations

import numpy as np

from ..errors import ShardError
from .store import SequenceStore

__all__ = ["StoreSequences", "sequence_lengths"]


class StoreSequences:
    """The sequences of a complete, verified sequence store (module doc): ``len``, ``lengths``
    (int32, no tokens read), and ``[g]`` a read-only view of sequence ``g`` (``input_ids``,
    ``loss_mask``, ``seq_start_id``).

    Raises:
        ShardError: no complete store at ``directory``, a partition that does not verify
            (naming its file; the hint says how to rebuild it), an index out of range.
    """

    def __init__(self, directory: str, *, verify: bool = True) -> None:
        self.store = SequenceStore(directory)
        if verify:
            self.store.verify()
        self._starts = self.store.starts()
        parts = [self.store.rows(k)["length"] for k in range(len(self.store.partitions))]
        self.lengths = (np.concatenate(parts) if parts else np.empty(0, np.int32)).astype(np.int32)
        self.lengths.flags.writeable = False

    @property
    def directory(self) -> str:
        return self.store.directory

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, g):
        g = int(g)
        n = len(self)
        if not 0 <= g < n:
            raise ShardError(f"sequence {g} is outside the store's {n} sequences", path=self.directory,
                             field="sequence", actual=g)
        k = int(np.searchsorted(self._starts, g, side="right") - 1)
        return self.store.part(k)[g - int(self._starts[k])]

    def __getstate__(self):
        return {"directory": self.directory}

    def __setstate__(self, state) -> None:
        self.__init__(state["directory"], verify=False)   # (verified where it was made)

    def __repr__(self) -> str:
        return f"StoreSequences({self.directory!r}, sequences={len(self)})"


def sequence_lengths(source) -> np.ndarray:
    """The length of every sequence of ``source``: a :class:`StoreSequences`, or a shard /
    multi-shard view whose every pack is one sequence.

    Raises:
        ShardError: a pack holds several sequences (dynamic batching takes unpacked sequences).
    """
    if isinstance(source, StoreSequences):
        return source.lengths
    count = len(source)
    summaries = getattr(source, "summaries", None)
    sequences = (sum(s.sequence_count for s in summaries) if summaries is not None
                 else source.seq_header.sequence_count)
    if sequences != count:
        raise ShardError(f"dynamic batching takes one sequence per item; these packs hold {sequences} sequences "
                         f"in {count} packs", path=getattr(source, "prefix", None), field="sequence_count",
                         expected=count, actual=sequences,
                         hint="give the sequence store (--store DIR of preprocess-sft), or shards written with "
                              "one sequence per pack")
    if summaries is not None:
        return np.concatenate([np.asarray(source.shard(k).sequence_lengths) for k in range(len(source.prefixes))])
    return np.asarray(source.sequence_lengths)
