"""Fuzz the reader: any mutation of any of the five files raises only the project's errors.

A valid shard is mutated (bytes flipped, files cut short or extended, header
fields set to edge values with the header CRC recomputed so the deeper checks
are reached, a file swapped in from another shard), then opened and every pack
read (indexing, slices, windows, whole-shard views, pickling). Reading garbage
*values* that pass the structural checks is allowed; with ``check_packs=True``
every pack handed out must satisfy the invariants (checked here independently).
"""

import os
import pickle
import re
import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import InvariantError, ShardError
from megatron_sft_idx.format import ALL_SUFFIXES, IDX_HEADER, SEQ_IDX_HEADER
from support.refusals import concerns
from support.shardgen import random_packs, write_shard

CASES = int(os.environ.get("FUZZ_CASES", 400))
PACK_SIZE = 24
VOCAB = 300
EDGE_VALUES = (0, 1, 2, 3, 7, 8, 63, 64, 65, 255, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1, 2 ** 64 - 1)


def _field_offsets(struct_format):
    """(offset, code) of every numeric field of a little-endian struct."""
    out, before = [], "<"
    for count, code in re.findall(r"(\d*)([a-zA-Z])", struct_format.lstrip("<")):
        if code != "s":
            out.append((struct.calcsize(before), code))
        before += count + code
    return out


IDX_FIELDS = _field_offsets(IDX_HEADER.format)
SEQ_IDX_FIELDS = [f for f in _field_offsets(SEQ_IDX_HEADER.format) if f[0] < 60]  # not the header CRC


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(99)
    write_shard(str(root / "good"), random_packs(rng, 6, pack_size=PACK_SIZE, vocab=VOCAB, max_seqs=4),
                pack_size=PACK_SIZE, vocab_size=VOCAB, metadata={"pad_seq_to_mult": 1})
    write_shard(str(root / "other"), random_packs(rng, 6, pack_size=64, vocab=VOCAB, full=True),
                pack_size=64, dtype=np.int32)
    files = {s: (root / ("good" + s)).read_bytes() for s in ALL_SUFFIXES}
    others = {s: (root / ("other" + s)).read_bytes() for s in ALL_SUFFIXES}
    return files, others


def set_field(raw, offset, code, value, fix_crc):
    b = bytearray(raw)
    size = struct.calcsize("<" + code)
    struct.pack_into("<" + code, b, offset, value % (1 << (8 * size)))
    if fix_crc:
        struct.pack_into("<I", b, 60, zlib.crc32(bytes(b[:60])))
    return bytes(b)


def mutate(files, others, rng):
    """One random mutation; returns the new file set and a description for failure messages."""
    files = dict(files)
    suffix = ALL_SUFFIXES[int(rng.integers(len(ALL_SUFFIXES)))]
    raw = files[suffix]
    kind = int(rng.integers(8))
    if kind == 0 and raw:
        b = bytearray(raw)
        for pos in rng.integers(0, len(b), int(rng.integers(1, 5))):
            b[pos] = int(rng.integers(256))
        files[suffix], what = bytes(b), "flip"
    elif kind == 1:
        files[suffix], what = raw[:int(rng.integers(0, max(len(raw), 1)))], "truncate"
    elif kind == 2:
        files[suffix], what = raw + rng.bytes(int(rng.integers(1, 100))), "extend"
    elif kind == 3:
        suffix = ".idx"
        offset, code = IDX_FIELDS[int(rng.integers(len(IDX_FIELDS)))]
        value = EDGE_VALUES[int(rng.integers(len(EDGE_VALUES)))]
        files[suffix], what = set_field(files[suffix], offset, code, value, False), f"idx field @{offset}={value}"
    elif kind == 4:
        suffix = ".seq.idx"
        offset, code = SEQ_IDX_FIELDS[int(rng.integers(len(SEQ_IDX_FIELDS)))]
        value = EDGE_VALUES[int(rng.integers(len(EDGE_VALUES)))]
        files[suffix], what = set_field(files[suffix], offset, code, value, True), f"seq.idx field @{offset}={value}"
    elif kind == 5:
        files[suffix], what = others[suffix], "swap"
    elif kind == 6:
        del files[suffix]
        what = "delete"
    else:  # upstream pretrain data: only .bin/.idx, then a flip in either
        for sft in (".loss.bin", ".seq.idx", ".seq.bin"):
            del files[sft]
        suffix = (".bin", ".idx")[int(rng.integers(2))]
        b = bytearray(files[suffix])
        b[int(rng.integers(len(b)))] = int(rng.integers(256))
        files[suffix], what = bytes(b), "pretrain flip"
    return files, f"{what} {suffix}"


