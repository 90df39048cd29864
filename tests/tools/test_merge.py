"""merge-shards: the output is the concatenation of the inputs, byte for byte where the format
allows; refusals name the input and the key; nothing is published unless the gate passes."""

import errno
import json
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_sft_idx.errors import (ChecksumError, IncompatibleShardsError, InvariantError, ShardError,
                                     ShardExistsError, ShardNotFoundError, ShardSetError)
from megatron_sft_idx.gate import check
from megatron_sft_idx.tools import _copy, merge
from megatron_sft_idx.tools.merge import merge_shards
from megatron_sft_idx.tools.merge_cli import main as merge_main
from megatron_sft_idx.publishing import write_manifest
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_SUFFIXES = (".bin", ".idx", ".loss.bin", ".seq.bin")


def _inputs(tmp_path, rng, counts, **kw):
    packs, prefixes = [], []
    for k, n in enumerate(counts):
        part = random_packs(rng, n, pad_mult=kw.get("metadata", {}).get("pad_seq_to_mult", 1))
        write_shard(tmp_path / f"in_{k:03d}", part, **kw)
        packs += part
        prefixes.append(str(tmp_path / f"in_{k:03d}"))
    return prefixes, packs


def _assert_packs(prefix, packs):
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == len(packs)
    for i, (ids, loss, starts) in enumerate(packs):
        p = ds[i]
        np.testing.assert_array_equal(p.input_ids, ids)
        np.testing.assert_array_equal(p.loss_mask, loss)
        np.testing.assert_array_equal(p.seq_start_id, starts)


def _leftovers(directory):
    return [n for n in os.listdir(directory) if ".tmp-" in n]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_merge_is_the_concatenation_byte_for_byte(tmp_path_factory, counts, seed):
    tmp = tmp_path_factory.mktemp("m")
    prefixes, packs = _inputs(tmp, np.random.default_rng(seed), counts, vocab_size=1000)
    result = merge_shards(tmp / "out" / "all", prefixes)
    out = str(tmp / "out" / "all")
    _assert_packs(out, packs)
    # The same packs through the builder give the same data and index bytes.
    write_shard(tmp / "ref", packs, vocab_size=1000)
    for suffix in DATA_SUFFIXES:
        with open(str(tmp / "ref") + suffix, "rb") as a, open(out + suffix, "rb") as b:
            assert a.read() == b.read(), suffix
    ref = MMapIndexedDataset(tmp / "ref").metadata
    assert result.metadata.stats == ref.stats and result.metadata.files == ref.files
    assert check(out, level="deep").passed
    assert result.metadata.source["merged"]["shards"] == len(counts)
    assert not _leftovers(tmp / "out")


def test_upstream_megatron_reads_the_merged_tokens(tmp_path, rng):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, packs = _inputs(tmp_path, rng, [30, 7, 50])
    merge_shards(tmp_path / "all", prefixes)
    upstream = IndexedDataset(str(tmp_path / "all"))
    assert len(upstream) == len(packs)
    for i in (0, 29, 30, 36, 37, len(packs) - 1):
        np.testing.assert_array_equal(upstream[i], packs[i][0])


def test_inputs_as_glob_directory_and_manifest_in_the_order_given(tmp_path, rng):
    (tmp_path / "d").mkdir()
    a, pa = _inputs(tmp_path / "d", rng, [5, 6])
    manifest = tmp_path / "m.json"
    write_manifest(manifest, a)
    # a shard named twice is refused (blends, not duplicates, weight data)
    with pytest.raises(ShardError, match="named twice"):
        merge_shards(tmp_path / "x", [str(manifest), str(tmp_path / "d")])
    merge_shards(tmp_path / "x", [str(manifest)])
    _assert_packs(tmp_path / "x", pa)
    merge_shards(tmp_path / "y", [str(tmp_path / "d" / "in_001"), str(tmp_path / "d" / "in_000")])
    _assert_packs(tmp_path / "y", pa[5:] + pa[:5])


