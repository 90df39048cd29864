"""The packed formats before this one, read whole into memory: Megatron-Bridge's legacy ``.npy``
and packed Parquet, each as a :class:`~megatron_sft_idx.packed.FlatPackedSource`.

* Megatron-Bridge's legacy packed ``.npy`` (an object array of dicts with
  ``input_ids``, ``loss_mask``, ``seq_start_id``), read through a restricted
  unpickler;
* packed Parquet (a file, a directory of ``*.parquet`` or a glob) with columns
  ``input_ids`` list<int32>, ``loss_mask`` list<int8>, ``seq_start_id`` list<int32>.

:func:`megatron_sft_idx.open.open_packed` decides when a path is one of these. Both load
the whole file into memory (as Bridge does); only our shards are memory-mapped.

The legacy ``.npy`` is a pickle. :class:`RestrictedUnpickler` admits only the
numpy globals that rebuild an array (``_reconstruct``, ``ndarray``, ``dtype``);
everything else (``os.system``, ``builtins.eval``, any class) is refused with a
:class:`ShardError` before it is called. Lists, dicts, ints and bools need no
globals at all. The loaded object is then checked for exactly the expected shape.

**Loss masks as Bridge wrote them.** Reading (and ``convert-packed``) keeps Bridge's stored
mask on every position a consumer reads; only each sequence's last position, which no
consumer reads (Bridge's collate reads ``[start, end - 1)``; the label-aligned format requires
0 there), is set to 0. Which stored positions train is the consumer's rule, applied by its
reader (:data:`CONSUMER_LOSS_RULES`): Bridge 0.6's collate zeroes the loss at EOS inputs,
Bridge ``main``'s (the next release) keeps it, as do Megatron-LM's dataset and the TRL adapter.
``eos_id`` applies Bridge 0.6's rule on read, for a reader that needs 0.6's positions baked in.
A converted shard records all this in ``source.converted_from`` (:func:`conversion_record`);
shards converted before this rule carry no ``loss_mask`` entry there and were normalised with
Bridge 0.6's rule when ``--eos-id`` was given (:func:`converted_loss_state`).
"""

from __future__ import annotations

import glob as _glob
import io
import os
import pickle
from typing import List, Optional, Sequence, Union

import numpy as np

from ._extras import require_extra
from .errors import InvariantError, ShardError, ShardNotFoundError
from .format import PAD_LAYOUT_RUNTIME, Rule
from .packed import FlatPackedSource

__all__ = ["load_legacy_npy", "load_parquet", "RestrictedUnpickler", "normalise_bridge_loss", "parquet_files",
           "PARQUET_SUFFIXES", "CONSUMER_LOSS_RULES", "LOSS_AS_WRITTEN", "LOSS_BRIDGE_06", "conversion_record",
           "converted_loss_state", "converted_eos_id", "consumer_loss_counts"]

#: ``source.converted_from.loss_mask`` of a shard converted from Bridge's ``.npy``/Parquet: the
#: stored mask kept on every position a consumer reads.
LOSS_AS_WRITTEN = "as_written"
#: What a converted shard without that entry holds: Bridge 0.6's normalisation applied at
#: conversion (loss 0 at EOS inputs when ``--eos-id`` was given), positions Bridge ``main`` trains lost.
LOSS_BRIDGE_06 = "bridge_0.6_normalised"
#: The loss each consumer trains from a stored label-aligned mask (recorded in converted shards).
CONSUMER_LOSS_RULES = {
    "megatron-lm": "stored mask",
    "megatron-bridge-0.6": "stored mask, 0 at EOS inputs",
    "megatron-bridge-next": "stored mask (answer_only_loss); 0 at EOS inputs otherwise",
    "trl-padding-free": "stored mask",
}


def conversion_record(eos_id: Optional[int]) -> dict:
    """The entries a conversion from Bridge's files adds to ``source.converted_from``."""
    return {"loss_mask": LOSS_AS_WRITTEN, "bridge_eos_id": None if eos_id is None else int(eos_id),
            "consumer_loss_rules": dict(CONSUMER_LOSS_RULES)}