def valid_pack(pack, m):
    """The pack invariants, checked here without the project's kernels."""
    ids, loss, starts = (np.asarray(a, np.int64) for a in pack)
    n = len(ids)
    if n == 0 or (m.pack_size and n > m.pack_size) or len(loss) != n:
        return False
    if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n:
        return False
    ends = np.append(starts[1:], n)
    if np.any((loss != 0) & (loss != 1)) or np.any(loss[ends - 1] != 0):
        return False
    if np.any((ends - starts) % m.pad_seq_to_mult):
        return False
    return bool(ids.min() >= 0 and (not m.vocab_size or ids.max() < m.vocab_size))


def exercise(prefix, check_packs):
    ds = MMapIndexedDataset(prefix, check_packs=check_packs)
    n = len(ds)
    for i in range(n):
        pack = ds[i]
        if check_packs and not ds.is_pretrain:
            assert valid_pack(pack, ds.metadata), f"pack {i} breaks an invariant but was returned"
        pack.seq_boundaries
        pack.as_dict()
        length = pack.packed_len
        if length:
            ds.get(i, length // 2)
            ds.get(i, 0, 1)
    ds[0:n]
    ds[-1]
    ds.sequence_lengths, ds.sequence_pointers, ds.document_indices, ds.seq_offsets
    ds.arrays()
    pickle.loads(pickle.dumps(ds))


@pytest.mark.slow
def test_mutated_shards_raise_only_shard_errors(tmp_path, pristine):
    files, others = pristine
    rng = np.random.default_rng(20240611)
    prefix = str(tmp_path / "s")
    outcomes = {"error": 0, "read": 0, "caught_by_check_packs": 0}
    for case in range(CASES):
        mutated, what = mutate(files, others, rng)
        for suffix in ALL_SUFFIXES:
            if suffix in mutated:
                with open(prefix + suffix, "wb") as f:
                    f.write(mutated[suffix])
            elif os.path.exists(prefix + suffix):
                os.unlink(prefix + suffix)
        read_unchecked = False
        for check_packs in (False, True):
            try:
                exercise(prefix, check_packs)
                outcomes["read"] += 1
                read_unchecked = True
            except InvariantError as exc:
                concerns(exc, prefix, *(prefix + s for s in ALL_SUFFIXES))
                outcomes["error"] += 1
                outcomes["caught_by_check_packs"] += check_packs and read_unchecked
            except ShardError as exc:   # by its class and the file it concerns: one of the shard's
                concerns(exc, prefix, *(prefix + s for s in ALL_SUFFIXES))
                outcomes["error"] += 1
            except Exception as exc:  # anything else is a bug: report the case that made it
                raise AssertionError(f"case {case} ({what}), check_packs={check_packs}: "
                                     f"{type(exc).__name__}: {exc}") from exc
    # Every kind of outcome happened: the fuzzer reaches past the open-time checks, and some
    # mutations only the per-pack invariant check (check_packs=True) could see.
    assert outcomes["error"] > CASES // 4 and outcomes["read"] > CASES // 10, outcomes
    assert outcomes["caught_by_check_packs"] > 0, outcomes


def test_pristine_shard_reads_cleanly(tmp_path, pristine):
    files, _ = pristine
    prefix = str(tmp_path / "s")
    for suffix, raw in files.items():
        with open(prefix + suffix, "wb") as f:
            f.write(raw)
    exercise(prefix, check_packs=True)
