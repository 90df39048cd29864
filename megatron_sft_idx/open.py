"""``open_packed(spec)``: the one place that decides what a path or URL opens as.

In this order:

* a list -> :class:`~megatron_sft_idx.multi.MultiShardDataset` over every part;
* an ``s3://`` / ``msc://`` URL: a legacy ``.npy`` or Parquet object is refused (they are
  read whole, from local disk); a manifest, a shard prefix, a "directory" or a glob is
  what :func:`~megatron_sft_idx.multi.select_shards` finds by listing -- one shard opens as
  :class:`~megatron_sft_idx.reader.MMapIndexedDataset` (its source reads blocks), several as a
  :class:`~megatron_sft_idx.multi.MultiShardDataset`;
* a local shard prefix of this format (``P.idx`` exists) -> :class:`MMapIndexedDataset`;
* a manifest (``*.json`` written by :func:`~megatron_sft_idx.publishing.write_manifest`)
  -> :class:`MultiShardDataset`;
* Megatron-Bridge's legacy packed ``.npy``, then packed Parquet (a file, a directory of
  ``*.parquet`` or a glob) -> :class:`~megatron_sft_idx.packed.FlatPackedSource`
  (:mod:`megatron_sft_idx.legacy`);
* a directory of shards or a glob of shard prefixes -> :class:`MultiShardDataset`.

Every result has ``len()``, ``[i] -> Pack`` and a :class:`~megatron_sft_idx.packed.PackSummary`
(``summarize(src)``), so training code does not change when the format does. Sets are
checked before anything is read: the shards agree and form whole sets
(:mod:`megatron_sft_idx.sets`). (Its old name ``megatron_sft_idx.training.factory``
warns once: :mod:`megatron_sft_idx._moved`.)
"""

from __future__ import annotations

import glob as _glob
import os
from typing import Optional

from .errors import ShardError, ShardNotFoundError
from .format import IDX_SUFFIX, PAD_LAYOUT_RUNTIME
from .legacy import PARQUET_SUFFIXES, load_legacy_npy, load_parquet, parquet_files
from .manifest import MANIFEST_SUFFIX, is_manifest
from .multi import MultiShardDataset, select_shards
from .reader import MMapIndexedDataset
from .storage.urls import ObjectURL, is_remote

__all__ = ["open_packed", "records_no_identity"]

_LEGACY_SUFFIXES = (".npy",) + PARQUET_SUFFIXES


def open_packed(path, *, pad_seq_to_mult: Optional[int] = None, pad_layout: str = PAD_LAYOUT_RUNTIME,
                eos_id: Optional[int] = None, check_packs: bool = False):
    """Open packed SFT data in any supported format, local or in object storage.

    Args:
        path: a shard prefix, a manifest ``.json``, a directory, a glob, a list of
            prefixes, a legacy ``.npy`` or packed Parquet (file, directory, glob); a shard
            prefix, manifest, "directory" or glob may be an ``s3://`` / ``msc://`` URL.
        pad_seq_to_mult, pad_layout: for ``.npy``/Parquet, the multiple the producer padded
            sequences to and its layout (Megatron-Bridge's packer: ``"runtime"``); our
            shards record both themselves.
        eos_id: for ``.npy``/Parquet, apply Bridge 0.6's loss rule on read: loss 0 at EOS
            inputs (Bridge 0.6's collate never trains them; Bridge ``main``'s does: without
            ``eos_id`` the mask is kept as Bridge wrote it; docs/FORMAT.md, "Data written by
            Megatron-Bridge"). Each sequence's last position, read by no consumer, is always 0.
        check_packs: check each shard pack's invariants as it is read.

    Raises:
        ShardNotFoundError: nothing at ``path``.
        ShardError: the file is of no known format or is malformed.
    """
    if isinstance(path, (list, tuple)):
        return MultiShardDataset.open(list(path), check_packs=check_packs)
    if is_remote(path):
        return _open_url(path, check_packs)
    path = os.fspath(path)
    if os.path.exists(path + IDX_SUFFIX):
        return MMapIndexedDataset(path, check_packs=check_packs)
    if is_manifest(path):
        return MultiShardDataset.open(path, check_packs=check_packs)
    if path.endswith(".npy") and os.path.isfile(path):
        return load_legacy_npy(path, pad_seq_to_mult=pad_seq_to_mult or 1, pad_layout=pad_layout,
                               eos_id=eos_id)
    parquet = parquet_files(path)
    if parquet:
        return load_parquet(parquet, path=path, pad_seq_to_mult=pad_seq_to_mult or 1, pad_layout=pad_layout,
                            eos_id=eos_id)
    if os.path.isdir(path) or _glob.has_magic(path):
        return MultiShardDataset.open(path, check_packs=check_packs)
    if os.path.exists(path):
        raise ShardError("not a recognised packed format", path=path, field="format",
                         hint="pass a shard prefix (without .idx), a manifest .json, a directory "
                              "of shards, a legacy packed .npy or a packed .parquet")
    raise ShardNotFoundError("nothing at this path", path=path)


def _open_url(spec: str, check_packs: bool):
    """A URL: one shard, or a set (manifest, "directory", glob) found by listing.

    Raises:
        ShardNotFoundError: nothing at the URL; ShardError: a remote file of a kind this
        reader does not stream (``.npy``, Parquet).
    """
    url = ObjectURL.parse(spec)
    if url.key.endswith(_LEGACY_SUFFIXES):
        raise ShardError("remote legacy .npy / Parquet files are not streamed", path=str(url), field="format",
                         hint="convert them to shards (they can then be read from the bucket), or copy "
                              "the file to local disk")
    selection, = select_shards(str(url))
    if selection.kind == "prefix":
        return MMapIndexedDataset(selection.prefixes[0], check_packs=check_packs)
    return MultiShardDataset.open(selection, check_packs=check_packs)


def records_no_identity(path) -> bool:
    """Whether ``open_packed(path)`` gives an in-memory source (legacy ``.npy``, Parquet), which
    records no tokenizer or set to compare with other sources (nothing is read to tell)."""
    if isinstance(path, (list, tuple)) or is_remote(path):
        return False
    path = os.fspath(path)
    if os.path.exists(path + IDX_SUFFIX) or path.endswith(MANIFEST_SUFFIX):
        return False
    return (path.endswith(".npy") and os.path.isfile(path)) or bool(parquet_files(path))