def test_mixed_dtypes_are_refused_unless_widened(tmp_path, rng):
    small, big = random_packs(rng, 8), random_packs(rng, 9, vocab=1000)
    big[3][0][0] = 70000
    write_shard(tmp_path / "u16", small)
    write_shard(tmp_path / "i32", big)
    assert MMapIndexedDataset(tmp_path / "i32").dtype.name == "int32"
    with pytest.raises(IncompatibleShardsError, match="token_dtype") as info:
        merge_shards(tmp_path / "out", [str(tmp_path / "u16"), str(tmp_path / "i32")])
    assert info.value.field == "token_dtype" and "--widen" in str(info.value)
    result = merge_shards(tmp_path / "out", [str(tmp_path / "u16"), str(tmp_path / "i32")], widen=True)
    assert result.metadata.token_dtype == "int32" and result.copy_methods["widened"] == 1
    _assert_packs(tmp_path / "out", small + big)
    assert check(str(tmp_path / "out")).passed


@pytest.mark.parametrize("key, left, right", [
    ("pad_seq_to_mult", {"pad_seq_to_mult": 2}, {"pad_seq_to_mult": 4}),
    ("parallelism", {"pad_seq_to_mult": 4, "parallelism": {"cp": 2, "tp": 1, "sp": False}},
     {"pad_seq_to_mult": 4, "parallelism": {"cp": 1, "tp": 2, "sp": True}}),
    ("tokenizer", {"tokenizer": {"name": "a", "files_sha256": "1" * 64}},
     {"tokenizer": {"name": "a", "files_sha256": "2" * 64}}),
])
def test_incompatible_settings_are_refused_naming_both_inputs(tmp_path, rng, key, left, right):
    mult = max(left.get("pad_seq_to_mult", 1), right.get("pad_seq_to_mult", 1))
    write_shard(tmp_path / "a", random_packs(rng, 4, pad_mult=mult), metadata=left)
    write_shard(tmp_path / "b", random_packs(rng, 4, pad_mult=mult), metadata=right)
    with pytest.raises(IncompatibleShardsError) as info:
        merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "b")])
    err = info.value
    assert err.field == key and err.path == str(tmp_path / "b") and str(tmp_path / "a") in str(err)
    assert not os.path.exists(tmp_path / "out.idx") and not _leftovers(tmp_path)


@pytest.mark.parametrize("right, field, words", [
    ({"name": "llama", "files_sha256": "1" * 64, "chat_template_sha256": "b" * 64}, "chat_template",
     "the same tokenizer ('llama') with different chat templates (sha256 aaaaaaaaaaaa and bbbbbbbbbbbb)"),
    ({"name": "llama", "files_sha256": "1" * 64}, "chat_template",
     "the same tokenizer ('llama'), only the first rendered with a chat template"),
    ({"name": "deepseek", "files_sha256": "2" * 64, "chat_template_sha256": "a" * 64}, "tokenizer",
     "different tokenizers: 'llama' (files sha256 111111111111) and 'deepseek' (files sha256 222222222222)"),
])
def test_refusals_say_what_differs_in_words(tmp_path, rng, right, field, words):
    left = {"name": "llama", "files_sha256": "1" * 64, "chat_template_sha256": "a" * 64}
    write_shard(tmp_path / "a", random_packs(rng, 4), metadata={"tokenizer": left})
    write_shard(tmp_path / "b", random_packs(rng, 4), metadata={"tokenizer": right})
    with pytest.raises(IncompatibleShardsError) as info:
        merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "b")])
    text = str(info.value)
    assert info.value.field == field and words in text and "1" * 64 not in text and "a" * 64 not in text, text


