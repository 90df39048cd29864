"""Other packed formats -> one shard, through :meth:`IndexedDatasetBuilder.add_packs`.

Each reader hands the builder runs of packs as flat arrays (``CHUNK_TOKENS`` tokens at a
time), so every invariant is checked in numba and the shard is published atomically by
the builder. What each source keeps in memory:

* legacy ``.npy`` and packed Parquet: parsed by :func:`megatron_sft_idx.open.open_packed`
  (the one place their rules live: the restricted unpickler, the column checks, any
  normalisation of Bridge's quirks), one file at a time -- the ``.npy`` is one pickle, and
  the factory reads a Parquet file whole, as Bridge does;
* the RFC's Option A directory: memory maps, ``CHUNK_TOKENS`` at a time;
* upstream pretrain ``.bin/.idx``: memory maps plus ~36 bytes per document for the
  packing plan (each document becomes one sequence, loss on every position but its last,
  label-aligned; packed by :func:`megatron_sft_idx.packing.pack_lengths`).
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Dict, Iterator, Optional, Sequence

import numpy as np

from .. import _kernels, legacy
from .._extras import require_extra
from ..builder import IndexedDatasetBuilder
from ..errors import FormatError, InvariantError, ShardError
from ..format import Rule
from ..jsondoc import load_json, parse_json
from ..packing.fill import fill_sequences
from ..reader import MMapIndexedDataset

#: Tokens handed to the builder per run of packs.
CHUNK_TOKENS = 1 << 24
OPTION_A_FORMAT = "memmap_padded_v1"
_OPTION_A_ARRAYS = ("input_ids", "loss_mask", "packed_len", "seq_offsets", "seq_starts")


def _runs(token_offsets: np.ndarray) -> Iterator[tuple]:
    """``(first, last)`` pack ranges of about ``CHUNK_TOKENS`` tokens (at least one pack each)."""
    n = token_offsets.size - 1
    first = 0
    while first < n:
        last = int(np.searchsorted(token_offsets, token_offsets[first] + CHUNK_TOKENS, side="right")) - 1
        last = min(max(last, first + 1), n)
        yield first, last
        first = last


def add_flat_source(builder: IndexedDatasetBuilder, src, label: str, first_pack: int = 0) -> int:
    """Every pack of a :class:`~megatron_sft_idx.packed.FlatPackedSource`, in runs."""
    t_off, s_off = src.token_offsets, src.seq_offsets
    for a, b in _runs(t_off):
        t0, t1, s0, s1 = int(t_off[a]), int(t_off[b]), int(s_off[a]), int(s_off[b])
        builder.add_packs(src.tokens[t0:t1], src.loss_mask[t0:t1], src.seq_starts[s0:s1],
                          t_off[a:b + 1] - t0, s_off[a:b + 1] - s0, source=label, first_pack=first_pack + a)
    return len(src)


# --------------------------------------------------------------------------- Option A


def read_option_a_manifest(directory: str) -> Dict[str, Any]:
    """The Option A directory's ``manifest.json``, checked for the fields this reader needs.

    Raises:
        FormatError: missing, unparsable, or not ``memmap_padded_v1``.
    """
    path = os.path.join(directory, "manifest.json")
    try:
        manifest = load_json(path, FormatError, what="Option A manifest")
    except OSError as exc:
        raise FormatError(f"cannot read the Option A manifest ({exc})", path=path, field="manifest.json") from None
    if not isinstance(manifest, dict) or manifest.get("format") != OPTION_A_FORMAT:
        raise FormatError("not an RFC Option A (padded memmap) directory", path=path, field="format",
                          expected=OPTION_A_FORMAT, actual=manifest.get("format") if isinstance(manifest, dict) else None)
    for key in ("num_bins", "pack_size"):
        if isinstance(manifest.get(key), bool) or not isinstance(manifest.get(key), int) or manifest[key] <= 0:
            raise FormatError(f"manifest field '{key}' must be a positive integer", path=path, field=key,
                              actual=manifest.get(key))
    return manifest


def _load_option_a(directory: str, manifest: dict) -> Dict[str, np.ndarray]:
    arrays, n, size = {}, manifest["num_bins"], manifest["pack_size"]
    for name in _OPTION_A_ARRAYS:
        path = os.path.join(directory, f"{name}.npy")
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise FormatError(f"cannot map the array ({exc})", path=path, field=name) from None
        if arrays[name].dtype.kind not in "iub":
            raise FormatError("array must hold integers", path=path, field=name, actual=str(arrays[name].dtype))
    expected = {"input_ids": (n, size), "loss_mask": (n, size), "packed_len": (n,), "seq_offsets": (n + 1,)}
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise FormatError("array shape disagrees with the manifest", path=os.path.join(directory, f"{name}.npy"),
                              field=name, expected=shape, actual=arrays[name].shape)
    offsets, lengths = np.asarray(arrays["seq_offsets"], dtype=np.int64), np.asarray(arrays["packed_len"])
    bad = np.flatnonzero(np.diff(offsets) <= 0)
    if offsets[0] != 0 or bad.size or offsets[-1] != arrays["seq_starts"].shape[0]:
        raise InvariantError("seq_offsets must rise from 0 to len(seq_starts), one or more per bin",
                             path=os.path.join(directory, "seq_offsets.npy"), field="seq_offsets",
                             pack=int(bad[0]) if bad.size else 0)
    over = np.flatnonzero((lengths > size) | (lengths <= 0))
    if over.size:  # checked before slicing: a longer length would silently cut a pack
        i = int(over[0])
        rule = Rule.PACK_TOO_LONG if lengths[i] > size else Rule.PACK_EMPTY
        raise InvariantError(f"bin {i} breaks an invariant: {rule.describe}", path=os.path.join(directory, "packed_len.npy"),
                             pack=i, field="packed_len", rule=rule.name, expected=f"1..{size}", actual=int(lengths[i]))
    arrays["seq_offsets"] = offsets
    return arrays


def add_option_a(builder: IndexedDatasetBuilder, directory: str, manifest: dict) -> int:
    """Every bin of an Option A directory, its padding dropped, a run of bins at a time."""
    arrays = _load_option_a(directory, manifest)
    n, size = manifest["num_bins"], manifest["pack_size"]
    lengths, offsets = arrays["packed_len"], arrays["seq_offsets"]
    step = max(1, CHUNK_TOKENS // size)
    columns = np.arange(size)
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        length = np.asarray(lengths[b0:b1], dtype=np.int64)
        keep = columns[None, :] < length[:, None]
        token_offsets = np.concatenate(([0], np.cumsum(length)))
        s0, s1 = int(offsets[b0]), int(offsets[b1])
        builder.add_packs(np.asarray(arrays["input_ids"][b0:b1])[keep], np.asarray(arrays["loss_mask"][b0:b1])[keep],
                          arrays["seq_starts"][s0:s1], token_offsets, offsets[b0:b1 + 1] - s0,
                          source=directory, first_pack=b0)
    return n


# --------------------------------------------------------------------------- upstream pretrain


def plan_documents(src: MMapIndexedDataset, pack_size: int, overlong: str) -> Dict[str, Any]:
    """Each document's first token and length (documents of upstream's ``document_indices``),
    after dropping empty documents and applying ``overlong`` (``error|truncate|drop``).

    Raises:
        InvariantError: the index is not contiguous, or (``overlong="error"``) a document is
            longer than ``pack_size``.
    """
    arrays = src.arrays()
    itemsize = src.dtype.itemsize
    bad, _ = _kernels.first_pointer_mismatch(arrays.sequence_lengths, arrays.sequence_pointers, itemsize,
                                              src.num_tokens * itemsize)
    docs = np.asarray(src.document_indices, dtype=np.int64)
    if bad >= 0 or _kernels.first_document_mismatch(docs, len(src), False) >= 0:
        raise InvariantError("the pretrain index is not contiguous (pointers or document indices)",
                             path=src.paths.idx, pack=max(int(bad), 0), field="sequence_pointers/document_indices",
                             hint="check it with check-idx --allow-pretrain")
    token_at = np.zeros(len(src) + 1, dtype=np.int64)
    np.cumsum(arrays.sequence_lengths, out=token_at[1:])
    first, length = token_at[docs[:-1]], token_at[docs[1:]] - token_at[docs[:-1]]
    counts = {"documents": int(length.size), "empty_dropped": int((length == 0).sum()), "truncated": 0,
              "overlong_dropped": 0}
    keep = length > 0
    too_long = length > pack_size
    if too_long.any():
        if overlong == "error":
            d = int(np.flatnonzero(too_long)[0])
            raise InvariantError(f"document {d} has {int(length[d])} tokens, more than the pack size {pack_size}",
                                 path=src.prefix, field="document", rule=Rule.PACK_TOO_LONG.name,
                                 expected=f"<= {pack_size}", actual=int(length[d]),
                                 hint="pass --overlong truncate or --overlong drop, or a larger --pack-size")
        if overlong == "drop":
            counts["overlong_dropped"] = int(too_long.sum())
            keep &= ~too_long
        else:
            counts["truncated"] = int(too_long.sum())
    return {"first": first[keep], "full": length[keep], "copy": np.minimum(length[keep], pack_size),
            "counts": counts}


def add_pretrain(builder: IndexedDatasetBuilder, src: MMapIndexedDataset, plan: Dict[str, Any],
                 assignment) -> int:
    """Materialize the packing of ``plan``'s documents, a run of packs at a time."""
    if hasattr(mmap, "MADV_RANDOM"):  # packs gather documents from all over the file
        src.advise(mmap.MADV_RANDOM)
    tokens = src.arrays().tokens
    ones = np.broadcast_to(np.uint8(1), tokens.shape)  # loss on every token; ends zeroed below
    pack_ends = np.concatenate(([0], np.cumsum(assignment.loads)))
    n = assignment.n_bins
    for b0, b1 in _runs(pack_ends):
        members = assignment.items[assignment.offsets[b0]:assignment.offsets[b1]]
        copy = plan["copy"][members]
        dst = np.concatenate(([0], np.cumsum(copy)))
        total = int(dst[-1])
        out_ids = np.empty(total, dtype=tokens.dtype)
        out_mask = np.empty(total, dtype=np.uint8)
        fill_sequences(out_ids, out_mask, dst[:-1], tokens, ones, plan["first"][members], copy, plan["full"][members])
        out_mask[dst[1:] - 1] = 0  # label-aligned: nothing to predict after a sequence's last token
        seq_offsets = assignment.offsets[b0:b1 + 1] - assignment.offsets[b0]
        token_offsets = pack_ends[b0:b1 + 1] - pack_ends[b0]
        pack_of_seq = np.repeat(np.arange(b1 - b0), np.diff(seq_offsets))
        starts = dst[:-1] - token_offsets[pack_of_seq]
        builder.add_packs(out_ids, out_mask, starts, token_offsets, seq_offsets, source=src.prefix, first_pack=b0)
        src.release_pages()
    return n


def parquet_files(path: str) -> Sequence[str]:
    """The Parquet files ``path`` names, by the dispatcher's own rule (file, directory, glob)."""
    return legacy.parquet_files(path)


def read_parquet_shard_metadata(path: str, key: bytes) -> Optional[dict]:
    """Our shard metadata, when this Parquet file was written by ``convert-packed --to parquet``."""
    require_extra("train", "pyarrow")  # the factory's reader names the same extra
    import pyarrow.parquet as pq

    try:
        raw = (pq.read_schema(path).metadata or {}).get(key)
    except (OSError, ValueError) as exc:
        raise ShardError(f"cannot read the Parquet schema ({exc})", path=path, field="schema") from None
    if raw is None:
        return None
    try:
        meta = parse_json(raw, path, error=FormatError, limit_error=None)
    except FormatError:
        raise FormatError("the file's megatron_sft_idx metadata is not JSON", path=path, field=key.decode()) from None
    return meta if isinstance(meta, dict) else None
