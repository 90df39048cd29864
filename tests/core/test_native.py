"""The native C++ reader/validator (csrc/) against the Python reader and gate.

The native code is built once per test run with ``csrc/build.sh`` (tests/conftest.py)
(g++ is part of this project's toolchain: a missing compiler fails the tests).
Then: the native reader returns every pack exactly as MMapIndexedDataset does;
the native validator passes valid shards, fails each corruption with the
expected finding code and agrees with ``megatron_sft_idx.gate.check``; and a
seeded fuzz loop never crashes the CLI and always fails a mutated shard.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.corrupt import (first_start, flip, idx_offset, layout, loss_on_last, loss_two, mutate, patch, reseal,
                     sealed, seq_fields, start_decreasing)
from megatron_sft_idx.metadata import ShardMetadata
from megatron_sft_idx import MMapIndexedDataset, ShardError
from megatron_sft_idx.format import ALL_SUFFIXES, METADATA_OFFSET
from megatron_sft_idx.gate import check
from megatron_sft_idx import native as native_module
from megatron_sft_idx.native import NativeLibraryError, NativeShard, load_library, validate
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "v1_0", "tiny")
VOCAB = 1000
FUZZ_CASES = 200


# --------------------------------------------------------------------------- build


@pytest.fixture(scope="module")
def native(native_build):
    """(library path, CLI path), built from csrc/ once per test run (tests/conftest.py ``native_build``)."""
    lib, cli = native_build
    load_library(lib)
    return lib, cli


def run_cli(cli, *args):
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- shards


def make_shard(directory, name="s", seed=0, n=24, vocab=VOCAB, pad=1, **kw):
    prefix = os.path.join(str(directory), name)
    rng = np.random.default_rng(seed)
    packs = random_packs(rng, n, vocab=vocab, pad_mult=pad, max_seqs=kw.pop("max_seqs", 6))
    if pad > 1:
        kw["metadata"] = {"pad_seq_to_mult": pad}
    write_shard(prefix, packs, vocab_size=vocab, **kw)
    return prefix


# --------------------------------------------------------------------------- the reader


def assert_same_packs(prefix, lib):
    ds = MMapIndexedDataset(prefix)
    with NativeShard(prefix, lib_path=lib) as shard:
        assert len(shard) == len(ds)
        for i in range(len(ds)):
            ids, loss, starts = shard.pack(i)
            ref = ds[i]
            assert ids.dtype == ref.input_ids.dtype and loss.dtype == np.uint8 and starts.dtype == np.int32
            np.testing.assert_array_equal(ids, ref.input_ids)
            np.testing.assert_array_equal(loss, ref.loss_mask)
            np.testing.assert_array_equal(starts, ref.seq_start_id)
            assert shard.check_pack(i) == (0, -1)
        last = shard.pack(-1)
        np.testing.assert_array_equal(last[0], ds[len(ds) - 1].input_ids)
        # The native binding returns the JSON as stored (a 1.0 shard has no pad_layout key).
        assert ShardMetadata.from_dict(shard.metadata) == ds.metadata
        assert (shard.pack_size, shard.vocab_size) == (ds.metadata.pack_size, ds.metadata.vocab_size)


@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
def test_golden_shard_reads_identically(native, version):
    lib, _ = native
    golden = os.path.join(ROOT, "tests", "golden", version, "tiny")
    assert_same_packs(golden, lib)
    assert validate(golden, lib_path=lib).passed
    with NativeShard(golden, lib_path=lib) as shard:
        ids, loss, starts = shard.pack(0)
        assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and loss.tolist() == [0, 1, 1, 0, 1, 1, 1, 0]
        assert starts.tolist() == [0, 4]
        with pytest.raises(IndexError):
            shard.pack(3)


@pytest.mark.parametrize("shape", [
    dict(name="u16"),
    dict(name="i32", vocab=70000, dtype=np.int32),
    dict(name="pad4", pad=4),
    dict(name="pad8-i32", pad=8, vocab=100000, dtype=np.int32),
    dict(name="one-seq", max_seqs=1, n=5),
])
def test_random_shards_read_identically(native, tmp_path, shape):
    shape = dict(shape)
    prefix = make_shard(tmp_path, seed=len(shape["name"]), **{k: v for k, v in shape.items() if k != "name"})
    assert_same_packs(prefix, native[0])
    report = validate(prefix, lib_path=native[0])
    assert report.passed, report.findings
    assert check(prefix).passed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), pad=st.sampled_from([1, 2, 4]),
       wide=st.booleans())
def test_property_native_matches_python(native, tmp_path_factory, seed, n, pad, wide):
    directory = tmp_path_factory.mktemp("prop")
    kw = dict(vocab=70000, dtype=np.int32) if wide else {}
    prefix = make_shard(directory, seed=seed, n=n, pad=pad, **kw)
    assert_same_packs(prefix, native[0])
    assert validate(prefix, lib_path=native[0]).passed


def test_library_not_built(monkeypatch, tmp_path):
    """No build next to the package (an install without a compiler): a NativeLibraryError saying why."""
    monkeypatch.delenv("MEGATRON_SFT_IDX_NATIVE_LIB", raising=False)
    monkeypatch.delenv("MEGATRON_SFT_IDX_NATIVE", raising=False)
    monkeypatch.setattr(native_module, "BUNDLED_DIR", str(tmp_path))
    with pytest.raises(NativeLibraryError, match="not built .*no native build found.*MEGATRON_SFT_IDX_NATIVE_LIB"):
        load_library()
    (tmp_path / "NOT_BUILT").write_text("C++ compiler 'g++' not found\n")
    with pytest.raises(NativeLibraryError, match=r"not built when .* \(C\+\+ compiler 'g\+\+' not found\)"):
        native_module.checker_path()
    assert not native_module.available()
    with pytest.raises(NativeLibraryError, match="cannot load"):
        load_library("/nonexistent/libsft_idx.so")


def test_bundled_library_is_found_and_env_overrides(native, monkeypatch, tmp_path):
    lib, cli = native
    monkeypatch.delenv("MEGATRON_SFT_IDX_NATIVE_LIB", raising=False)
    monkeypatch.delenv("MEGATRON_SFT_IDX_NATIVE", raising=False)
    monkeypatch.setattr(native_module, "BUNDLED_DIR", os.path.dirname(lib))  # where the install puts it
    assert native_module.library_path() == lib and native_module.checker_path() == cli
    assert native_module.available() and len(NativeShard(GOLDEN)) == 3
    monkeypatch.setattr(native_module, "BUNDLED_DIR", str(tmp_path))  # nothing bundled: the env var decides
    monkeypatch.setenv("MEGATRON_SFT_IDX_NATIVE_LIB", lib)
    assert native_module.library_path() == lib and native_module.checker_path() == cli
    assert len(NativeShard(GOLDEN)) == 3
    monkeypatch.setenv("MEGATRON_SFT_IDX_NATIVE", "0")  # disables every default, not an explicit lib_path
    with pytest.raises(NativeLibraryError, match="MEGATRON_SFT_IDX_NATIVE=0"):
        NativeShard(GOLDEN)
    assert not native_module.available()
    assert len(NativeShard(GOLDEN, lib_path=lib)) == 3


# --------------------------------------------------------------------------- corruptions


def _truncate(suffix):
    return lambda p, d: os.truncate(p + suffix, os.path.getsize(p + suffix) - 1)


def _token(value, pack=9):
    def run(p, d):
        ptr, *_ = layout(p)
        patch(p + ".bin", int(ptr[pack]) + 4, struct.pack("<H", value))
    return run


def _checksum_only(p, d):
    ptr, *_ = layout(p)
    at = int(ptr[3])
    value = struct.unpack("<H", open(p + ".bin", "rb").read()[at:at + 2])[0]
    patch(p + ".bin", at, struct.pack("<H", (value + 1) % VOCAB))


def _swap_seq_idx(p, d):
    other = make_shard(d, "other", seed=5, n=20)
    shutil.copyfile(other + ".seq.idx", p + ".seq.idx")


def _swap_twin_loss(p, d):
    """A same-size .loss.bin from a shard with the same lengths but other loss values."""
    ds = MMapIndexedDataset(p)
    packs = []
    for pack in ds:
        loss = 1 - np.asarray(pack.loss_mask)
        loss[pack.seq_boundaries[1:] - 1] = 0
        packs.append((np.asarray(pack.input_ids), loss, np.asarray(pack.seq_start_id)))
    twin = os.path.join(str(d), "twin")
    write_shard(twin, packs, vocab_size=VOCAB)
    shutil.copyfile(twin + ".loss.bin", p + ".loss.bin")


def _dup_pointer(p, d):
    ptr, *_ = layout(p)
    patch(p + ".idx", idx_offset(p, "ptr", 5), struct.pack("<q", int(ptr[4])))


def _offsets_equal(p, d):
    _, _, offsets, _ = layout(p)
    patch(p + ".seq.idx", seq_fields(p)["csr_offset"] + 16, struct.pack("<q", int(offsets[1])))


CORRUPTIONS = [
    ("truncate-bin", _truncate(".bin"), "BIN_SIZE_MISMATCH"),
    ("truncate-idx", _truncate(".idx"), "IDX_SIZE_MISMATCH"),
    ("truncate-idx-header", lambda p, d: os.truncate(p + ".idx", 20), "IDX_TRUNCATED"),
    ("truncate-loss", _truncate(".loss.bin"), "LOSS_SIZE_MISMATCH"),
    ("truncate-seq-idx", _truncate(".seq.idx"), "SEQ_IDX_SIZE_MISMATCH"),
    ("truncate-seq-idx-header", lambda p, d: os.truncate(p + ".seq.idx", 30), "SEQ_IDX_TRUNCATED"),
    ("truncate-seq-bin", _truncate(".seq.bin"), "SEQ_BIN_SIZE_MISMATCH"),
    ("flip-idx-magic", lambda p, d: flip(p + ".idx", 0), "IDX_BAD_MAGIC"),
    ("flip-idx-dtype", lambda p, d: flip(p + ".idx", 17), "IDX_BAD_DTYPE"),
    ("flip-seq-idx-magic", lambda p, d: flip(p + ".seq.idx", 3), "SEQ_IDX_BAD_MAGIC"),
    ("flip-seq-idx-token-count", lambda p, d: flip(p + ".seq.idx", 33), "SEQ_IDX_HEADER_CRC"),
    ("flip-seq-idx-header-crc", lambda p, d: flip(p + ".seq.idx", 62), "SEQ_IDX_HEADER_CRC"),
    ("idx-version-2", lambda p, d: patch(p + ".idx", 9, struct.pack("<Q", 2)), "IDX_BAD_VERSION"),
    ("seq-idx-version-2", lambda p, d: reseal(p, header={"version_major": 2}), "SEQ_IDX_BAD_VERSION"),
    ("seq-idx-flags", lambda p, d: reseal(p, header={"flags": 1}), "SEQ_IDX_BAD_HEADER"),
    ("loss-value-2", loss_two, "LOSS_NOT_BINARY"),
    ("loss-value-2-sealed", sealed(loss_two), "LOSS_NOT_BINARY"),
    ("loss-on-last", loss_on_last, "LOSS_ON_LAST_POSITION"),
    ("loss-on-last-sealed", sealed(loss_on_last), "LOSS_ON_LAST_POSITION"),
    ("start-decreasing", start_decreasing, "SEQ_NOT_INCREASING"),
    ("start-decreasing-sealed", sealed(start_decreasing), "SEQ_NOT_INCREASING"),
    ("first-start-sealed", sealed(first_start), "SEQ_FIRST_NOT_ZERO"),
    ("token-vocab", _token(VOCAB), "TOKEN_OUT_OF_VOCAB"),
    ("token-vocab-sealed", sealed(_token(VOCAB + 7)), "TOKEN_OUT_OF_VOCAB"),
    ("checksum-mismatch", _checksum_only, "CHECKSUM_MISMATCH"),
    ("swap-seq-idx", _swap_seq_idx, "PACK_COUNT_MISMATCH"),
    ("swap-twin-loss", _swap_twin_loss, "CHECKSUM_MISMATCH"),
    ("dup-pointer", _dup_pointer, "IDX_POINTER_MISMATCH"),
    ("document-index", lambda p, d: patch(p + ".idx", idx_offset(p, "doc", 3), struct.pack("<q", 7)),
     "IDX_DOCUMENT_INDICES"),
    ("csr-offsets-sealed", sealed(_offsets_equal), "SEQ_IDX_OFFSETS"),
    ("metadata-unparsable", lambda p, d: reseal(p, metadata_bytes=b'{"format": "megatron_sft_idx"'),
     "METADATA_UNPARSABLE"),
    ("metadata-missing-key", lambda p, d: reseal(p, edit=lambda o: o.pop("loss_mask_convention")),
     "METADATA_INVALID"),
    ("metadata-pack-size-small", lambda p, d: reseal(p, edit=lambda o: o.update(pack_size=8)), "PACK_TOO_LONG"),
    ("metadata-stats", lambda p, d: reseal(p, edit=lambda o: o["stats"].update(dataset_max_seqlen=1)),
     "METADATA_STATS_MISMATCH"),
    ("remove-seq-bin", lambda p, d: os.remove(p + ".seq.bin"), "FILE_MISSING"),
]


@pytest.fixture(scope="module")
def base_shard(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    return make_shard(directory, seed=0, n=24)


@pytest.mark.subprocess
@pytest.mark.parametrize("name,corrupt,code", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corruption_fails_with_expected_code(native, base_shard, tmp_path, name, corrupt, code):
    lib, cli = native
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    corrupt(prefix, tmp_path)

    report = validate(prefix, lib_path=lib)
    codes = {f.code for f in report.findings}
    assert report.verdict == "fail", report.findings
    assert code in codes, f"{name}: expected {code}, native found {sorted(codes)}"
    gate = check(prefix)
    assert not gate.passed, f"{name}: the Python gate passed a shard the native validator failed"
    gate_codes = {f.code for s in gate.shards for f in s.findings}
    assert code in gate_codes, f"{name}: the Python gate found {sorted(gate_codes)}, not {code}"
    # Every error code the gate reports, the native validator reports too (same vocabulary).
    gate_errors = {f.code for s in gate.shards for f in s.findings if f.severity == "error"}
    assert gate_errors <= codes | {"READER_REFUSED", "ZERO_LOSS_PACK"}, (gate_errors - codes)

    proc = run_cli(cli, prefix)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert code in proc.stdout
    assert all(line.startswith(prefix) for line in proc.stdout.splitlines())
    # The reader refuses the shard at open, or each pack read is either served or refused cleanly.
    try:
        shard = NativeShard(prefix, lib_path=lib)
    except ShardError as exc:
        assert prefix in str(exc)
        return
    for i in range(len(shard)):
        try:
            shard.pack(i)
        except ShardError:
            pass


def _body_crc(p, d):
    reseal(p)
    raw = open(p + ".seq.idx", "rb").read()
    crc = struct.unpack_from("<I", raw, 56)[0]
    reseal(p, header={"body_crc32": crc ^ 0x10})


#: Findings that compare a value the files hold with one a record holds: (case, corruption, code).
RECORDED = [
    ("checksum", _checksum_only, "CHECKSUM_MISMATCH"),
    ("loss-token-count", lambda p, d: reseal(p, edit=lambda o: o["stats"].update(
        loss_token_count=o["stats"]["loss_token_count"] + 3)), "METADATA_STATS_MISMATCH"),
    ("pack-count-vs-header", lambda p, d: reseal(p, edit=lambda o: o["stats"].update(
        pack_count=o["stats"]["pack_count"] + 1)), "METADATA_STATS_MISMATCH"),
    ("size", lambda p, d: reseal(p, edit=lambda o: o["files"][".seq.bin"].update(size=4)), "FILE_SIZE_MISMATCH"),
    ("size-short", lambda p, d: reseal(p, edit=lambda o: o["files"][".seq.bin"].update(size=1 << 20)),
     "FILE_TRUNCATED"),
    ("body-crc", _body_crc, "SEQ_IDX_BODY_CRC"),
    ("header-crc", lambda p, d: flip(p + ".seq.idx", 62), "SEQ_IDX_HEADER_CRC"),
]


@pytest.mark.parametrize("name,corrupt,code", RECORDED, ids=[c[0] for c in RECORDED])
def test_a_value_against_its_record_reads_as_the_python_gate_words_it(native, base_shard, tmp_path, name, corrupt,
                                                                      code):
    """One wording in both reports (issue 30, item 6): "<what> is F, the <record> records R" (or
    "records R, the data gives F", "is F, the header says R"); never "expected"/"found", which meant
    the record in one finding and the data in another."""
    lib, cli = native
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    corrupt(prefix, tmp_path)
    mine = sorted(f.message for f in validate(prefix, lib_path=lib).findings if f.code == code)
    gate = sorted(f.message.split(" -- ")[0] for s in check(prefix).shards for f in s.findings if f.code == code)
    assert mine and set(mine) <= set(gate), (mine, gate)   # (the gate may check one statistic more)
    assert all((" records " in m or " says " in m) and "expected" not in m and "found" not in m for m in mine), mine
    proc = run_cli(cli, prefix)
    assert all(m in proc.stdout for m in mine), proc.stdout


def test_pack_findings_carry_rule_and_pack(native, base_shard, tmp_path):
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    sealed(loss_two)(prefix, tmp_path)
    (finding,) = [f for f in validate(prefix, lib_path=native[0]).findings if f.code == "LOSS_NOT_BINARY"]
    assert (finding.rule, finding.pack, finding.severity) == (4, 7, "error")
    assert finding.file == prefix + ".loss.bin" and "found 2" in finding.message
    with NativeShard(prefix, lib_path=native[0]) as shard:  # sealed: opens; the pack check finds it
        assert shard.check_pack(7) == (4, 1)
        assert ("LOSS_NOT_BINARY", 7) in {(c, p) for c, p, _ in shard.validate()}


def test_corrupt_pointer_is_refused_by_pack(native, base_shard, tmp_path):
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    patch(prefix + ".idx", idx_offset(prefix, "ptr", 2), struct.pack("<q", 1 << 60))
    with NativeShard(prefix, lib_path=native[0]) as shard:  # open() reads only the last pointer
        shard.pack(1)
        with pytest.raises(ShardError, match="PACK_OUT_OF_BOUNDS") as info:
            shard.pack(2)
        assert info.value.pack == 2 and info.value.path == prefix + ".idx"


def test_no_checksums_skips_only_the_crc_pass(native, base_shard, tmp_path):
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    _checksum_only(prefix, tmp_path)
    lib, cli = native
    assert validate(prefix, checksums=False, lib_path=lib).passed
    assert run_cli(cli, prefix, "--no-checksums").returncode == 0
    assert run_cli(cli, prefix).returncode == 1


def _metadata_variant(kind):
    """Metadata bytes edits on which the native JSON parser and Python's json must agree."""
    def run(meta: bytes) -> bytes:
        body = meta[:-1]
        return {
            "whitespace": b" \n" + meta + b" \t",
            "unicode-escapes": body + b',"zz":"\\ud83d\\ude00\\u00e9\\ud800x"}',
            "raw-utf8": body + ',"zz":"\u00e9\u4e2d"}'.encode("utf-8"),
            "duplicate-key-last-wins": body + b',"vocab_size":5}',
            "huge-unknown-number": body + b',"zz":[1e999,-0,123456789012345678901234567890]}',
            "nested-unknown": body + b',"zz":' + b"[" * 100 + b"]" * 100 + b"}",
            "bom": b"\xef\xbb\xbf" + meta,
            "trailing-garbage": meta + b"x",
            "cut": meta[:-1],
            "invalid-utf8": body + b',"zz":"\xc3\x28"}',
            "overlong-utf8": body + b',"zz":"\xc0\xaf"}',
            "control-char": body + b',"zz":"a\x01"}',
            "leading-zero": body + b',"zz":01}',
            "float-pad": meta.replace(b'"pad_seq_to_mult":1', b'"pad_seq_to_mult":1.0'),
            "bool-pad": meta.replace(b'"pad_seq_to_mult":1', b'"pad_seq_to_mult":true'),
            "null-vocab": meta.replace(b'"vocab_size":1000', b'"vocab_size":null'),
            "escaped-key": meta.replace(b'"format"', b'"form\\u0061t"'),
            "array-top": b"[]",
        }[kind]
    return run


