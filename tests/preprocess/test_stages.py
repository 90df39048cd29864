"""The staged pipeline: partitions, the sequence store, the pack plan, repack, virtual packs, resume.

Every comparison is of real files on disk: outputs of differently-run pipelines must be equal
byte for byte (shards and manifests alike).
"""

import glob
import json
import os
import random
import re
import shutil

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from megatron_sft_idx.errors import HeaderError, ShardError, ShardExistsError, VersionError
from megatron_sft_idx.preprocess.engines import LocalEngine, report_progress
from megatron_sft_idx.preprocess.records.inputs import OversizedRecord
from megatron_sft_idx.preprocess.records.partitions import Partition, index_file, read_batches
from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run
from megatron_sft_idx.preprocess.planfile import PackPlan
from megatron_sft_idx.preprocess.repack_cli import repack_main
from megatron_sft_idx.preprocess.store import ROW_DTYPE, SequenceStore
from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset
from megatron_sft_idx.reader import MMapIndexedDataset

from support.stages import CHAT, EXAMPLES, ROOT, TOKENIZER, files_of, preprocess  # noqa: F401  (shared helpers)


# ---------------------------------------------------------------- partitions


def _lines(data: bytes):
    """(1-based number, bytes with their newline) of every line, the last one without."""
    pieces = data.split(b"\n")
    return [(i + 1, p + (b"\n" if i < len(pieces) - 1 else b"")) for i, p in enumerate(pieces)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"x")),
                          st.sampled_from([b"", b"  ", b"\r"])), max_size=60),
       st.integers(1, 4000), st.integers(1, 400), st.integers(1, 9), st.booleans())
def test_partitions_concatenate_to_the_whole_file_whatever_the_cut(tmp_path_factory, lines, part_bytes, limit,
                                                                   batch, trailing_newline):
    path = str(tmp_path_factory.mktemp("p") / "in.jsonl")
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    assume(data.lstrip()[:1] != b"[")  # a file that opens with '[' is a JSON array (tests/preprocess/test_input_shapes.py)
    with open(path, "wb") as f:
        f.write(data)
    # a line over the limit is reported without being read whole, so even a blank one
    want = [(n, p if len(p) <= limit else OversizedRecord(len(p))) for n, p in _lines(data)
            if p.strip() or len(p) > limit]
    info = index_file(path, 0, part_bytes)
    parts = [Partition.from_list(p) for p in info["partitions"]]
    got = [r for part in parts for b in read_batches(path, part, batch, limit) for r in b]
    assert got == want
    assert all(0 < len(b) <= batch for part in parts for b in read_batches(path, part, batch, limit))
    if parts:
        assert parts[0].start == 0 and parts[-1].end == len(data)
        assert all(a.end == b.start for a, b in zip(parts, parts[1:]))