def test_part_of_a_set_is_refused_by_directory_and_merged_by_prefixes(tmp_path, rng):
    for i in range(2):
        write_shard(tmp_path / "d" / f"ds_{i}", random_packs(rng, 3),
                    metadata={"set": {"id": "x" * 32, "index": i, "count": 3, "name": "train"}})
    with pytest.raises(ShardSetError, match="2 of its 3 shards"):
        merge_shards(tmp_path / "out", [str(tmp_path / "d")])
    result = merge_shards(tmp_path / "out", [str(tmp_path / "d" / "ds_0"), str(tmp_path / "d" / "ds_1")])
    assert result.metadata.shard_set is None and len(MMapIndexedDataset(tmp_path / "out")) == 6


def test_padding_layouts_are_not_mixed(tmp_path):
    stored = (np.arange(4), np.array([1, 1, 1, 0]), np.array([0]))    # 4 % 2 == 0
    runtime = (np.arange(5), np.array([1, 1, 1, 1, 0]), np.array([0]))  # (5 - 1) % 2 == 0
    write_shard(tmp_path / "s", [stored], metadata={"pad_seq_to_mult": 2, "pad_layout": "stored"})
    write_shard(tmp_path / "r", [runtime], metadata={"pad_seq_to_mult": 2, "pad_layout": "runtime"})
    with pytest.raises(IncompatibleShardsError) as info:
        merge_shards(tmp_path / "out", [str(tmp_path / "s"), str(tmp_path / "r")])
    assert info.value.field == "pad_layout" and "Megatron-Bridge" in str(info.value)
    result = merge_shards(tmp_path / "out", [str(tmp_path / "r")])
    assert result.metadata.pad_layout == "runtime" and result.metadata.stats.min_packed_runtime_len == 4
    assert check(str(tmp_path / "out")).passed


def test_combined_metadata_keeps_what_inputs_agree_on(tmp_path, rng):
    tok = {"name": "t", "files_sha256": "3" * 64, "path": "/x"}
    write_shard(tmp_path / "a", random_packs(rng, 4, vocab=900), pack_size=64, vocab_size=900,
                metadata={"tokenizer": tok, "packing": {"algorithm": "ffd"}, "extra": {"split": "train", "i": 0}})
    write_shard(tmp_path / "b", random_packs(rng, 4, pack_size=32), pack_size=32, vocab_size=1000,
                metadata={"tokenizer": dict(tok, path="/y"), "packing": {"algorithm": "bfd"},
                          "extra": {"split": "train", "i": 1}})
    m = merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "b")]).metadata
    assert m.pack_size == 64 and m.vocab_size == 1000 and m.tokenizer == tok
    assert m.packing is None and m.extra == {"split": "train"}
    result = merge_shards(tmp_path / "out2", [str(tmp_path / "a"), str(tmp_path / "b")], pack_size=128)
    assert result.metadata.pack_size == 128 and check(str(tmp_path / "out2")).passed
    with pytest.raises(InvariantError, match="pack-size"):
        merge_shards(tmp_path / "out3", [str(tmp_path / "a")], pack_size=8)


def test_parallelism_matters_only_for_padded_shards(tmp_path, rng):
    write_shard(tmp_path / "a", random_packs(rng, 3), metadata={"parallelism": {"cp": 1, "tp": 1, "sp": False}})
    write_shard(tmp_path / "b", random_packs(rng, 3))
    result = merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.metadata.parallelism is None and any("parallelism" in n for n in result.notes)


def test_unknown_tokenizer_or_vocab_makes_the_output_unknown_with_a_note(tmp_path, rng):
    write_shard(tmp_path / "a", random_packs(rng, 3), vocab_size=1000, metadata={"tokenizer": {"name": "t"}})
    write_shard(tmp_path / "b", random_packs(rng, 3))
    result = merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.metadata.tokenizer is None and result.metadata.vocab_size is None
    assert any("tokenizer" in n for n in result.notes) and any("vocab_size" in n for n in result.notes)