METADATA_VARIANTS = ["whitespace", "unicode-escapes", "raw-utf8", "duplicate-key-last-wins", "huge-unknown-number",
                     "nested-unknown", "bom", "trailing-garbage", "cut", "invalid-utf8", "overlong-utf8",
                     "control-char", "leading-zero", "float-pad", "bool-pad", "null-vocab", "escaped-key",
                     "array-top"]


@pytest.mark.parametrize("kind", METADATA_VARIANTS)
def test_metadata_parser_agrees_with_python(native, base_shard, tmp_path, kind):
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, prefix + suffix)
    raw = open(prefix + ".seq.idx", "rb").read()
    meta = raw[METADATA_OFFSET:METADATA_OFFSET + seq_fields(prefix)["metadata_length"]]
    reseal(prefix, metadata_bytes=_metadata_variant(kind)(meta))
    native_report = validate(prefix, lib_path=native[0])
    gate = check(prefix)
    assert native_report.passed == gate.passed, (native_report.findings, gate.format_text())
    if kind == "duplicate-key-last-wins":  # vocab_size 5: ids up to 999 are out of vocabulary
        assert "TOKEN_OUT_OF_VOCAB" in {f.code for f in native_report.findings}


def test_concurrent_reads_agree(native, base_shard):
    from concurrent.futures import ThreadPoolExecutor

    ds = MMapIndexedDataset(base_shard)
    with NativeShard(base_shard, lib_path=native[0]) as shard:
        def read(i):
            ids, loss, starts = shard.pack(i % len(shard))
            ref = ds[i % len(ds)]
            return (np.array_equal(ids, ref.input_ids) and np.array_equal(loss, ref.loss_mask)
                    and np.array_equal(starts, ref.seq_start_id))

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(read, range(400)))