def test_partitions_are_cut_near_each_multiple_and_numbered(tmp_path):
    path = tmp_path / "c.jsonl"
    shutil.copyfile(CHAT[0], path)
    info = index_file(str(path), 3, 50_000)
    parts = [Partition.from_list(p) for p in info["partitions"]]
    data = path.read_bytes()
    assert len(parts) == -(-len(data) // 50_000) and info["file"] == 3 and len(info["sha256"]) == 64
    for p in parts:
        assert p.file == 3 and (p.start == 0 or data[p.start - 1:p.start] == b"\n")
        assert data[:p.start].count(b"\n") + 1 == p.first_line


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.parquet", "c.arrow"])
def test_an_input_is_told_local_or_an_object_once(tmp_path, monkeypatch, name):
    """The source decides once (``records.sources.input_source``); indexing and reading an input
    of every kind go through it and never ask again, and a local input's stamp is its mtime."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_sft_idx.preprocess.records import sources

    rows = [json.loads(line) for line in open(CHAT[0], encoding="utf-8")][:40]
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    elif name.endswith(".arrow"):
        with pa.ipc.new_file(str(path), pa.Table.from_pylist(rows).schema) as w:
            w.write_table(pa.Table.from_pylist(rows), max_chunksize=10)
    else:
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    monkeypatch.chdir(tmp_path)
    asked, told = [], sources.is_remote
    monkeypatch.setattr(sources, "is_remote", lambda p: asked.append(p) or told(p))
    source = sources.input_source(name)
    assert isinstance(source, sources.LocalInput) and not source.ranged and source.path == str(path)
    assert source.stat() == (path.stat().st_size, "") and source.stamp("") == {"mtime_ns": path.stat().st_mtime_ns}
    assert sources.input_source(source) is source and asked == [name]
    info = index_file(name, 0, 1000)
    assert asked == [name, name] and info["name"] == name and info["mtime_ns"] == path.stat().st_mtime_ns
    got = [r for p in info["partitions"] for b in read_batches(name, Partition.from_list(p), 7, 1 << 20) for r in b]
    assert len(got) == 40 and asked == [name] * (2 + len(info["partitions"]))
    assert [r for p in info["partitions"] for b in read_batches(source, Partition.from_list(p), 7, 1 << 20)
            for r in b] == got and len(asked) == 2 + len(info["partitions"])
    url = sources.input_source("s3://bucket/k/c.jsonl")   # (no request is made until it is read)
    assert isinstance(url, sources.ObjectInput) and url.ranged and url.path == "s3://bucket/k/c.jsonl"
    assert url.stamp("abc") == {"etag": "abc"}


# ---------------------------------------------------------------- store and plan files


def test_store_layout_identity_and_rows(tmp_path):
    s = preprocess(str(tmp_path / "o"), store=str(tmp_path / "store"), partition_bytes=100_000)
    store = SequenceStore(str(tmp_path / "store"))
    body = json.loads((tmp_path / "store" / "store.json").read_text())
    assert body["format"] == "megatron_sft_idx.store" and body["version"][0] == 1
    assert [i["name"] for i in store.inputs] == CHAT and all(len(i["sha256"]) == 64 for i in store.inputs)
    assert store.tokenizer["vocab_size"] == 1024 and "path" not in store.tokenizer
    assert store.identity["encode"]["loss_on"] == "assistant" and len(store.partitions) >= 3
    assert store.sequence_count == s["conversations"] == 460
    lines = []
    for k, part in enumerate(store.partitions):
        rows = store.rows(k)
        assert rows.dtype == ROW_DTYPE
        shard = MMapIndexedDataset(os.path.join(tmp_path, "store", "parts", f"part_{k:06d}"))
        assert shard.metadata.pack_size is None and len(shard) == rows.size
        assert np.array_equal(shard.sequence_lengths, rows["length"])
        mask = shard.arrays().loss_mask
        for i in range(rows.size):
            first = int(np.flatnonzero(shard[i].loss_mask)[0])
            assert rows["first_trained"][i] == first
        assert shard.metadata.source["inputs"][0]["name"] == CHAT[part.file] and mask.size
        lines += [(part.file, int(x)) for x in rows["line"]]
    assert lines == [(0, n) for n in range(1, 401)] + [(1, n) for n in range(1, 61)]


def test_plan_file_is_refused_when_corrupt_truncated_or_of_a_new_major(tmp_path):
    preprocess(str(tmp_path / "o"), store=str(tmp_path / "store"))
    plan = str(tmp_path / "p.plan")
    repack(RepackConfig(store=str(tmp_path / "store"), output_prefix=None, plan_only=plan, pack_size=512,
                        progress=False))
    good = open(plan, "rb").read()
    assert PackPlan(plan).metadata["settings"]["pack_size"] == 512
    cases = {"flip": (good[:200] + bytes([good[200] ^ 1]) + good[201:], HeaderError, "body CRC"),
             "truncated": (good[:-5], HeaderError, "size disagrees"),
             "magic": (b"X" + good[1:], HeaderError, "bad magic"),
             "major": (good[:8] + (2).to_bytes(2, "little") + good[10:], VersionError, "major version 2")}
    for name, (data, err, message) in cases.items():
        with open(plan, "wb") as f:
            f.write(data)
        with pytest.raises(err, match=message):
            PackPlan(plan)


def test_incomplete_or_missing_store_is_refused_by_repack(tmp_path, capsys):
    preprocess(str(tmp_path / "o"), store=str(tmp_path / "store"), partition_bytes=100_000)
    os.unlink(tmp_path / "store" / "receipts" / "tokenize" / "000001.json")
    rc = repack_main(["--store", str(tmp_path / "store"), "--output-prefix", str(tmp_path / "r" / "x"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "incomplete: 1 of" in err and "--resume" in err and "Traceback" not in err
    rc = repack_main(["--store", str(tmp_path / "nothing"), "--output-prefix", str(tmp_path / "r" / "x")])
    assert rc == 1 and "store.json is missing" in capsys.readouterr().err


# ---------------------------------------------------------------- byte identity across ways of running


@pytest.mark.slow
def test_same_bytes_whatever_workers_partitions_and_batches(tmp_path):
    kw = dict(split=[90, 10], max_packs_per_shard=9, cp=2, verify_masks=20)
    ref = preprocess(str(tmp_path / "ref"), **kw)
    assert ref["manifests"] and len(ref["outputs"]) > 3
    for name, extra in {"w2": dict(workers=2, partition_bytes=40_000, batch_size=7),
                        "p1k": dict(partition_bytes=1_000, batch_size=3)}.items():
        preprocess(str(tmp_path / name), **kw, **extra)
        assert files_of(tmp_path / name) == files_of(tmp_path / "ref"), name


REPACKS = {
    "cp4_2048": dict(pack_size=2048, cp=4),
    "split_shards": dict(pack_size=768, split=[80, 10, 10], max_shard_bytes=30000, seed=5),
    "shuffle_tp_sp": dict(pack_size=512, packing_algorithm="first_fit_shuffle", cp=2, tp=2, sp=True,
                          overlong="drop"),
}


@pytest.fixture(scope="module")
def kept_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("kept")
    preprocess(str(d / "first"), store=str(d / "store"), partition_bytes=60_000)
    return str(d / "store")


def _flags(kw):
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        else:
            out += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return out


@pytest.mark.parametrize("name", sorted(REPACKS))
def test_repack_is_byte_identical_to_a_fresh_preprocess(tmp_path, kept_store, name):
    kw = REPACKS[name]
    assert repack_main(["--store", kept_store, "--output-prefix", str(tmp_path / "r" / "ds"), "--quiet",
                        "--workers", "2", *_flags(kw)]) == 0
    cfg = {("algorithm" if k == "packing_algorithm" else k): v for k, v in kw.items()}
    preprocess(str(tmp_path / "f"), **cfg)
    assert files_of(tmp_path / "r") == files_of(tmp_path / "f")


@pytest.mark.parametrize("name", sorted(REPACKS))
def test_virtual_packs_equal_the_materialized_ones(tmp_path, kept_store, name):
    kw = REPACKS[name]
    plan = str(tmp_path / "v.plan")
    assert repack_main(["--store", kept_store, "--plan-only", plan, "--quiet", *_flags(kw)]) == 0
    cfg = {("algorithm" if k == "packing_algorithm" else k): v for k, v in kw.items()}
    s = preprocess(str(tmp_path / "m"), **cfg)
    for split, info in s["splits"].items():
        for k, prefix in enumerate(info["shards"]):
            real = MMapIndexedDataset(prefix)
            virt = VirtualPackedDataset(kept_store, plan, split=split, shard=k)
            assert len(virt) == len(real) and np.array_equal(virt.sequence_lengths, real.sequence_lengths)
            for i in range(len(real)):
                a, b = virt[i], real[i]
                for x, y in zip(a, b):
                    assert x.dtype == y.dtype and np.array_equal(x, y)
            assert [p.packed_len for p in virt[1:3]] == [p.packed_len for p in real[1:3]]
    with pytest.raises(ShardError, match="choose one"):
        if len(s["splits"]) > 1:
            VirtualPackedDataset(kept_store, plan)
        else:
            raise ShardError("choose one")


def test_virtual_dataset_pickles_and_refuses_a_plan_of_another_store(tmp_path, kept_store):
    import pickle

    plan = str(tmp_path / "v.plan")
    repack(RepackConfig(store=kept_store, output_prefix=None, plan_only=plan, progress=False))
    ds = pickle.loads(pickle.dumps(VirtualPackedDataset(kept_store, plan)))
    assert len(ds) > 0 and ds[0].packed_len <= 4096
    other = preprocess(str(tmp_path / "o"), store=str(tmp_path / "s2"), inputs=CHAT[:1])
    assert other["conversations"] == 400
    with pytest.raises(ShardError, match="another sequence store"):
        VirtualPackedDataset(str(tmp_path / "s2"), plan)


def test_a_store_partition_cut_short_after_it_was_opened_is_an_error_naming_it(tmp_path, kept_store):
    """Store sequences are read with pread (no map): a partition truncated under a reader gives
    ShardError naming the partition, never short or stale packs."""
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(kept_store, store)
    plan = str(tmp_path / "v.plan")
    repack(RepackConfig(store=store, output_prefix=None, plan_only=plan, progress=False))
    ds = VirtualPackedDataset(store, plan)
    first = ds[0]
    parts = sorted(glob.glob(os.path.join(store, "parts", "part_*.bin")))
    parts = [p for p in parts if not p.endswith(".loss.bin") and not p.endswith(".seq.bin")]
    for path in parts:
        os.truncate(path, 0)
    with pytest.raises(ShardError, match="shorter than its index") as info:
        for i in range(len(ds)):
            ds[i]
    assert "part_" in str(info.value)
    assert first.packed_len > 0


class _Reporting:
    """A step whose units report their work in three parts before they finish."""

    name = "reporting"
    writes_to = "."

    def run(self, unit: int) -> dict:
        for part in (1, 2, 3):
            report_progress(10 * unit + part)
        return {"unit": unit}


@pytest.mark.parametrize("workers", [1, 2])
def test_units_report_progress_before_they_finish_in_process_and_in_workers(workers):
    events = []
    LocalEngine(workers).map(_Reporting(), [1, 2, 3], lambda r: events.append(("done", r["unit"])),
                             lambda unit, amount: events.append(("progress", unit, amount)))
    for unit in (1, 2, 3):
        mine = [e for e in events if e[1] == unit]
        assert mine == [("progress", unit, 10 * unit + p) for p in (1, 2, 3)] + [("done", unit)]
    report_progress(5)  # outside a unit: nobody listens, nothing happens


def test_tokenize_progress_moves_within_one_partition(tmp_path, monkeypatch):
    """A partition reports the bytes of every batch it encodes, so a run on one file smaller than
    --partition-bytes no longer shows 0 bytes until the end."""
    updates = []
    real_map = LocalEngine.map

    def spy(self, step, units, on_done, on_progress=None):
        wrapped = None if on_progress is None else (lambda u, a: (updates.append(a), on_progress(u, a)))
        return real_map(self, step, units, on_done, wrapped)

    monkeypatch.setattr(LocalEngine, "map", spy)
    preprocess(str(tmp_path / "o"), inputs=CHAT[:1], batch_size=16)
    size = os.path.getsize(CHAT[0])
    assert len(updates) > 10 and 0 < sum(updates) <= size


# ---------------------------------------------------------------- --store and --resume


def test_store_directory_is_refused_when_not_empty_unless_resumed(tmp_path):
    first = preprocess(str(tmp_path / "a"), store=str(tmp_path / "store"))
    with pytest.raises(ShardExistsError, match="--store directory is not empty"):
        preprocess(str(tmp_path / "b"), store=str(tmp_path / "store"))
    again = preprocess(str(tmp_path / "b"), store=str(tmp_path / "store"), resume=True)
    assert again["resumed_units"]["tokenize"] == 2 and again["resumed_units"]["index"] == 2
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b") and first["store"] == again["store"]
    with pytest.raises(ShardError, match="made with other tokenizer and encoding settings"):
        preprocess(str(tmp_path / "c"), store=str(tmp_path / "store"), resume=True, loss_on="all")


def test_resume_redoes_only_units_without_a_valid_receipt(tmp_path):
    """Receipts are the commit points: remove some (as a kill between a unit's artifacts and its
    receipt would leave them), corrupt an artifact of another, and --resume redoes exactly those."""
    kw = dict(store=str(tmp_path / "store"), partition_bytes=30_000, split=[90, 10], max_packs_per_shard=10)
    ref = preprocess(str(tmp_path / "ref"), **kw)
    n_parts = len(SequenceStore(str(tmp_path / "store")).partitions)
    rng = random.Random(3)
    drop = rng.sample(range(n_parts), 3)
    for k in drop:
        os.unlink(tmp_path / "store" / "receipts" / "tokenize" / f"{k:06d}.json")
    keep = [k for k in range(n_parts) if k not in drop]
    with open(tmp_path / "store" / "parts" / f"part_{keep[0]:06d}.rows", "ab") as f:
        f.write(b"\0" * 16)  # its size no longer matches the receipt: the unit is redone
    shutil.rmtree(tmp_path / "ref")
    again = preprocess(str(tmp_path / "ref"), **kw, resume=True)
    assert again["resumed_units"]["tokenize"] == n_parts - 4
    assert files_of(tmp_path / "ref") and again["outputs"] == ref["outputs"]
    preprocess(str(tmp_path / "fresh"), **{k: v for k, v in kw.items() if k != "store"})
    assert files_of(tmp_path / "fresh") == files_of(tmp_path / "ref")


# ---------------------------------------------------------------- docs/STORE.md states the layouts the code uses


def _doc_table(heading: str):
    """Rows of the first table after ``heading`` in docs/STORE.md, as lists of cell strings."""
    text = open(os.path.join(ROOT, "docs", "STORE.md"), encoding="utf-8").read()
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows


def test_store_md_rows_table_is_the_row_dtype():
    rows = _doc_table("`part_NNNNNN.rows`, one 16-byte record")
    fields = [(int(o), int(s), name) for o, s, _, name, _ in rows]
    assert fields == [(ROW_DTYPE.fields[n][1], ROW_DTYPE.fields[n][0].itemsize, n) for n in ROW_DTYPE.names]
    assert ROW_DTYPE.itemsize == 16


def test_store_md_plan_header_table_is_the_plan_header():
    from megatron_sft_idx.preprocess import planfile

    rows = _doc_table("## The pack plan")
    offsets = [(int(o), int(s)) for o, s, *_ in rows]
    assert offsets[-1][0] + offsets[-1][1] == planfile.HEADER_SIZE == planfile.HEADER.size == 64
    assert all(a[0] + a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    codes = planfile.HEADER.format.lstrip("<")
    sizes = {"8s": 8, "16s": 16, "H": 2, "I": 4, "Q": 8}
    assert [sizes[c] for c in re.findall(r"\d*s|[HIQ]", codes)] == [s for _, s in offsets]
    assert rows[0][4] == "MSFTPLN\\x00" and planfile.PLAN_MAGIC == b"MSFTPLN\x00"
