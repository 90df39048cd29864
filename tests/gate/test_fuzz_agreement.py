"""The Python gate and the native validator agree on the same mutated shards.

Seeded mutations of valid shards of three shapes: raw byte damage (flips, cuts, extensions,
zeroed ranges); damage to a data file followed by a reseal (the recorded sizes and CRCs
updated, so only the structural and semantic checks can decide -- and a mutation may
well leave a valid shard); header fields set to edge values with the header CRC
recomputed; and bytes of the metadata JSON changed (invalid JSON, wrong types, numbers
beyond the limits), resealed. For every shard both implementations must give the same
verdict (pass / fail / unreadable) and the same set of error codes, except the gate's
read-back codes, which have no native counterpart (the native validator has no second
reader to compare with).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import zlib

import numpy as np
import pytest

from support.corrupt import mutate, reseal, seq_fields
from megatron_sft_idx.format import ALL_SUFFIXES, IDX_HEADER, METADATA_OFFSET, SEQ_IDX_HEADER
from megatron_sft_idx.gate import check
from megatron_sft_idx.native import validate
from support.shardgen import random_packs, write_shard

CASES = int(os.environ.get("AGREEMENT_CASES", 240))
#: Codes only the Python gate can report: it reads packs back through MMapIndexedDataset.
PYTHON_ONLY = {"READER_REFUSED", "READBACK_MISMATCH"}
EDGES = (0, 1, 2, 7, 8, 63, 64, 65, 255, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 56, 2 ** 56 + 1, 2 ** 63 - 1,
         2 ** 64 - 1)


def numeric_fields(layout: struct.Struct, below: int):
    """(offset, format code) of each numeric field of a header struct that starts before ``below``."""
    out, offset = [], 0
    for count, code in __import__("re").findall(r"(\d*)([a-zA-Z])", layout.format.lstrip("<")):
        size = struct.calcsize("<" + (count + code if code == "s" else code))
        if code != "s" and offset < below:
            out.append((offset, code))
        offset += size
    return out


IDX_FIELDS = numeric_fields(IDX_HEADER, IDX_HEADER.size)
SEQ_FIELDS = numeric_fields(SEQ_IDX_HEADER, 56)  # not the two CRCs


def set_field(path, offset, code, value, fix_crc):
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        struct.pack_into("<" + code, raw, offset, value % (1 << (8 * struct.calcsize("<" + code))))
        if fix_crc:
            struct.pack_into("<I", raw, 60, zlib.crc32(bytes(raw[:60])))
        f.seek(0)
        f.write(raw)


def mutate_data_sealed(rng, prefix):
    """A few bytes of one data file changed, then the metadata's sizes and CRCs updated."""
    suffix = (".bin", ".loss.bin", ".seq.bin", ".idx")[int(rng.integers(4))]
    path = prefix + suffix
    raw = bytearray(pathlib.Path(path).read_bytes())
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(len(raw)))
        raw[pos] = int(rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, int(rng.integers(256))]))
    pathlib.Path(path).write_bytes(bytes(raw))
    reseal(prefix)
    return f"sealed {suffix}"


def mutate_metadata(rng, prefix):
    raw = pathlib.Path(prefix + ".seq.idx").read_bytes()
    meta = bytearray(raw[METADATA_OFFSET:METADATA_OFFSET + seq_fields(prefix)["metadata_length"]])
    kind = int(rng.integers(3))
    if kind == 0:  # random bytes
        for _ in range(int(rng.integers(1, 4))):
            meta[int(rng.integers(len(meta)))] = int(rng.integers(32, 127))
    elif kind == 1:  # a digit of some number replaced by a long run of digits, or by an exponent
        digits = [i for i, b in enumerate(meta) if chr(b).isdigit()]
        i = digits[int(rng.integers(len(digits)))]
        meta[i:i + 1] = (b"9" * int(rng.integers(15, 30))) if rng.random() < 0.5 else b"1e999"
    else:  # a value replaced by nesting
        obj = json.loads(bytes(meta))
        key = sorted(obj)[int(rng.integers(len(obj)))]
        depth = int(rng.choice([1, 5, 62, 63, 64, 65, 300]))
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        meta = bytearray(text.replace(json.dumps(key) + ":" + json.dumps(obj[key], sort_keys=True,
                                                                           separators=(",", ":")),
                                      json.dumps(key) + ":" + "[" * depth + "]" * depth, 1).encode())
    reseal(prefix, metadata_bytes=bytes(meta))
    return f"metadata kind {kind}"