# --------------------------------------------------------------------------- the CLI


def test_cli_json_and_exit_codes(native, base_shard, tmp_path):
    _, cli = native
    bad = str(tmp_path / "bad")
    for suffix in ALL_SUFFIXES:
        shutil.copyfile(base_shard + suffix, bad + suffix)
    loss_two(bad, tmp_path)
    ok = run_cli(cli, base_shard, GOLDEN, "--json")
    assert ok.returncode == 0
    doc = json.loads(ok.stdout)
    assert doc["passed"] and [s["verdict"] for s in doc["shards"]] == ["pass", "pass"]
    mixed = run_cli(cli, base_shard, bad, "--json")
    assert mixed.returncode == 1
    shards = json.loads(mixed.stdout)["shards"]
    assert shards[1]["verdict"] == "fail"
    assert {"LOSS_NOT_BINARY", "CHECKSUM_MISMATCH"} <= {f["code"] for f in shards[1]["findings"]}
    assert run_cli(cli, str(tmp_path / "nothing")).returncode == 2
    assert run_cli(cli).returncode == 2
    assert run_cli(cli, base_shard, "--bogus").returncode == 2
    assert run_cli(cli, base_shard, "--vocab-size", "0").returncode == 2
    assert run_cli(cli, base_shard, "--vocab-size", "10").returncode == 1  # ids up to 999
    assert run_cli(cli, "--help").returncode == 0