def test_pretrain_input_is_refused_with_the_conversion_hint(tmp_path, rng):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as UpstreamBuilder
    import torch

    b = UpstreamBuilder(str(tmp_path / "pre.bin"), dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3]))
    b.end_document()
    b.finalize(str(tmp_path / "pre.idx"))
    write_shard(tmp_path / "a", random_packs(rng, 3))
    with pytest.raises(IncompatibleShardsError, match="pretrain") as info:
        merge_shards(tmp_path / "out", [str(tmp_path / "a"), str(tmp_path / "pre")])
    assert "convert-packed" in str(info.value)


def test_output_rules(tmp_path, rng):
    prefixes, packs = _inputs(tmp_path, rng, [3, 4])
    merge_shards(tmp_path / "out", prefixes)
    with pytest.raises(ShardExistsError):
        merge_shards(tmp_path / "out", prefixes)
    merge_shards(tmp_path / "out", prefixes[::-1], overwrite=True)
    _assert_packs(tmp_path / "out", packs[3:] + packs[:3])
    with pytest.raises(ShardError, match="also an input"):
        merge_shards(prefixes[0], prefixes, overwrite=True)
    with pytest.raises(ShardNotFoundError):
        merge_shards(tmp_path / "o2", [str(tmp_path / "missing")])


def test_a_corrupt_input_fails_the_gate_and_nothing_is_published(tmp_path, rng):
    prefixes, _ = _inputs(tmp_path, rng, [20, 20])
    with open(prefixes[1] + ".bin", "r+b") as f:  # bit rot the recorded CRC cannot explain
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumError, match="failed the gate") as info:
        merge_shards(tmp_path / "out" / "all", prefixes)
    assert "check-idx" in str(info.value)
    assert os.listdir(tmp_path / "out") == []


