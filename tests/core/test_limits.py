"""The format's limits (docs/FORMAT.md "Limits"), enforced identically by Python and C++.

Hostile values -- integers beyond int64 or beyond a field's range, thousands of digits,
floats that overflow to infinity, containers nested past the depth limit, strings,
booleans, nulls -- are put into every metadata field (and into unknown keys), one at a
time. For each shard: the limits as FORMAT.md states them (modelled here, independently
of ``metadata.py``) predict refuse or accept and the finding code; the Python reader, the
gate and the native validator must all give that answer, the reader raising only a
ShardError and the gate never an internal error.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.corrupt import reseal, seq_fields
from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_sft_idx import format as fmt
from megatron_sft_idx.errors import MetadataError, MetadataLimitError, ShardError
from megatron_sft_idx.format import ALL_SUFFIXES, METADATA_OFFSET
from megatron_sft_idx.gate import check
from megatron_sft_idx.jsondoc import parse_json
from megatron_sft_idx.native import validate
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
I32, I64 = 2 ** 31 - 1, 2 ** 63 - 1
METADATA_CODES = {"METADATA_UNPARSABLE", "METADATA_INVALID", "METADATA_LIMIT"}

# --------------------------------------------------------------------------- the limits, as documented

DEPTH = 64
INT_FIELDS = {  # dotted path -> (low, high, nullable)
    "pack_size": (1, I32, True), "vocab_size": (1, I32, True), "pad_seq_to_mult": (1, I32, False),
    **{f"stats.{k}": (0, I64, False) for k in (
        "pack_count", "sequence_count", "token_count", "loss_token_count", "max_samples_per_bin",
        "dataset_max_seqlen", "min_seqlen", "min_packed_seqlen", "max_packed_seqlen")},
    "stats.min_packed_runtime_len": (0, I64, True),  # format 1.1
    **{f"files.{s}.size": (0, I64, False) for s in (".bin", ".idx", ".loss.bin", ".seq.bin")},
    **{f"files.{s}.crc32": (0, 2 ** 32 - 1, False) for s in (".bin", ".idx", ".loss.bin", ".seq.bin")},
    "set.count": (1, I32, False), "set.index": (0, I32 - 1, False),  # and index < count (below)
}
#: The base shard's set membership: its index bounds a valid count from below, its count an index from above.
BASE_SET = {"id": "3f9a0c1e2b7d4c55", "name": "train", "index": 1, "count": 3}
SET_TEXT_FIELDS = {"set.id": False, "set.name": True}  # a string of 1..256 UTF-8 bytes; -> nullable
RATIO_FIELDS = {"stats.packing_factor": False, "stats.packing_efficiency": True}  # -> nullable
OBJECT_FIELDS = {"producer": False, "tokenizer": True, "packing": True, "parallelism": True, "source": True,
                 "extra": True, "stats": False, "files": False, "set": True}
STRING_FIELDS = {"pad_layout": ("stored", "runtime"), "token_dtype": ("uint16",)}  # -> accepted values here
FREE_FIELDS = ("zz_unknown", "extra.note", "tokenizer.name", "producer.version", "source.inputs")
ALL_FIELDS = (sorted(INT_FIELDS) + sorted(RATIO_FIELDS) + sorted(OBJECT_FIELDS) + sorted(STRING_FIELDS)
              + sorted(SET_TEXT_FIELDS) + list(FREE_FIELDS))


class Hostile:
    """A JSON literal and what the limits say about it."""

    def __init__(self, text: str, kind: str, value=None, depth: int = 0):
        self.text, self.kind, self.value, self.depth = text, kind, value, depth

    def __repr__(self):
        return f"Hostile({self.text[:60]!r}{'...' if len(self.text) > 60 else ''}, {self.kind})"


def split_field(field: str):
    """Keys of a dotted field name; a file suffix such as '.bin' is one key."""
    if field.startswith("files."):
        rest = field[len("files."):]
        for suffix in fmt.CHECKSUMMED_SUFFIXES:
            if rest == suffix or rest.startswith(suffix + "."):
                return ["files", suffix] + ([rest[len(suffix) + 1:]] if rest != suffix else [])
    return field.split(".")


def expected_code(field: str, h: Hostile):
    """None (accepted), METADATA_LIMIT or METADATA_INVALID, from FORMAT.md's rules."""
    enclosing = len(split_field(field))  # containers around the value, the top-level object included
    if h.kind == "int" and not -2 ** 63 <= h.value <= I64:
        return "METADATA_LIMIT"
    if h.kind == "float" and math.isinf(h.value):
        return "METADATA_LIMIT"
    if h.kind in ("array", "object") and enclosing + h.depth > DEPTH:
        return "METADATA_LIMIT"
    if field in INT_FIELDS:
        low, high, nullable = INT_FIELDS[field]
        if field == "set.count":
            low = max(low, BASE_SET["index"] + 1)
        elif field == "set.index":
            high = min(high, BASE_SET["count"] - 1)
        ok = (h.kind == "int" and low <= h.value <= high) or (h.kind == "null" and nullable)
    elif field in SET_TEXT_FIELDS:
        ok = (h.kind == "str" and 1 <= len(json.loads(h.text).encode("utf-8", "surrogatepass")) <= 256) or \
            (h.kind == "null" and SET_TEXT_FIELDS[field])
    elif field in RATIO_FIELDS:
        ok = h.kind in ("int", "float") or (h.kind == "null" and RATIO_FIELDS[field])
    elif field in STRING_FIELDS:
        ok = h.kind == "str" and h.value in STRING_FIELDS[field]
    elif field in ("stats", "files"):  # no hostile value is a complete stats/files object
        ok = False
    elif field == "set":  # nor a complete set object (it has no id): only null is accepted
        ok = h.kind == "null"
    elif field in OBJECT_FIELDS:
        ok = h.kind == "object" or (h.kind == "null" and OBJECT_FIELDS[field])
    else:
        ok = True
    return None if ok else "METADATA_INVALID"


