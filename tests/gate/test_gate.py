"""The gate's API: valid shards pass, reports render, inputs resolve, promotion is atomic."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sft_idx import MMapIndexedDataset, Rule, ShardNotFoundError
from megatron_sft_idx import _atomic
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.gate import CODES, RULE_CODES, Report, check, promote, promote_report
from megatron_sft_idx.gate.readback import sample_indices
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The package re-exports the function ``promote``, which shadows the submodule's attribute.
promote_mod = importlib.import_module("megatron_sft_idx.gate.promote")


def make(directory, name="s", n=12, seed=0, **kw):
    prefix = os.path.join(str(directory), name)
    write_shard(prefix, random_packs(np.random.default_rng(seed), n, vocab=500), vocab_size=500, **kw)
    return prefix


def contents(prefix):
    ds = MMapIndexedDataset(prefix)
    return [(p.input_ids.tolist(), p.loss_mask.tolist(), p.seq_start_id.tolist()) for p in ds]


# --------------------------------------------------------------------------- valid shards pass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 40), pack_size=st.sampled_from([4, 16, 64, 300]), max_seqs=st.integers(1, 8),
       pad=st.sampled_from([1, 2, 4]), dtype=st.sampled_from([None, np.int32, np.uint16]),
       vocab=st.sampled_from([None, 50, 70000]), full=st.booleans(), seed=st.integers(0, 2**16))
def test_valid_shards_of_many_shapes_pass(tmp_path_factory, n, pack_size, max_seqs, pad, dtype, vocab, full, seed):
    if dtype is np.uint16 and vocab == 70000:
        dtype = np.int32
    directory = tmp_path_factory.mktemp("valid")
    rng = np.random.default_rng(seed)
    data_vocab = vocab or (60000 if dtype is np.uint16 else 90000)
    packs = random_packs(rng, n, pack_size=pack_size, vocab=data_vocab, max_seqs=max_seqs,
                         pad_mult=pad, full=full)
    prefix = str(directory / "s")
    write_shard(prefix, packs, pack_size=pack_size, vocab_size=vocab, dtype=dtype,
                metadata={"pad_seq_to_mult": pad})
    for level in ("standard", "deep", "fast"):
        report = check(prefix, level=level, sample=3)
        shard = report.shards[0]
        assert report.passed and report.exit_code == 0, report.format_text(verbose=True)
        assert shard.count("error") == 0 and shard.packs == n and shard.kind == "sft"
        assert {f.code for f in shard.findings} <= {"ZERO_LOSS_PACK", "VOCAB_UNKNOWN", "CHECKSUMS_SKIPPED"}
    assert "read-back-all" in check(prefix, level="deep").shards[0].checks


def test_every_rule_and_code_is_documented():
    assert set(RULE_CODES) == set(Rule) - {Rule.OK}
    assert set(RULE_CODES.values()) <= set(CODES)
    doc = open(os.path.join(ROOT, "docs", "GATE.md")).read()
    table = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", doc, re.M))
    assert table == set(CODES), (set(CODES) - table, table - set(CODES))
    for code, info in CODES.items():
        assert info.severity in ("error", "warning", "info") and info.meaning and info.action


def test_sample_indices_cover_first_and_last():
    idx = sample_indices(1000, 10, deep=False)
    assert idx[0] == 0 and idx[-1] == 999 and len(idx) == 12 and np.all(np.diff(idx) > 0)
    assert sample_indices(1000, 10, deep=True).tolist() == list(range(1000))
    assert np.array_equal(sample_indices(1000, 10, False), sample_indices(1000, 10, False))


# --------------------------------------------------------------------------- inputs and reports


def test_prefix_glob_directory_and_file_inputs(tmp_path):
    a, b = make(tmp_path, "a"), make(tmp_path, "b", seed=1)
    for inputs in ([a, b], str(tmp_path), str(tmp_path / "*"), [a + ".idx", b + ".seq.bin"],
                   [str(tmp_path / "*.idx")]):
        report = check(inputs)
        assert [s.prefix for s in report.shards] == [a, b], inputs
        assert report.passed
    with pytest.raises(ShardNotFoundError):
        check(str(tmp_path / "nope"))
    with pytest.raises(ShardNotFoundError):
        check([a, str(tmp_path / "missing_*")])
    with pytest.raises(ValueError):
        check(a, level="quick")


def test_builder_temporaries_are_not_shards(tmp_path):
    a = make(tmp_path, "a")
    open(_atomic.temporary_path(str(tmp_path / "c.bin")), "wb").close()
    assert [s.prefix for s in check(str(tmp_path)).shards] == [a]


def test_report_json_and_text(tmp_path):
    good, bad = make(tmp_path, "good"), make(tmp_path, "bad", seed=3)
    with open(bad + ".loss.bin", "r+b") as f:
        f.write(b"\x02")
    report = check([good, bad])
    assert not report.passed and report.exit_code == 1
    data = json.loads(report.to_json())
    assert data["schema"] == "megatron_sft_idx.gate/1" and data["summary"]["failed"] == 1
    shard = data["shards"][1]
    assert shard["prefix"] == bad and not shard["passed"]
    assert {"LOSS_NOT_BINARY", "CHECKSUM_MISMATCH"} <= {f["code"] for f in shard["findings"]}
    finding = next(f for f in shard["findings"] if f["code"] == "LOSS_NOT_BINARY")
    assert finding["pack"] == 0 and finding["offset"] == 0 and finding["file"] == bad + ".loss.bin"
    text = report.format_text().splitlines()
    assert text[-1].startswith("overall: FAIL: 1 of 2")
    assert any(line.startswith("PASS  " + good) for line in text)
    assert any(line.startswith("FAIL  " + bad) for line in text)
    assert any("LOSS_NOT_BINARY" in line and "pack 0" in line for line in text)


def test_workers_check_in_parallel_processes(tmp_path):
    prefixes = [make(tmp_path, f"s{i}", seed=i) for i in range(3)]
    with open(prefixes[1] + ".bin", "ab") as f:
        f.write(b"\0\0")
    report = check(prefixes, workers=2)
    assert [s.prefix for s in report.shards] == prefixes
    assert [s.passed for s in report.shards] == [True, False, True]
    assert "BIN_SIZE_MISMATCH" in report.shards[1].codes()


# --------------------------------------------------------------------------- promotion


def test_promote_moves_atomically_and_reports_destinations(tmp_path):
    src = make(tmp_path / "staging")
    before = contents(src)
    report = promote_report(check(src), tmp_path / "train")
    shard = report.shards[0]
    dest = str(tmp_path / "train" / "s")
    assert report.passed and shard.promoted == {s: dest + s for s in
                                                (".bin", ".loss.bin", ".seq.bin", ".seq.idx", ".idx")}
    assert "PROMOTED" in shard.codes()
    assert not any(os.path.exists(src + s) for s in ALL_SUFFIXES)
    assert contents(dest) == before and check(dest).passed
    assert json.loads(report.to_json())["shards"][0]["promoted"][".idx"] == dest + ".idx"


def test_promote_link_keeps_source(tmp_path):
    src = make(tmp_path / "staging")
    report = promote_report(check(src), tmp_path / "train", link=True)
    dest = str(tmp_path / "train" / "s")
    for s in ALL_SUFFIXES:
        # The data files are linked; the .idx is always a fresh copy (readers tell
        # generations apart by its inode: _files.py).
        assert os.path.samefile(src + s, dest + s) == (s != ".idx")
        assert pathlib.Path(src + s).read_bytes() == pathlib.Path(dest + s).read_bytes()
    assert report.passed and check(src).passed


def test_failing_shard_is_never_promoted(tmp_path):
    src = make(tmp_path / "staging")
    os.truncate(src + ".loss.bin", 3)
    report = promote_report(check(src), tmp_path / "train")
    assert not report.passed and "NOT_PROMOTED" in report.shards[0].codes()
    assert not (tmp_path / "train").exists() or os.listdir(tmp_path / "train") == []
    assert all(os.path.exists(src + s) for s in ALL_SUFFIXES)
    with pytest.raises(ShardError):
        promote(report.shards[0], tmp_path / "train")


def test_existing_destination_needs_replace(tmp_path):
    old = make(tmp_path / "train", seed=7)
    old_contents = contents(old)
    src = make(tmp_path / "staging", seed=8)
    new_contents = contents(src)
    refused = promote_report(check(src), tmp_path / "train")
    assert not refused.passed and "PROMOTION_REFUSED" in refused.shards[0].codes()
    assert contents(old) == old_contents and all(os.path.exists(src + s) for s in ALL_SUFFIXES)
    replaced = promote_report(check(src), tmp_path / "train", replace=True)
    assert replaced.passed and contents(old) == new_contents


def test_replace_removes_companions_the_new_shard_lacks(tmp_path):
    make(tmp_path / "train", seed=7)
    src = make(tmp_path / "staging", seed=8)
    for s in (".loss.bin", ".seq.idx", ".seq.bin"):
        os.remove(src + s)
    report = promote_report(check(src, allow_pretrain=True), tmp_path / "train", replace=True)
    assert report.passed
    assert sorted(os.listdir(tmp_path / "train")) == ["s.bin", "s.idx"]
    assert MMapIndexedDataset(str(tmp_path / "train" / "s")).is_pretrain


def test_files_changed_after_check_are_refused(tmp_path):
    src = make(tmp_path / "staging")
    report = check(src)
    with open(src + ".bin", "r+b") as f:
        f.write(b"\x01\x00")
    os.utime(src + ".bin", ns=(1, 1))
    promote_report(report, tmp_path / "train")
    assert "PROMOTION_REFUSED" in report.shards[0].codes() and not report.passed


@pytest.mark.parametrize("fail_at", [".seq.bin", ".idx"])
def test_crash_mid_promotion_leaves_nothing_that_opens(tmp_path, monkeypatch, fail_at):
    src = make(tmp_path / "staging")
    before = contents(src)
    real_replace = os.replace

    def crashing_replace(a, b):
        if b.endswith(fail_at) and ".tmp-" in a:
            raise OSError(28, "No space left on device (simulated)")
        return real_replace(a, b)

    monkeypatch.setattr(_atomic.os, "replace", crashing_replace)
    report = promote_report(check(src), tmp_path / "train")
    monkeypatch.undo()
    dest = str(tmp_path / "train" / "s")
    assert "PROMOTION_FAILED" in report.shards[0].codes() and not report.passed
    assert not os.path.exists(dest + ".idx")
    with pytest.raises(ShardError):
        MMapIndexedDataset(dest)
    assert not [n for n in os.listdir(tmp_path / "train") if ".tmp-" in n]
    assert contents(src) == before  # the source is untouched: files are linked, not moved, until the end


def test_copy_fallback_when_links_are_impossible(tmp_path, monkeypatch):
    src = make(tmp_path / "staging")
    before = contents(src)

    def no_links(a, b):
        raise OSError(18, "Invalid cross-device link (simulated)")

    monkeypatch.setattr(promote_mod.os, "link", no_links)
    report = promote_report(check(src), tmp_path / "train")
    assert report.passed and contents(str(tmp_path / "train" / "s")) == before
    linked = promote_report(check(make(tmp_path / "staging", "t")), tmp_path / "train", link=True)
    assert "PROMOTION_FAILED" in linked.shards[0].codes()
    assert not os.path.exists(tmp_path / "train" / "t.idx")


def test_two_shards_with_one_name_are_not_both_promoted(tmp_path):
    a = make(tmp_path / "x", "s", seed=1)
    b = make(tmp_path / "y", "s", seed=2)
    report = promote_report(check([a, b]), tmp_path / "train")
    assert "PROMOTED" in report.shards[0].codes()
    assert "PROMOTION_REFUSED" in report.shards[1].codes()
    assert isinstance(report, Report)