def test_a_corrupt_index_is_refused_naming_the_input_and_pack(tmp_path, rng):
    prefixes, _ = _inputs(tmp_path, rng, [5, 6])
    ds = MMapIndexedDataset(prefixes[1])
    offset = ds.idx_header.pointers_offset + 8 * 2
    with open(prefixes[1] + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(np.int64(2).tobytes())
    with pytest.raises(InvariantError) as info:
        merge_shards(tmp_path / "out", prefixes)
    assert info.value.path == prefixes[1] and info.value.pack == 2
    assert not os.path.exists(tmp_path / "out.idx") and not _leftovers(tmp_path)


def test_a_failure_midway_leaves_nothing_and_a_killed_runs_staging_is_cleared(tmp_path, rng, monkeypatch):
    prefixes, packs = _inputs(tmp_path, rng, [5, 6])
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    real = merge.copy_range
    monkeypatch.setattr(merge, "copy_range", failing)
    with pytest.raises(OSError):
        merge_shards(tmp_path / "out", prefixes)
    monkeypatch.setattr(merge, "copy_range", real)
    assert not _leftovers(tmp_path) and not os.path.exists(tmp_path / "out.bin")
    dead = tmp_path / ".out.tmp-999999999-dead"  # a killed run's staging directory (no such pid)
    dead.mkdir()
    (dead / "out.bin").write_bytes(b"x")
    merge_shards(tmp_path / "out", prefixes)
    assert not dead.exists()
    _assert_packs(tmp_path / "out", packs)


@pytest.mark.slow
def test_memory_is_flat_in_packs_and_inputs(tmp_path, rng, monkeypatch):
    """Python-heap peak (numpy allocations included) of the merge writer: the same for 400 and
    for 40,000 packs, and for 2 and for 40 inputs, once chunks are smaller than an input."""
    monkeypatch.setattr(merge, "CHUNK_PACKS", 256)
    monkeypatch.setattr(merge, "_gate", lambda *a: None)  # the gate is measured in its own bench

    def peak(counts, name):
        d = tmp_path / name
        d.mkdir()
        pool = random_packs(rng, 50, pack_size=16)
        prefixes = []
        for k, n in enumerate(counts):
            with IndexedDatasetBuilder(d / f"in_{k:03d}", pack_size=16) as b:
                for i in range(n):
                    b.add_packed(*pool[i % 50])
            prefixes.append(str(d / f"in_{k:03d}"))
        tracemalloc.start()
        merge_shards(d / "out", prefixes)
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    small, many_packs, many_inputs = peak([200, 200], "a"), peak([20_000, 20_000], "b"), peak([200] * 40, "c")
    assert many_packs < small + 64 * 1024, (small, many_packs)
    assert many_inputs < small + 64 * 1024, (small, many_inputs)


def test_copy_falls_back_from_copy_file_range_to_sendfile_to_pread(tmp_path, monkeypatch):
    src, dst = tmp_path / "s", tmp_path / "d"
    data = os.urandom(100_000)
    src.write_bytes(data)

    def copy(expect):
        sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            assert _copy.copy_range(sfd, dfd, len(data)) == expect
        finally:
            os.close(sfd), os.close(dfd)
        assert dst.read_bytes() == data

    copy("copy_file_range")

    def unsupported(*a):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    copy("sendfile")
    monkeypatch.setattr(os, "sendfile", unsupported)
    copy("pread")
    sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_TRUNC)
    with pytest.raises(ShardError, match="ended while being copied"):
        _copy.copy_range(sfd, dfd, len(data) + 10, src_path=str(src))
    os.close(sfd), os.close(dfd)


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes_and_json(tmp_path, rng, capsys):
    prefixes, packs = _inputs(tmp_path, rng, [3, 4])
    assert merge_main([str(tmp_path / "out"), str(tmp_path / "in_*"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"] == 2 and doc["metadata"]["stats"]["pack_count"] == 7
    assert merge_main([str(tmp_path / "out"), str(tmp_path / "in_*")]) == 2          # exists
    assert "--overwrite" in capsys.readouterr().err
    assert merge_main([str(tmp_path / "o2"), str(tmp_path / "nothing_*")]) == 2      # no input
    assert merge_main([str(tmp_path / "o2.idx"), prefixes[0]]) == 2                  # a file, not a prefix
    assert merge_main([str(tmp_path / "o2"), prefixes[0], "--pack-size", "0"]) == 2
    assert merge_main(["--bogus"]) == 2
    write_shard(tmp_path / "p2", random_packs(rng, 3, pad_mult=2), metadata={"pad_seq_to_mult": 2})
    assert merge_main([str(tmp_path / "o3"), prefixes[0], str(tmp_path / "p2")]) == 1  # incompatible
    err = capsys.readouterr().err
    assert "pad_seq_to_mult" in err and "Traceback" not in err
    assert merge_main([str(tmp_path / "o4"), *prefixes]) == 0
    assert "merged 2 shards" in capsys.readouterr().out


@pytest.mark.subprocess
def test_the_script_runs_without_installation(tmp_path, rng):
    prefixes, _ = _inputs(tmp_path, rng, [2, 2])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_shards.py"), str(tmp_path / "o"),
                           *prefixes, "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_shards.py"), str(tmp_path / "o"),
                           *prefixes], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "already exists" in proc.stderr


@pytest.mark.subprocess
def test_sigterm_mid_merge_publishes_nothing_and_leaves_no_staging(tmp_path, rng):
    prefixes, _ = _inputs(tmp_path, rng, [5, 6, 7])
    marker = tmp_path / "copying"
    script = f"""
import sys, time
from megatron_sft_idx.tools import merge
from megatron_sft_idx.tools.merge_cli import main
real = merge.copy_range
def slow(*a, **kw):
    open({str(marker)!r}, "w").close()
    time.sleep(30)
    return real(*a, **kw)
merge.copy_range = slow
sys.exit(main([{str(tmp_path / "out")!r}, *{prefixes!r}]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "merge never started copying"
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "SIGTERM; nothing was published" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "out.idx") and not _leftovers(tmp_path)