def rule_of(field: str) -> str:
    """The key of format.METADATA_FIELD_RANGES that governs an integer field."""
    if field.startswith("stats."):
        return "stats.*"
    if field.startswith("files."):
        return "files.*." + split_field(field)[-1]
    return field


def high_text(value: int) -> str:
    return {I32: "2^31 − 1", I32 - 1: "2^31 − 2", I64: "2^63 − 1", 2 ** 32 - 1: "2^32 − 1"}[value]


def nested(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"k":' * (depth - 1) + "{}" + "}" * (depth - 1)


EDGE_INTS = [0, 1, -1, I32, I32 + 1, 2 ** 32 - 1, 2 ** 32, I64, I64 + 1, -2 ** 63, -2 ** 63 - 1, 2 ** 64 - 1,
             2 ** 64, 10 ** 19, 10 ** 20]
EDGE_FLOATS = ["1e999", "-1e999", "1E+400", "1.7976931348623157e308", "1.7976931348623159e308", "1e-400",
               "-0.0", "0.5", "1e308", "2.5e-324", "123456789" * 40 + ".5", "0." + "0" * 400 + "1"]

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2 ** 70, 2 ** 70),
                 st.integers(64, 4000).map(lambda n: int("9" * n))).map(lambda v: Hostile(str(v), "int", v))
floats = st.one_of(st.sampled_from(EDGE_FLOATS),
                   st.floats(allow_nan=False, allow_infinity=False).map(repr)).map(
    lambda t: Hostile(t, "float", float(t)))
containers = st.tuples(st.one_of(st.integers(1, 70), st.sampled_from([300, 2000])),
                       st.sampled_from(["array", "object"])).map(
    lambda dk: Hostile(nested(*dk), dk[1], depth=dk[0]))
scalars = st.one_of(
    st.text(max_size=20).map(lambda t: Hostile(json.dumps(t), "str", t)),
    st.sampled_from([Hostile("true", "bool", True), Hostile("false", "bool", False), Hostile("null", "null"),
                     Hostile('"\\ud800"', "str"), Hostile('"' + "x" * 100000 + '"', "str")]))