def mutate_header(rng, prefix):
    if rng.random() < 0.5:
        offset, code = SEQ_FIELDS[int(rng.integers(len(SEQ_FIELDS)))]
        value = int(EDGES[int(rng.integers(len(EDGES)))])
        set_field(prefix + ".seq.idx", offset, code, value, fix_crc=True)
        return f".seq.idx @{offset}={value}"
    offset, code = IDX_FIELDS[int(rng.integers(len(IDX_FIELDS)))]
    value = int(EDGES[int(rng.integers(len(EDGES)))])
    set_field(prefix + ".idx", offset, code, value, fix_crc=False)
    return f".idx @{offset}={value}"


def mutate_sources(rng, prefix):
    """A shard that records sources (format 1.2): a source id or a recorded count changed, resealed;
    elsewhere (no sources) the flag set with nothing behind it."""
    from megatron_sft_idx.format import SeqIdxHeader

    path = prefix + ".seq.idx"
    raw = bytearray(pathlib.Path(path).read_bytes())
    h = SeqIdxHeader.parse(bytes(raw[:64]), path, len(raw))
    if not h.has_sources:
        set_field(path, 15, "B", 1, fix_crc=True)
        return "flag without sources"
    if rng.random() < 0.5:
        j = int(rng.integers(h.sequence_count))
        struct.pack_into("<H", raw, h.sources_offset + 2 * j, int(rng.choice([0, 1, 2, 3, 255, 65535])))
        pathlib.Path(path).write_bytes(bytes(raw))
        reseal(prefix)
        return f"source id {j}"

    def edit(obj):
        obj["sources"][int(rng.integers(len(obj["sources"])))]["sequences"] += int(rng.choice([-1, 1]))
    reseal(prefix, edit=edit)
    return "source count"


MUTATIONS = (lambda rng, p: mutate(rng, p), mutate_data_sealed, mutate_metadata, mutate_header, mutate_sources)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    out = []
    for name, kw in {"u16": dict(vocab_size=1000), "i32": dict(vocab_size=70000, dtype=np.int32),
                     "pad4": dict(vocab_size=1000, metadata={"pad_seq_to_mult": 4})}.items():
        rng = np.random.default_rng(len(name) + 10)
        pad = kw.get("metadata", {}).get("pad_seq_to_mult", 1)
        prefix = str(root / name)
        write_shard(prefix, random_packs(rng, 16, vocab=kw["vocab_size"], pad_mult=pad), **kw)
        out.append(prefix)
    rng = np.random.default_rng(99)   # format 1.2: a shard recording each sequence's source
    packs = [p + (rng.integers(0, 3, p[2].size),) for p in random_packs(rng, 16, vocab=1000)]
    write_shard(str(root / "src"), packs, vocab_size=1000,
                metadata={"sources": [{"name": "a"}, {"name": "b"}, {"name": "c"}]})
    out.append(str(root / "src"))
    return out


def verdict_of_gate(report) -> str:
    return "unreadable" if report.exit_code == 2 else ("pass" if report.passed else "fail")


@pytest.mark.slow
def test_gate_and_native_agree_on_mutated_shards(bases, native_lib, tmp_path):
    rng = np.random.default_rng(77)
    prefix = str(tmp_path / "s")
    seen = {"pass": 0, "fail": 0, "unreadable": 0}
    differ = []
    for case in range(CASES):
        base = bases[case % len(bases)]
        for suffix in ALL_SUFFIXES:
            shutil.copyfile(base + suffix, prefix + suffix)
        what = MUTATIONS[case % len(MUTATIONS)](rng, prefix)
        gate = check(prefix)
        native = validate(prefix, lib_path=native_lib)
        where = f"case {case} ({what})"
        assert verdict_of_gate(gate) == native.verdict, (where, gate.format_text(True), native.findings)
        gate_errors = {f.code for s in gate.shards for f in s.findings if f.severity == "error"}
        native_errors = {f.code for f in native.findings if f.severity == "error"}
        assert "GATE_INTERNAL_ERROR" not in gate_errors and "READER_CRASHED" not in gate_errors, where
        if native.verdict == "fail":
            assert gate_errors & native_errors, (where, gate_errors, native_errors)
        if gate_errors - PYTHON_ONLY != native_errors:
            differ.append((where, sorted(gate_errors - native_errors), sorted(native_errors - gate_errors)))
        seen[native.verdict] += 1
    print(f"{CASES} cases {seen}")
    assert seen["fail"] > CASES // 3 and seen["pass"] > 0, seen
    assert not differ, differ