def converted_loss_state(metadata) -> Optional[str]:
    """:data:`LOSS_AS_WRITTEN` or :data:`LOSS_BRIDGE_06` for a shard converted from Bridge's
    ``.npy``/Parquet (by its ``ShardMetadata`` or metadata dict), None for any other shard."""
    source = metadata.get("source") if isinstance(metadata, dict) else getattr(metadata, "source", None)
    record = source.get("converted_from") if isinstance(source, dict) else None
    if not isinstance(record, dict) or record.get("format") not in ("npy", "parquet"):
        return None
    return LOSS_AS_WRITTEN if record.get("loss_mask") == LOSS_AS_WRITTEN else LOSS_BRIDGE_06


def converted_eos_id(metadata) -> Optional[int]:
    """The Bridge EOS id a conversion recorded (``--eos-id``), or None."""
    source = metadata.get("source") if isinstance(metadata, dict) else getattr(metadata, "source", None)
    record = source.get("converted_from") if isinstance(source, dict) else None
    value = record.get("bridge_eos_id") if isinstance(record, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None

_PACK_KEYS = ("input_ids", "loss_mask", "seq_start_id")
PARQUET_SUFFIXES = (".parquet", ".pq")
_RECONSTRUCT = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")})
#: The only globals a pickled numpy array needs (numpy 1.x and 2.x module names).
_ALLOWED_GLOBALS = _RECONSTRUCT | {("numpy", "ndarray"), ("numpy", "dtype")}
_MAX_NDIM = 32


class _CheckedArray(np.ndarray):
    """What the restricted unpickler builds for a pickled array: its ``__setstate__`` checks
    that the state's shape and dtype describe exactly the data the pickle holds *before*
    numpy allocates, so a few bytes cannot declare gigabytes (issue: memory before refusal)."""

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError("array state is not numpy's")
        shape, dtype, _fortran, data = state[-4:]
        if (not isinstance(shape, tuple) or len(shape) > _MAX_NDIM
                or not all(type(d) is int and d >= 0 for d in shape) or not isinstance(dtype, np.dtype)):
            raise pickle.UnpicklingError("array state: bad shape or dtype")
        count = 1
        for d in shape:
            count *= d
        if dtype.hasobject:
            ok = isinstance(dtype, np.dtype) and dtype == np.dtype(object) and isinstance(data, list) \
                and len(data) == count
        else:
            ok = isinstance(data, (bytes, bytearray)) and len(data) == count * dtype.itemsize
        if not ok:
            raise pickle.UnpicklingError("array state: the data present does not match the declared shape")
        super().__setstate__(state)


def _checked_reconstruct(subtype, shape, dtype):
    """numpy's ``_reconstruct`` as numpy's own pickles call it: an empty ndarray, filled by BUILD."""
    if subtype is not np.ndarray or not isinstance(shape, tuple) or \
            not all(type(d) is int and d >= 0 for d in shape) or 0 not in shape:
        raise pickle.UnpicklingError("array rebuild with a non-empty shape or a subclass")
    return np.ndarray.__new__(_CheckedArray, (0,), np.uint8)


# --------------------------------------------------------------------------- legacy .npy


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals needed to rebuild numpy arrays.

    Raises:
        ShardError: on any other global (functions, classes, modules).
    """

    source = "<pickle>"

    def find_class(self, module: str, name: str):
        if (module, name) in _RECONSTRUCT:
            return _checked_reconstruct
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise ShardError(f"refusing to load global {module}.{name} from a pickle", path=self.source,
                         field="pickle", expected="lists, dicts, ints and numpy arrays only",
                         actual=f"{module}.{name}",
                         hint="this file is not a plain packed dataset; do not load it, or "
                              "convert it with the producer you trust")


def _restricted_loads(stream, source: str):
    unpickler = RestrictedUnpickler(stream)
    unpickler.source = source
    try:
        return unpickler.load()
    except ShardError:
        raise
    except Exception as exc:  # a malformed or hostile pickle must not surface as a raw traceback
        raise ShardError(f"the pickle payload is malformed ({type(exc).__name__}: {exc})",
                         path=source, field="pickle",
                         hint="the .npy was cut short or is not a packed dataset") from None


def _read_npy_object_array(path: str) -> np.ndarray:
    """Parse the ``.npy`` header ourselves; unpickle the payload with the restricted unpickler."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except ValueError as exc:
            raise ShardError(f"not a readable .npy file ({exc})", path=path, field="header") from None
        if dtype != np.dtype(object) or len(shape) != 1:
            raise ShardError("a legacy packed .npy holds a 1-D object array of dicts", path=path,
                             field="dtype/shape", expected="object, 1-D",
                             actual=f"{dtype}, shape {shape}")
        payload = f.read()
    from ._pickle_scan import first_bad_opcode   # (start-up: numba, for a legacy .npy only)

    bad = first_bad_opcode(payload)
    if bad is not None:  # checked before unpickling: CPython allocates declared lengths up front
        raise ShardError(f"the pickle payload is malformed: {bad[1]}", path=path, field="pickle",
                         actual=f"payload offset {bad[0]}",
                         hint="the .npy was cut short or is not a packed dataset; do not load it")
    array = _restricted_loads(io.BytesIO(payload), path)
    if isinstance(array, np.ndarray):
        array = array.view(np.ndarray)
    if not isinstance(array, np.ndarray) or array.dtype != object or array.shape != tuple(shape):
        raise ShardError("the pickle payload is not the object array its header announces",
                         path=path, field="payload", expected=f"object array of shape {shape}",
                         actual=type(array).__name__)
    return array, len(payload)


def _declared_len(value) -> int:
    if isinstance(value, list):
        return len(value)
    return int(value.size) if isinstance(value, np.ndarray) else 0


def _int_values(value, path: str, pack: int, key: str) -> np.ndarray:
    """One pack field as a 1-D int64 array (lists of ints/bools or integer/bool arrays only)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "biu":
            raise ShardError("field must be a 1-D integer array", path=path, pack=pack, field=key,
                             actual=f"{value.dtype} shape {value.shape}")
        return value.astype(np.int64, copy=False)
    if not isinstance(value, list):
        raise ShardError("field must be a list of ints", path=path, pack=pack, field=key,
                         actual=type(value).__name__)
    kinds = set(map(type, value))  # checked before numpy sees it: a nested list is never expanded
    if not kinds <= {int, bool}:
        raise ShardError("field must be a flat list of ints", path=path, pack=pack, field=key,
                         actual=sorted(k.__name__ for k in kinds - {int, bool})[:4])
    try:
        return np.fromiter(value, dtype=np.int64, count=len(value))
    except OverflowError:
        raise ShardError("field must be a flat list of ints (each fitting int64)", path=path, pack=pack,
                         field=key) from None


def load_legacy_npy(path, *, pad_seq_to_mult: int = 1, pad_layout: str = PAD_LAYOUT_RUNTIME,
                    eos_id: Optional[int] = None) -> FlatPackedSource:
    """Read Megatron-Bridge's legacy packed ``.npy`` without executing arbitrary pickle code.

    Raises:
        ShardError: the file is not a plain object array of ``{input_ids, loss_mask,
            seq_start_id}`` dicts, or the pickle names a global other than numpy's array
            rebuilders; InvariantError: a pack breaks a format invariant.
    """
    path = os.fspath(path)
    array, payload_bytes = _read_npy_object_array(path)
    if array.shape[0] == 0:
        raise ShardError("the packed dataset is empty", path=path, field="packs")
    fields = {k: [] for k in _PACK_KEYS}
    declared = 0
    # One Python step per pack is inherent: the legacy format *is* a Python object per pack.
    for i, item in enumerate(array):
        if not isinstance(item, dict) or len(item) != len(_PACK_KEYS) or \
                not all(isinstance(k, str) and k in item for k in _PACK_KEYS):
            raise ShardError("every element must be a dict with exactly the packed keys", path=path,
                             pack=i, field="keys", expected=sorted(_PACK_KEYS),
                             actual=type(item).__name__ if not isinstance(item, dict) else f"{len(item)} keys")
        # Every value the pickle holds costs it at least a byte, unless one object is referenced
        # many times: bound the expansion by the file before converting anything.
        declared += sum(_declared_len(item[k]) for k in _PACK_KEYS)
        if declared > payload_bytes:
            raise ShardError("the pickle declares more values than it holds bytes (shared references)",
                             path=path, pack=i, field="payload", expected=f"<= {payload_bytes} values",
                             hint="this is not a file Megatron-Bridge's packer writes; do not load it")
        for key in _PACK_KEYS:
            fields[key].append(_int_values(item[key], path, i, key))
    return _flat_from_lists(fields, path, pad_seq_to_mult, pad_layout, eos_id)


def _flat_from_lists(fields, path: str, pad_seq_to_mult: int, pad_layout: str,
                     eos_id: Optional[int]) -> FlatPackedSource:
    ids, loss, starts = fields["input_ids"], fields["loss_mask"], fields["seq_start_id"]
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))
    loss_lengths = np.fromiter((a.shape[0] for a in loss), dtype=np.int64, count=len(loss))
    if not np.array_equal(lengths, loss_lengths):
        pack = int(np.flatnonzero(lengths != loss_lengths)[0])
        raise InvariantError(f"pack {pack} breaks an invariant: {Rule.LENGTH_MISMATCH.describe}",
                             path=path, pack=pack, field="loss_mask", rule=Rule.LENGTH_MISMATCH.name,
                             expected=int(lengths[pack]), actual=int(loss_lengths[pack]))
    counts = np.fromiter((a.shape[0] for a in starts), dtype=np.int64, count=len(starts))
    tokens = _narrow_tokens(np.concatenate(ids))
    token_off = np.concatenate(([0], np.cumsum(lengths)))
    seq_off = np.concatenate(([0], np.cumsum(counts)))
    seq_starts = np.concatenate(starts)
    loss = normalise_bridge_loss(np.concatenate(loss), tokens, seq_starts, token_off, seq_off, eos_id)
    return FlatPackedSource(tokens, loss, seq_starts, token_off, seq_off, path=path,
                            pad_seq_to_mult=pad_seq_to_mult, pad_layout=pad_layout)


def normalise_bridge_loss(loss, tokens, seq_starts, token_offsets, seq_offsets,
                          eos_id: Optional[int] = None) -> np.ndarray:
    """Bridge's loss mask with each sequence's last position set to 0 (a copy): no consumer
    reads it (Bridge's collate reads ``[start, end - 1)``). With ``eos_id``, also Bridge 0.6's
    rule: 0 at every EOS input (Bridge 0.6's collate zeroes them; ``main``'s trains them).
    Malformed sequence starts are left alone here; the invariant scan names them.
    """
    loss = np.array(loss, dtype=np.int64)
    seq_starts = np.asarray(seq_starts, dtype=np.int64)
    counts = np.diff(np.asarray(seq_offsets, dtype=np.int64))
    pack_len = np.diff(np.asarray(token_offsets, dtype=np.int64))
    if counts.size and counts.min() >= 0 and seq_starts.shape[0] == int(counts.sum()):
        pack_of = np.repeat(np.arange(counts.shape[0]), counts)
        is_last = np.zeros(seq_starts.shape[0], dtype=bool)
        is_last[np.cumsum(counts)[counts > 0] - 1] = True  # each pack's last sequence ends the pack
        end = np.where(is_last, pack_len[pack_of], np.append(seq_starts[1:], 0))
        ok = (seq_starts >= 0) & (end > seq_starts) & (end <= pack_len[pack_of])
        loss[(np.asarray(token_offsets)[pack_of] + end - 1)[ok]] = 0
    if eos_id is not None and loss.shape == np.shape(tokens):
        loss[np.asarray(tokens) == eos_id] = 0
    return loss


def _narrow_tokens(tokens: np.ndarray) -> np.ndarray:
    """Keep tokens in int32 (ids never need more); refuse what does not fit."""
    if tokens.size and (tokens.max() > np.iinfo(np.int32).max):
        raise ShardError("token id does not fit int32", field="input_ids", actual=int(tokens.max()))
    return tokens.astype(np.int32)


# --------------------------------------------------------------------------- Parquet


#: The range each packed-Parquet column's values must fit: the dtype they are stored in.
_PARQUET_RANGES = {"input_ids": (0, np.iinfo(np.int32).max), "loss_mask": (0, np.iinfo(np.uint8).max),
                   "seq_start_id": (np.iinfo(np.int32).min, np.iinfo(np.int32).max)}


def _refuse_unfit_values(column, path: str, key: str) -> None:
    """Refuse a null inside a list (numpy would make it 0, or wrap its NaN) and a value outside
    the range of the dtype the column is stored in (it would wrap), naming the file, the row and
    the column.

    Raises:
        ShardError: the first such value (``pack`` is its row: one pack per row).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return  # (refused with the column's type below)
    low, high = _PARQUET_RANGES[key]
    first_row = 0
    for chunk in column.chunks:
        flat = pc.list_flatten(chunk)
        bad, why = None, ""
        if flat.null_count:
            bad, why = pc.index(pc.is_null(flat), True).as_py(), "a null (a missing value, not a number)"
        elif pa.types.is_integer(flat.type) and len(flat):
            values = flat.to_numpy()
            outside = values > high if values.dtype.kind == "u" else (values < low) | (values > high)
            if outside.any():
                bad = int(np.argmax(outside))
                why = f"the value {int(values[bad])}, outside [{low}, {high}]"
        if bad is not None:
            row = first_row + pc.list_parent_indices(chunk)[bad].as_py()
            raise ShardError(f"row {row} of column '{key}' holds {why}", path=path, field=key, pack=row,
                             hint="fix the producer of this file or rebuild it")
        first_row += len(chunk)


def parquet_files(path: str) -> List[str]:
    """The Parquet files ``path`` names (a file, a directory of them, or a glob), sorted."""
    if os.path.isfile(path):
        return [path] if path.endswith(PARQUET_SUFFIXES) else []
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        return [os.path.join(path, n) for n in names if n.endswith(PARQUET_SUFFIXES)]
    if _glob.has_magic(path):
        return sorted(p for p in _glob.glob(path) if p.endswith(PARQUET_SUFFIXES))
    return []


def load_parquet(files: Union[str, Sequence[str]], *, path: Optional[str] = None,
                 pad_seq_to_mult: int = 1, pad_layout: str = PAD_LAYOUT_RUNTIME,
                 eos_id: Optional[int] = None) -> FlatPackedSource:
    """Read packed Parquet (``input_ids``, ``loss_mask``, ``seq_start_id`` list columns).

    Rows of all files, in sorted file order, become packs in that order.

    Raises:
        ShardError: a column is missing or not a list of integers.
    """
    require_extra("train", "pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [files] if isinstance(files, str) else list(files)
    label = path or (files[0] if files else "<parquet>")
    if not files:
        raise ShardNotFoundError("no Parquet files", path=label)
    columns = {k: [] for k in _PACK_KEYS}
    for name in files:
        try:
            table = pq.read_table(name, columns=list(_PACK_KEYS))
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise ShardError(f"cannot read packed Parquet ({exc})", path=name, field="columns",
                             expected=list(_PACK_KEYS)) from None
        for key in _PACK_KEYS:
            _refuse_unfit_values(table.column(key), name, key)
            columns[key].append(table.column(key))
    flat = {}
    for key in _PACK_KEYS:
        arr = pa.chunked_array([c for col in columns[key] for c in col.chunks]).combine_chunks()
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) or \
                not pa.types.is_integer(arr.type.value_type) and not pa.types.is_boolean(arr.type.value_type):
            raise ShardError("column must be a list of integers", path=label, field=key,
                             actual=str(arr.type))
        if arr.null_count:
            raise ShardError("column holds null rows", path=label, field=key, actual=arr.null_count)
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
        flat[key] = (np.asarray(values.to_numpy(zero_copy_only=False)), offsets - offsets[0])
    ids, id_off = flat["input_ids"]
    loss, loss_off = flat["loss_mask"]
    starts, seq_off = flat["seq_start_id"]
    if id_off.shape[0] <= 1:
        raise ShardError("the packed dataset is empty", path=label, field="packs")
    if not np.array_equal(id_off, loss_off):
        pack = int(np.flatnonzero(np.diff(id_off) != np.diff(loss_off))[0])
        raise InvariantError(f"pack {pack} breaks an invariant: {Rule.LENGTH_MISMATCH.describe}",
                             path=label, pack=pack, field="loss_mask", rule=Rule.LENGTH_MISMATCH.name)
    tokens = _narrow_tokens(ids.astype(np.int64))
    starts = starts.astype(np.int64)
    loss = normalise_bridge_loss(loss.astype(np.int64), tokens, starts, id_off, seq_off, eos_id)
    return FlatPackedSource(tokens, loss, starts, id_off, seq_off, path=label,
                            pad_seq_to_mult=pad_seq_to_mult, pad_layout=pad_layout)


def consumer_loss_counts(tokens, loss, seq_starts, seq_offsets, pack_lengths, *, eos_id: Optional[int] = None,
                         pad_seq_to_mult: int = 1) -> dict:
    """How many positions each consumer trains over a run of consecutive packs (flat arrays).

    ``tokens``/``loss``: the packs' tokens and stored label-aligned mask, concatenated;
    ``seq_starts``: every pack's sequence starts (pack-relative), ``seq_offsets`` their CSR
    offsets (``len(pack_lengths) + 1``, from 0). Returns ``{consumer: count}`` for
    :data:`CONSUMER_LOSS_RULES` (Bridge 0.6's is None without ``eos_id``), plus
    ``eos_inputs_trained`` (stored 1 at a read EOS input: what Bridge 0.6 and main disagree on)
    and ``alignment_padding_trained`` (of those, the ones in a sequence's EOS tail past its last
    real input, with ``pad_seq_to_mult > 1``: context-parallel alignment padding) with
    ``first_alignment_pack`` (run-relative, or None). Vectorised: no Python loop per sequence.
    """
    tokens, stored = np.asarray(tokens), np.asarray(loss) != 0
    lengths = np.asarray(pack_lengths, dtype=np.int64)
    counts = np.diff(np.asarray(seq_offsets, dtype=np.int64))
    pack_base = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    pack_of = np.repeat(np.arange(lengths.shape[0]), counts)
    start = pack_base[pack_of] + np.asarray(seq_starts, dtype=np.int64)
    is_last = np.zeros(start.shape[0], dtype=bool)
    is_last[np.cumsum(counts)[counts > 0] - 1] = True
    end = np.where(is_last, (pack_base + lengths)[pack_of], np.append(start[1:], 0))
    seq_len = end - start
    sid = np.repeat(np.arange(start.shape[0]), seq_len)
    local = np.arange(sid.shape[0], dtype=np.int64) - start[sid]
    read = local < seq_len[sid] - 1  # every consumer reads [start, end - 1)
    trained = stored & read
    out = {"megatron-lm": int(stored.sum()), "megatron-bridge-0.6": None,
           "megatron-bridge-next": int(trained.sum()), "trl-padding-free": int(trained.sum()),
           "eos_inputs_trained": None, "alignment_padding_trained": None, "first_alignment_pack": None}
    if eos_id is None:
        return out
    eos = tokens == eos_id
    out["megatron-bridge-0.6"] = int((trained & ~eos).sum())
    out["eos_inputs_trained"] = int((trained & eos).sum())
    aligned = 0
    if pad_seq_to_mult > 1 and start.shape[0]:
        last_real = np.maximum.reduceat(np.where(read & ~eos, local + 1, 0), start)
        tail = trained & eos & (local >= last_real[sid])
        aligned = int(tail.sum())
        if aligned:
            out["first_alignment_pack"] = int(pack_of[sid[int(np.argmax(tail))]])
    out["alignment_padding_trained"] = aligned
    return out