hostile = st.one_of(ints, floats, containers, scalars)


def with_value(meta: dict, field: str, text: str) -> bytes:
    """The metadata bytes with ``field`` set to the raw JSON ``text``."""
    obj = json.loads(json.dumps(meta))
    parts = split_field(field)
    target = obj
    for key in parts[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[parts[-1]] = "@@HOSTILE@@"
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode().replace(b'"@@HOSTILE@@"',
                                                                                    text.encode())


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("limits")
    prefix = str(directory / "base")
    rng = np.random.default_rng(7)
    write_shard(prefix, random_packs(rng, 12, vocab=1000), vocab_size=1000,
                metadata={"tokenizer": {"name": "t"}, "source": {"inputs": []}, "set": BASE_SET})
    raw = pathlib.Path(prefix + ".seq.idx").read_bytes()
    meta = json.loads(raw[METADATA_OFFSET:METADATA_OFFSET + seq_fields(prefix)["metadata_length"]])
    return prefix, meta


def copy_shard(src: str, dst: str) -> str:
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(src + suffix, dst + suffix)
    return dst


def metadata_codes(findings) -> set:
    return {f.code for f in findings} & METADATA_CODES


def verdicts(prefix: str, lib: str):
    """(Python reader outcome, gate report, native report) of one shard."""
    try:
        MMapIndexedDataset(prefix, check_packs=True)[0]
        reader = None
    except ShardError as exc:
        reader = exc
    gate = check(prefix)
    codes = gate.shards[0].codes()
    assert "GATE_INTERNAL_ERROR" not in codes and "READER_CRASHED" not in codes, gate.format_text(True)
    native = validate(prefix, lib_path=lib)
    return reader, gate, native


# --------------------------------------------------------------------------- the family


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("LIMIT_CASES", 300)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(field=st.sampled_from(ALL_FIELDS), value=hostile)
def test_hostile_value_in_every_field(base, native_lib, tmp_path_factory, field, value):
    src, meta = base
    prefix = copy_shard(src, str(tmp_path_factory.mktemp("case") / "s"))
    raw = with_value(meta, field, value.text)
    reseal(prefix, metadata_bytes=raw)
    want = expected_code(field, value)

    # The one validate path of the Python package.
    try:
        from megatron_sft_idx.metadata import ShardMetadata
        ShardMetadata.decode(raw)
        python = None
    except MetadataLimitError:
        python = "METADATA_LIMIT"
    except MetadataError:
        python = "METADATA_INVALID"
    assert python == want, (field, value)

    reader, gate, native = verdicts(prefix, native_lib)
    gate_codes, native_codes = metadata_codes(gate.shards[0].findings), metadata_codes(native.findings)
    assert gate_codes == native_codes == ({want} if want else set()), (field, value, gate_codes, native_codes)
    assert gate.passed == native.passed, (gate.format_text(True), native.findings)
    if want is not None:
        assert isinstance(reader, MetadataLimitError if want == "METADATA_LIMIT" else MetadataError), reader
        assert not gate.passed


@pytest.mark.slow
@pytest.mark.parametrize("where", ["zz_unknown", "extra.a", "tokenizer.a", "producer.a"])
@pytest.mark.parametrize("kind", ["array", "object"])
def test_depth_limit_is_exact_in_both(base, native_lib, tmp_path, where, kind):
    """Nesting exactly at the limit opens everywhere; one more level is refused everywhere."""
    src, meta = base
    enclosing = len(split_field(where))
    for depth, refused in ((DEPTH - enclosing, False), (DEPTH - enclosing + 1, True), (300, True)):
        prefix = copy_shard(src, str(tmp_path / f"d{depth}"))
        reseal(prefix, metadata_bytes=with_value(meta, where, nested(depth, kind)))
        reader, gate, native = verdicts(prefix, native_lib)
        codes = {"METADATA_LIMIT"} if refused else set()
        assert metadata_codes(gate.shards[0].findings) == metadata_codes(native.findings) == codes, depth
        assert gate.passed == native.passed == (not refused)
        assert isinstance(reader, MetadataLimitError) if refused else reader is None


def test_limits_are_the_documented_numbers():
    """format.py, FORMAT.md and csrc state the same limits."""
    doc = pathlib.Path(ROOT, "docs", "FORMAT.md").read_text(encoding="utf-8")
    limits = doc[doc.index("## Limits"):]
    limits = limits[:limits.index("\n## ", 1)]
    assert fmt.MAX_METADATA_DEPTH == DEPTH and f"{DEPTH}" in limits
    assert fmt.MAX_METADATA_LENGTH == 16 << 20 and "16 MiB" in limits
    assert fmt.MAX_COUNT == 2 ** 56 and "2^56" in limits
    assert fmt.METADATA_INT_RANGE == (-2 ** 63, I64)
    for field, (low, high, _) in INT_FIELDS.items():
        assert fmt.METADATA_FIELD_RANGES[rule_of(field)] == (low, high), field
        assert f"| `{rule_of(field)}` | {low} | {high_text(high)} |" in limits, field
    internal = pathlib.Path(ROOT, "csrc", "sft_idx_internal.hpp").read_text(encoding="utf-8")
    assert "kMaxMetadataDepth = 64" in internal and "kMaxCount = uint64_t{1} << 56" in internal
    assert "kMaxMetadataLength = uint64_t{16} << 20" in internal
    assert "kSetCountRange = {1, INT32_MAX}" in internal and "kSetIndexRange = {0, INT32_MAX - 1}" in internal
    assert fmt.MAX_SET_TEXT == 256 and "kMaxSetText = 256" in internal and "1 to 256 bytes" in doc


# --------------------------------------------------------------------------- sizes and counts


def test_metadata_length_limit_in_both(base, native_lib, tmp_path):
    """Exactly MAX_METADATA_LENGTH bytes of metadata is accepted; one more is a bad header."""
    src, meta = base
    body = with_value(meta, "extra.pad", '""')
    for length, refused in ((fmt.MAX_METADATA_LENGTH, False), (fmt.MAX_METADATA_LENGTH + 1, True)):
        raw = body.replace(b'"pad":""', b'"pad":"' + b"x" * (length - len(body)) + b'"')
        assert len(raw) == length
        prefix = copy_shard(src, str(tmp_path / f"l{length}"))
        reseal(prefix, metadata_bytes=raw)
        reader, gate, native = verdicts(prefix, native_lib)
        assert gate.passed == native.passed == (not refused)
        if refused:
            assert "SEQ_IDX_BAD_HEADER" in gate.shards[0].codes() and "SEQ_IDX_BAD_HEADER" in {
                f.code for f in native.findings}
            assert reader is not None


@pytest.mark.parametrize("field", ["pack_count", "sequence_count", "token_count"])
@pytest.mark.parametrize("value", [fmt.MAX_COUNT + 1, 2 ** 63, 2 ** 64 - 1])
def test_header_counts_beyond_the_limit(base, native_lib, tmp_path, field, value):
    prefix = copy_shard(base[0], str(tmp_path / "s"))
    reseal(prefix, header={field: value})
    reader, gate, native = verdicts(prefix, native_lib)
    assert "SEQ_IDX_BAD_HEADER" in gate.shards[0].codes()
    assert "SEQ_IDX_BAD_HEADER" in {f.code for f in native.findings}
    assert not gate.passed and not native.passed and reader is not None


# --------------------------------------------------------------------------- Python specifics


def test_long_integer_literals_are_never_converted():
    """A 10-million-digit integer is refused by its length: with ``int_max_str_digits`` off,
    converting it would take hours (int() of a decimal string is quadratic)."""
    if hasattr(sys, "set_int_max_str_digits"):
        old = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(MetadataLimitError, match="outside int64"):
            parse_json(b'{"x":' + b"7" * 10_000_000 + b"}")
        with pytest.raises(MetadataLimitError, match="outside int64"):
            parse_json(b'{"x":-' + b"7" * 4000 + b"}")
    finally:
        if hasattr(sys, "set_int_max_str_digits"):
            sys.set_int_max_str_digits(old)
    assert parse_json(b'{"x":-9223372036854775808,"y":9223372036854775807}') == {"x": -2 ** 63, "y": I64}


@pytest.mark.parametrize("raw", [b'{"x":NaN}', b'{"x":Infinity}', b'{"x":-Infinity}'])
def test_non_json_constants_are_unparsable(raw):
    with pytest.raises(MetadataError) as info:
        parse_json(raw)
    assert not isinstance(info.value, MetadataLimitError)


@pytest.mark.parametrize("metadata,match", [
    ({"extra": {"a": json.loads(nested(DEPTH - 1, "array"))}}, "nested deeper"),
    ({"deep": json.loads(nested(DEPTH - 1, "array"))}, "nested deeper"),  # goes under extra: one deeper
    ({"tokenizer": {"n": 2 ** 63}}, "outside int64"),
    ({"extra": {"x": float("inf")}}, "JSON-serialisable"),
    ({"extra": {"x": float("nan")}}, "JSON-serialisable"),
    ({"pad_seq_to_mult": 2 ** 31}, "pad_seq_to_mult"),
])
def test_builder_refuses_metadata_a_reader_would_refuse(tmp_path, metadata, match):
    with pytest.raises(MetadataError, match=match):
        IndexedDatasetBuilder(str(tmp_path / "s"), pack_size=64, metadata=metadata)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("kw", [dict(pack_size=2 ** 31), dict(vocab_size=2 ** 31), dict(pack_size=0)])
def test_builder_refuses_sizes_beyond_the_field_ranges(tmp_path, kw):
    with pytest.raises(ShardError, match="must be an integer in 1..2147483647"):
        IndexedDatasetBuilder(str(tmp_path / "s"), **kw)


def test_deepest_allowed_metadata_round_trips_everywhere(tmp_path, native_lib):
    """What the builder accepts at the limit, the reader, the gate and the native validator accept."""
    prefix = str(tmp_path / "s")
    deep = json.loads(nested(DEPTH - 2, "object"))  # under "extra": the top level and extra enclose it
    rng = np.random.default_rng(3)
    write_shard(prefix, random_packs(rng, 4, vocab=100), vocab_size=100,
                metadata={"extra": {"deep": deep}, "n": -2 ** 63, "f": 1e308})
    ds = MMapIndexedDataset(prefix)
    assert ds.metadata.extra["n"] == -2 ** 63 and ds.metadata.extra["deep"] == deep
    assert check(prefix).passed and validate(prefix, lib_path=native_lib).passed


def test_vocab_size_arguments_beyond_the_range_are_usage_errors(base, native_lib, tmp_path):
    """--vocab-size is held to the metadata field's range by every entry point, never passed on."""
    from megatron_sft_idx.gate.cli import main as check_idx

    prefix = base[0]
    for value in (2 ** 31, 2 ** 63, 2 ** 70):
        with pytest.raises(ValueError, match="vocab_size must be an integer in 1..2147483647"):
            check(prefix, vocab_size=value)
        with pytest.raises(ValueError, match="1..2147483647"):
            validate(prefix, vocab_size=value, lib_path=native_lib)
        assert check_idx(["--quiet", "--vocab-size", str(value), prefix]) == 2
    assert check(prefix, vocab_size=2 ** 31 - 1).passed
    cli = os.path.join(os.path.dirname(native_lib), "sft_idx_check")
    import subprocess
    assert subprocess.run([cli, prefix, "--vocab-size", str(2 ** 31)], capture_output=True).returncode == 2
    assert subprocess.run([cli, prefix, "--vocab-size", str(2 ** 31 - 1)], capture_output=True).returncode == 0