def test_cli_unreadable_file_exits_2(native, base_shard, tmp_path):
    prefix = str(tmp_path / "s")
    for suffix in ALL_SUFFIXES:
        if suffix != ".bin":
            shutil.copyfile(base_shard + suffix, prefix + suffix)
    os.mkdir(prefix + ".bin")  # exists but cannot be mapped
    proc = run_cli(native[1], prefix)
    assert proc.returncode == 2 and "FILE_UNREADABLE" in proc.stdout


# --------------------------------------------------------------------------- fuzz


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz_base")
    return [make_shard(directory, "u16", seed=1, n=30),
            make_shard(directory, "i32", seed=2, n=30, vocab=70000, dtype=np.int32),
            make_shard(directory, "pad4", seed=3, n=30, pad=4)]


@pytest.mark.subprocess
def test_fuzz_never_crashes_and_always_fails(native, fuzz_bases, tmp_path):
    lib, cli = native
    rng = np.random.default_rng(20240601)
    prefix = str(tmp_path / "f")
    mutated = 0
    for case in range(FUZZ_CASES):
        base = fuzz_bases[case % len(fuzz_bases)]
        for suffix in ALL_SUFFIXES:
            shutil.copyfile(base + suffix, prefix + suffix)
        what = mutate(rng, prefix)
        if what is None:
            continue
        mutated += 1
        proc = run_cli(cli, prefix)
        assert proc.returncode in (1, 2), f"case {case} ({what}): exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
        report = validate(prefix, lib_path=lib)
        assert not report.passed, f"case {case} ({what}) passed"
        try:
            shard = NativeShard(prefix, lib_path=lib)
        except ShardError:
            continue
        for i in range(len(shard)):
            try:
                shard.pack(i)
            except ShardError:
                pass
    assert mutated > FUZZ_CASES * 0.9
