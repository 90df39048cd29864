"""What every packed source hands the training adapters, whatever its format.

A *packed source* is anything with ``len(src)`` and ``src[i] -> Pack`` (three
read-only arrays: ``input_ids``, label-aligned ``loss_mask``, ``seq_start_id``)
and a :class:`PackSummary`. Our shard reader, the multi-shard view and the
in-memory :class:`FlatPackedSource` (behind the legacy ``.npy`` and Parquet
readers) all qualify, so the Megatron and Bridge datasets never look at formats.

Summary units are *raw* token counts of the stored packs (a sequence's length
includes its last token), as the shard metadata records them.

(Its old name ``megatron_sft_idx.training._sources`` warns once: :mod:`megatron_sft_idx._moved`.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from .errors import InvariantError, ShardError
from .format import PAD_LAYOUT_STORED, PAD_LAYOUTS, Rule
from .reader import MMapIndexedDataset, Pack, pack_index


@dataclass(frozen=True)
class PackSummary:
    """Shape statistics of a packed source, enough to size batches without reading packs.

    ``pack_size`` is None when the producer did not record one (then
    ``max_packed_seqlen`` bounds every pack). ``pad_seq_to_mult`` is the
    multiple every sequence was padded to (1 when unknown), in ``pad_layout``
    (``"stored"``/``"runtime"``, or ``"mixed"`` for a combination of both).
    ``min_packed_runtime_len`` is the shortest pack minus its sequence count
    (None when the producer did not record it: see :func:`bridge_stats`).
    """

    pack_count: int
    sequence_count: int
    token_count: int
    pack_size: Optional[int]
    pad_seq_to_mult: int
    max_samples_per_bin: int
    dataset_max_seqlen: int
    min_packed_seqlen: int
    max_packed_seqlen: int
    pad_layout: str = PAD_LAYOUT_STORED
    min_packed_runtime_len: Optional[int] = None

    @property
    def capacity(self) -> int:
        """The longest a pack of this source can be."""
        return self.pack_size if self.pack_size is not None else self.max_packed_seqlen

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, path: Optional[str] = None, field: str = "summary") -> "PackSummary":
        """Parse a summary (a manifest entry's) strictly: every field present, of its type.

        Raises:
            ShardError: naming ``path`` and ``field.<name>``.
        """
        if not isinstance(raw, dict):
            raise ShardError("shard summary missing or not an object", path=path, field=field, actual=raw,
                             hint="rewrite the manifest with write-sft-manifest")
        values = {}
        for name in cls.__dataclass_fields__:
            value = raw.get(name)
            if name in ("pack_size", "min_packed_runtime_len") and value is None:
                values[name] = None
                continue
            if name == "pad_layout":
                values[name] = PAD_LAYOUT_STORED if value is None else value
                if values[name] not in PAD_LAYOUTS + (MIXED_LAYOUT,):
                    raise ShardError("shard summary pad_layout is unknown", path=path, field=f"{field}.{name}",
                                     actual=value, hint="rewrite the manifest with write-sft-manifest")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 63:
                raise ShardError("shard summary field missing or not a non-negative integer",
                                 path=path, field=f"{field}.{name}", actual=value,
                                 hint="rewrite the manifest with write-sft-manifest")
            values[name] = value
        return cls(**values)

    @staticmethod
    def combine(parts) -> "PackSummary":
        """The summary of several sources read as one (pack size: the largest)."""
        parts = list(parts)
        sizes = [p.pack_size for p in parts]
        mults = {p.pad_seq_to_mult for p in parts}
        layouts = {p.pad_layout for p in parts if p.pad_seq_to_mult > 1} or {PAD_LAYOUT_STORED}
        runtime = [p.min_packed_runtime_len for p in parts]
        return PackSummary(
            pack_count=sum(p.pack_count for p in parts),
            sequence_count=sum(p.sequence_count for p in parts),
            token_count=sum(p.token_count for p in parts),
            pack_size=None if any(s is None for s in sizes) else max(sizes),
            # Sequences are aligned to every shard's multiple only if all agree; else to their gcd.
            pad_seq_to_mult=mults.pop() if len(mults) == 1 else int(np.gcd.reduce(sorted(mults))),
            max_samples_per_bin=max(p.max_samples_per_bin for p in parts),
            dataset_max_seqlen=max(p.dataset_max_seqlen for p in parts),
            min_packed_seqlen=min(p.min_packed_seqlen for p in parts),
            max_packed_seqlen=max(p.max_packed_seqlen for p in parts),
            pad_layout=layouts.pop() if len(layouts) == 1 else MIXED_LAYOUT,
            min_packed_runtime_len=None if None in runtime else min(runtime),
        )


def summarize(source) -> PackSummary:
    """The :class:`PackSummary` of any packed source.

    For our shards it comes from the metadata (no data read); for upstream
    pretrain ``.bin/.idx`` data (one sequence per pack) from the length array.
    """
    if isinstance(source, MMapIndexedDataset):
        return _shard_summary(source)
    summary = getattr(source, "summary", None)
    if isinstance(summary, PackSummary):
        return summary
    raise TypeError(f"{type(source).__name__} is not a packed source (no PackSummary)")


def _shard_summary(shard: MMapIndexedDataset) -> PackSummary:
    m = shard.metadata
    if m.stats is not None:
        s = m.stats
        return PackSummary(
            pack_count=s.pack_count, sequence_count=s.sequence_count, token_count=s.token_count,
            pack_size=m.pack_size, pad_seq_to_mult=m.pad_seq_to_mult,
            max_samples_per_bin=s.max_samples_per_bin, dataset_max_seqlen=s.dataset_max_seqlen,
            min_packed_seqlen=s.min_packed_seqlen, max_packed_seqlen=s.max_packed_seqlen,
            pad_layout=m.pad_layout, min_packed_runtime_len=s.min_packed_runtime_len)
    lengths = np.asarray(shard.sequence_lengths)
    n = int(lengths.shape[0])
    longest = int(lengths.max()) if n else 0
    return PackSummary(pack_count=n, sequence_count=n, token_count=int(lengths.sum(dtype=np.int64)),
                       pack_size=None, pad_seq_to_mult=1, max_samples_per_bin=1 if n else 0,
                       dataset_max_seqlen=longest, min_packed_seqlen=int(lengths.min()) if n else 0,
                       max_packed_seqlen=longest, min_packed_runtime_len=int(lengths.min()) - 1 if n else 0)


def runtime_min_packed(source) -> int:
    """The shortest pack's runtime length (``packed_len - sequences``) of any packed source.

    From the summary when recorded (format 1.1); else computed from the index arrays of
    each shard (``P.idx`` lengths and ``P.seq.idx`` offsets, no pack data read). A source of
    many shards (a :class:`~megatron_sft_idx.multi.MultiShardDataset`: ``summaries`` and
    ``shard(k)``) takes the minimum over its shards.
    """
    recorded = summarize(source).min_packed_runtime_len
    if recorded is not None:
        return int(recorded)
    if isinstance(source, MMapIndexedDataset):
        lengths = np.asarray(source.sequence_lengths, dtype=np.int64)
        return int((lengths - np.diff(np.asarray(source.seq_offsets))).min())
    if hasattr(source, "summaries") and hasattr(source, "shard"):
        return min(runtime_min_packed(source.shard(k)) if s.min_packed_runtime_len is None
                   else int(s.min_packed_runtime_len) for k, s in enumerate(source.summaries))
    raise TypeError(f"{type(source).__name__} records no min_packed_runtime_len")


#: ``PackSummary.pad_layout`` of sources combining shards padded in different layouts.
MIXED_LAYOUT = "mixed"


class FlatPackedSource:
    """Packs held as three flat arrays plus CSR offsets (the in-memory twin of a shard).

    Args:
        tokens, loss_mask: one value per token of every pack, concatenated.
        seq_starts: every pack's ``seq_start_id`` values, concatenated.
        token_offsets: ``n + 1`` int64 offsets of each pack in ``tokens``.
        seq_offsets: ``n + 1`` int64 offsets of each pack in ``seq_starts``.
        path: where the data came from (for messages).
        pad_seq_to_mult: the multiple sequences were padded to, if the caller knows it.
        pad_layout: which length that multiple applies to (``"stored"`` or ``"runtime"``).

    Raises:
        InvariantError: a pack breaks a format invariant (checked vectorised at open).
    """

    def __init__(self, tokens, loss_mask, seq_starts, token_offsets, seq_offsets, *, path: str,
                 pad_seq_to_mult: int = 1, pack_size: Optional[int] = None,
                 pad_layout: str = PAD_LAYOUT_STORED) -> None:
        self.path = str(path)
        self.tokens = _read_only(np.ascontiguousarray(tokens))
        self.token_offsets = _read_only(np.ascontiguousarray(token_offsets, dtype=np.int64))
        seq_starts = np.asarray(seq_starts)
        if seq_starts.size and seq_starts.dtype.kind in "iu" and (
                int(seq_starts.max()) > _INT32_MAX or int(seq_starts.min()) < -_INT32_MAX - 1):
            raise ShardError("a seq_start_id value does not fit int32 (it would wrap)", path=self.path,
                             field="seq_start_id", actual=int(seq_starts.max()) if int(seq_starts.max()) > _INT32_MAX
                             else int(seq_starts.min()), hint="fix the producer of this file or rebuild it")
        self.seq_starts = _read_only(np.ascontiguousarray(seq_starts, dtype=np.int32))
        self.seq_offsets = _read_only(np.ascontiguousarray(seq_offsets, dtype=np.int64))
        loss_mask = np.ascontiguousarray(loss_mask)
        # Checked before the cast to uint8, which would wrap a -1 or 256 into a valid-looking value.
        self.pad_layout = pad_layout
        max_seqlen = self._validate(loss_mask, pad_seq_to_mult, pack_size)
        self.loss_mask = _read_only(loss_mask.astype(np.uint8))
        self.summary = self._summarize(pad_seq_to_mult, pack_size, max_seqlen)

    def __len__(self) -> int:
        return int(self.token_offsets.shape[0] - 1)

    def __getitem__(self, i) -> Pack:
        i = pack_index(i, len(self), self.path)
        t0, t1 = self.token_offsets[i], self.token_offsets[i + 1]
        s0, s1 = self.seq_offsets[i], self.seq_offsets[i + 1]
        return Pack(self.tokens[t0:t1], self.loss_mask[t0:t1], self.seq_starts[s0:s1])

    def _fail(self, pack, rule: Rule, field: str) -> InvariantError:
        return InvariantError(f"pack {pack} breaks an invariant: {rule.describe}", path=self.path,
                              pack=int(pack), field=field, rule=rule.name,
                              hint="fix the producer of this file or rebuild it")

    def _validate(self, loss_mask: np.ndarray, pad_seq_to_mult: int, pack_size: Optional[int]) -> int:
        """Every pack invariant, through the numba scan the builder, reader and gate use.

        Returns the longest sequence. numba is imported here, not at module import: only the
        in-memory formats (legacy ``.npy``, Parquet) come through this path.
        """
        from . import _kernels   # (start-up: numba, and the packing package's; only the in-memory formats)
        from .packing.padding import pad_offset

        n = len(self)
        lengths = np.diff(self.token_offsets)
        if loss_mask.shape != self.tokens.shape:
            raise self._fail(0, Rule.LENGTH_MISMATCH, "loss_mask")
        if n and (lengths.min() < 0 or np.diff(self.seq_offsets).min() < 0
                  or self.token_offsets[-1] != self.tokens.size or self.seq_offsets[-1] != self.seq_starts.size):
            raise ShardError("pack offsets are not a cumulative partition of the arrays", path=self.path,
                             field="offsets", hint="fix the producer of this file or rebuild it")
        found = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
        counts = np.zeros(_kernels.N_RULES, np.int64)
        result = _kernels.scan_packs(lengths, self.token_offsets, self.seq_offsets, self.tokens, loss_mask,
                                     self.seq_starts, pack_size or 0, _INT32_MAX, 0, int(pad_seq_to_mult),
                                     0, n, 1, *found, counts, pad_offset(self.pad_layout))
        if result[0]:
            rule = Rule(int(found[0][0]))
            raise self._fail(int(found[1][0]), rule, _RULE_FIELD.get(rule, "seq_start_id"))
        return int(result[1])

    def _summarize(self, pad_seq_to_mult: int, pack_size: Optional[int], max_seqlen: int) -> PackSummary:
        lengths = np.diff(self.token_offsets)
        counts = np.diff(self.seq_offsets)
        return PackSummary(
            pack_count=len(self), sequence_count=int(counts.sum()), token_count=int(lengths.sum()),
            pack_size=pack_size, pad_seq_to_mult=int(pad_seq_to_mult),
            max_samples_per_bin=int(counts.max()), dataset_max_seqlen=max_seqlen,
            min_packed_seqlen=int(lengths.min()), max_packed_seqlen=int(lengths.max()),
            pad_layout=self.pad_layout, min_packed_runtime_len=int((lengths - counts).min()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, packs={len(self)})"


_INT32_MAX = int(np.iinfo(np.int32).max)
_RULE_FIELD = {Rule.LOSS_VALUE: "loss_mask", Rule.LOSS_ON_LAST: "loss_mask", Rule.LENGTH_MISMATCH: "loss_mask",
               Rule.PACK_EMPTY: "input_ids", Rule.PACK_TOO_LONG: "input_ids", Rule.TOKEN_NEGATIVE: "input_ids",
               Rule.TOKEN_TOO_LARGE: "input_ids", Rule.TOKEN_OUT_OF_VOCAB: "input_ids"}


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr
