"""A sequence store's conversations as one upstream ``.bin/.idx`` pair, one sequence each.

This is the input of Megatron-LM's ``SFTDataset`` from PR #5017 (``megatron/core/datasets/
sft_dataset.py``, open at ``97b2c55e``): an ``IndexedDataset`` whose every *sequence* is one
whole tokenized conversation. That dataset reads nothing else: it packs sequences at run time
(by their ``sequence_lengths``), drops those longer than ``--seq-length``, and derives the loss
mask from chat-template delimiters in the tokens, so no mask, boundary or padding is written.
docs/TRAINING.md ("Megatron-LM #5017") says what it then trains differently from our shards.

Written (``P`` = ``output_prefix``), upstream MMIDIDX version 1 (docs/FORMAT.md's ``P.idx``
table, with ``N`` conversations instead of ``N`` packs):

* ``P.bin``: every conversation's token ids, in store order (store sequence ``g`` is
  sequence ``g``), in the store's token dtype (``uint16``, or ``int32`` if any partition has it);
* ``P.idx``: ``N`` sequences and ``N + 1`` document indices ``[0, 1, ..., N]`` (each
  conversation its own document, as upstream's preprocessing writes one document per record).

Both files are written to temporaries and renamed, ``P.idx`` last, so a reader never sees
a half-written pair under the final names.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from .._atomic import write_file_atomically
from ..errors import ShardError
from ..format import LENGTH_DTYPE, POINTER_DTYPE, DType, IdxHeader
from .store import SequenceStore

#: The consumer named by ``repack-sft --for``.
MEGATRON_LM_5017 = "megatron-lm-5017"
#: Tokens copied per write (elements): bounds memory for partitions of any size.
_CHUNK = 1 << 24


def _token_dtype(store: SequenceStore) -> DType:
    """``int32`` when any partition stores ``int32`` tokens, else ``uint16`` (ids keep their value)."""
    codes = {store.part(k).arrays().tokens.dtype for k in range(len(store.partitions)) if store.part(k) is not None}
    return DType.int32 if np.dtype(np.int32) in codes else DType.uint16


def write_conversations(store_dir: str, output_prefix: str, *, overwrite: bool = False,
                        seq_length: Optional[int] = None) -> dict:
    """Write ``output_prefix.bin/.idx`` from the complete store in ``store_dir`` (verified first).

    Args:
        store_dir: a sequence store kept by ``preprocess-sft --store`` (local, or a URL, which
            is mirrored and verified like any store read).
        output_prefix: the pair's path prefix (no suffix).
        overwrite: replace an existing pair (default: refuse).
        seq_length: when given, also count the conversations longer than it, which #5017's
            packer drops at that ``--seq-length`` (it warns only with their number).

    Returns:
        ``{"conversations", "tokens", "dtype", "store_id", "paths"}``, plus
        ``"longer_than_seq_length"`` (count) and ``"seq_length"`` when ``seq_length`` is given.

    Raises:
        ShardError: no complete store, a partition that does not verify, an existing output
            without ``overwrite``, or an empty store (an ``IndexedDataset`` needs a sequence).
    """
    store = SequenceStore(store_dir)
    store.verify()
    paths = [output_prefix + ".bin", output_prefix + ".idx"]
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise ShardError("the output exists", path=existing[0], hint="give another --output-prefix, or --overwrite")
    dtype = _token_dtype(store)
    lengths = [store.part(k).arrays().sequence_lengths for k in range(len(store.partitions))
               if store.part(k) is not None]
    lengths = np.concatenate(lengths).astype(LENGTH_DTYPE) if lengths else np.empty(0, LENGTH_DTYPE)
    if lengths.size == 0:
        raise ShardError("the sequence store holds no conversation (every record was skipped)",
                         path=store.directory, hint="check its .skips files; a bin/idx needs one sequence")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tokens = _write_bin(store, paths[0], dtype)
    _write_idx(paths[1], dtype, lengths)
    out = {"conversations": int(lengths.size), "tokens": tokens, "dtype": dtype.name,
           "store_id": store.store_id, "paths": paths}
    if seq_length is not None:
        out["seq_length"] = int(seq_length)
        out["longer_than_seq_length"] = int(np.count_nonzero(lengths > seq_length))
    return out


def _write_bin(store: SequenceStore, path: str, dtype: DType) -> int:
    """Every partition's tokens, concatenated in store order, as ``dtype``; returns their count."""
    total = 0

    def write(f) -> None:
        nonlocal total
        for k in range(len(store.partitions)):
            part = store.part(k)
            if part is None:   # every record of the partition was skipped: no shard, no sequence
                continue
            tokens = part.arrays().tokens   # one pack per conversation, contiguous, no padding
            for a in range(0, tokens.size, _CHUNK):
                f.write(np.ascontiguousarray(tokens[a:a + _CHUNK], dtype=dtype.numpy).tobytes())
            total += int(tokens.size)

    write_file_atomically(path, write)
    return total


def _write_idx(path: str, dtype: DType, lengths: np.ndarray) -> None:
    n = int(lengths.size)
    pointers = np.zeros(n, dtype=POINTER_DTYPE)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.numpy.itemsize, out=pointers[1:])
    header = IdxHeader(dtype_code=int(dtype), sequence_count=n, document_count=n + 1)

    def write(f) -> None:
        f.write(header.pack())
        f.write(lengths.astype(LENGTH_DTYPE).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype=POINTER_DTYPE).tobytes())

    write_file_atomically(path, write)
