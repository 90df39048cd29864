"""Tampered run artifacts (issue 21, items 3-5): a named error or a redo, never other bytes.

A family, not examples: every artifact a run reads back (store partitions and their rows, the
store descriptor, receipts of every step, the pack plan, staged shards, inputs edited in place
keeping their size and mtime) x every way of tampering with it (one bit flipped at the same
size, cut short, deleted, a value changed, a key dropped or mistyped, garbage, rewritten whole
with its own checksums recomputed). Each case tampers with a real interrupted run's files and
then runs the real entry point:

* ``preprocess-sft --resume`` (its own store, and a kept ``--store``): it redoes what does not
  verify, or stops with one ShardError naming the file; what it publishes equals, byte for
  byte, a clean run's on the inputs as they are now;
* ``repack-sft`` and ``VirtualPackedDataset`` on a tampered store or plan: a ShardError naming
  the file, or packs equal to the clean ones -- never a KeyError/ValueError/TypeError/IndexError.
"""

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from megatron_sft_idx.builder import IndexedDatasetBuilder
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import stages
from megatron_sft_idx.preprocess.materialize import MaterializeStep
from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run
from megatron_sft_idx.preprocess.planfile import HEADER, HEADER_SIZE, PackPlan
from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset
from megatron_sft_idx.reader import MMapIndexedDataset

from support.faults import run_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
SOURCE = os.path.join(ROOT, "examples", "conversations.jsonl")
SETTINGS = dict(tokenizer=TOKENIZER, pack_size=1024, split=[90, 10], max_packs_per_shard=20,
                partition_bytes=60_000, progress=False)
INPUT = "in.jsonl"   # relative: shards record the input as given, so every case's bytes compare


def files_of(directory):
    """{name: bytes} of the published files (the run's hidden record excluded)."""
    if not os.path.isdir(directory):
        return {}
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".") and os.path.isfile(os.path.join(directory, n))}


def preprocess(out, **kw):
    return run(Config(inputs=[INPUT], output_prefix=str(out / "ds"), **{**SETTINGS, **kw}))


class Stop(KeyboardInterrupt):
    """An interruption injected at a chosen step (the run keeps its work directory)."""


def interrupted(monkeypatch, out, where, **kw):
    """A run stopped before ``where`` ("materialize": after the plan; "publish": after the checks)."""
    def stop(*args, **kwargs):
        raise Stop()

    with monkeypatch.context() as m:
        if where == "materialize":
            m.setattr(MaterializeStep, "run", stop)
        else:
            m.setattr(stages, "publish", stop)
        with pytest.raises(Stop):
            preprocess(out, **kw)
    assert files_of(out) == {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A clean run's outputs (and its kept store) on the input as given."""
    d = tmp_path_factory.mktemp("ref")
    shutil.copyfile(SOURCE, d / INPUT)
    cwd = os.getcwd()
    os.chdir(d)
    try:
        preprocess(d / "out", store=str(d / "store"))
    finally:
        os.chdir(cwd)
    return d


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh directory holding the input, as the working directory."""
    shutil.copyfile(SOURCE, tmp_path / INPUT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- tampering


def flip(path, at=0.5):
    """One bit flipped in the middle of the file (same size); the mtime is kept."""
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[int(len(data) * at)] ^= 1
    open(path, "wb").write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def truncate(path):
    os.truncate(path, os.path.getsize(path) - 3)


def edit_json(path, change):
    body = json.load(open(path))
    change(body)
    open(path, "w").write(json.dumps(body))


def garbage(path):
    open(path, "w").write('{"key": ')


def rewrite_partition(prefix):
    """The partition rebuilt with one token changed: a well-formed shard with fresh checksums."""
    ds = MMapIndexedDataset(prefix)
    arrays = ds.arrays()
    tokens = np.array(arrays.tokens, dtype=np.int64)
    mask = np.array(arrays.loss_mask)
    tokens[tokens.size // 2] = (tokens[tokens.size // 2] + 1) % ds.metadata.vocab_size
    meta = {k: v for k, v in ds.metadata.to_dict().items() if k in ("tokenizer", "source", "extra")}
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    del ds, arrays
    with IndexedDatasetBuilder(prefix, vocab_size=1024, pack_size=None, metadata=meta, overwrite=True) as b:
        b.add_sequences(tokens, mask, lengths)


def rewrite_plan(path, change):
    """``change(arrays of split 0)`` applied to a plan file whose checksums are then recomputed."""
    data = bytearray(open(path, "rb").read())
    plan = PackPlan(path)
    arrays = {k: np.array(v) for k, v in plan.arrays(0).items()}
    change(arrays)
    for name, (offset, count, dtype) in plan.splits[0]["arrays"].items():
        raw = arrays[name].astype(dtype).tobytes()
        data[offset:offset + len(raw)] = raw
    del plan
    fields = list(HEADER.unpack(bytes(data[:HEADER_SIZE])))
    fields[8] = zlib.crc32(bytes(data[HEADER_SIZE:]))
    head = HEADER.pack(*fields)
    data[:HEADER_SIZE] = head[:60] + struct.pack("<I", zlib.crc32(head[:60]))
    open(path, "wb").write(bytes(data))


def swap_ids(a):
    """Two sequences of the first two packs exchanged (ids stay in range; packs stay sorted)."""
    ids, off = a["sequence_ids"], a["pack_offsets"]
    i, j = int(off[0]), int(off[1])
    ids[i], ids[j] = ids[j], ids[i]
    for p in (0, 1):
        ids[off[p]:off[p + 1]] = np.sort(ids[off[p]:off[p + 1]])


def edit_input_in_place(path):
    """One character of a conversation changed, the file's size and mtime kept (cp -p, rsync -t)."""
    st = os.stat(path)
    data = open(path, "rb").read()
    at = data.index(b"numpy arrays store numbers")
    data = data[:at] + b"NUMPY" + data[at + 5:]
    open(path, "wb").write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


PART = os.path.join("parts", "part_000001")
STORE_CASES = {
    "partition .bin bit": lambda s: flip(s / (PART + ".bin")),
    "partition .loss.bin bit": lambda s: flip(s / (PART + ".loss.bin")),
    "partition .idx bit": lambda s: flip(s / (PART + ".idx"), at=0.9),
    "partition .seq.idx bit": lambda s: flip(s / (PART + ".seq.idx"), at=0.3),
    "partition .seq.bin bit": lambda s: flip(s / (PART + ".seq.bin")),
    "partition rows length bit": lambda s: flip(s / (PART + ".rows"), at=0.5 - 8 / os.path.getsize(s / (PART + ".rows"))),
    "partition rows line bit": lambda s: flip(s / (PART + ".rows"), at=0.0),
    "partition rewritten with its checksums": lambda s: rewrite_partition(str(s / PART)),
    "partition .bin cut short": lambda s: truncate(s / (PART + ".bin")),
    "partition .bin deleted": lambda s: os.unlink(s / (PART + ".bin")),
    "store.json key missing": lambda s: edit_json(s / "store.json", lambda b: b["identity"]["encode"].pop("vocab_size")),
    "store.json key mistyped": lambda s: edit_json(s / "store.json", lambda b: b["identity"].update(max_record_bytes="2M")),
    "store.json value changed": lambda s: edit_json(s / "store.json", lambda b: b["inputs"][0].update(bytes=7)),
    "store.json partition mistyped": lambda s: edit_json(s / "store.json", lambda b: b["partitions"][1].__setitem__(2, "0")),
    "store.json garbage": lambda s: garbage(s / "store.json"),
    "store.json cut short": lambda s: truncate(s / "store.json"),
    "tokenize receipt count is a string":
        lambda s: edit_json(s / "receipts/tokenize/000001.json", lambda b: b.update(sequences=str(b["sequences"]))),
    "tokenize receipt count changed":
        lambda s: edit_json(s / "receipts/tokenize/000001.json", lambda b: b.update(sequences=b["sequences"] + 1)),
    "tokenize receipt key dropped": lambda s: edit_json(s / "receipts/tokenize/000001.json", lambda b: b.pop("tokens")),
    "tokenize receipt crc changed":
        lambda s: edit_json(s / "receipts/tokenize/000001.json",
                            lambda b: b["crc32"].update({k: v ^ 1 for k, v in b["crc32"].items()})),
    "tokenize receipt garbage": lambda s: garbage(s / "receipts/tokenize/000001.json"),
    "index receipt sha256 changed":
        lambda s: edit_json(s / "receipts/index/000000.json", lambda b: b.update(sha256="0" * 64)),
    "index receipt partitions mistyped":
        lambda s: edit_json(s / "receipts/index/000000.json", lambda b: b.update(partitions="all")),
}

WORK = ".ds.preprocess"
WORK_CASES = {  # artifacts of the run's work directory, after the plan (before materialize)
    "plan bit": lambda w: flip(w / "plan" / "out.plan", at=0.3),
    "plan cut short": lambda w: truncate(w / "plan" / "out.plan"),
    "plan deleted": lambda w: os.unlink(w / "plan" / "out.plan"),
    "plan ids out of range, checksums recomputed":
        lambda w: rewrite_plan(w / "plan" / "out.plan", lambda a: a["sequence_ids"].__setitem__(0, 10 ** 6)),
    "plan ids not ascending, checksums recomputed":
        lambda w: rewrite_plan(w / "plan" / "out.plan", lambda a: a["sequence_ids"].__setitem__(
            slice(int(a["pack_offsets"][1]) - 2, int(a["pack_offsets"][1])),
            a["sequence_ids"][int(a["pack_offsets"][1]) - 2:int(a["pack_offsets"][1])][::-1].copy())),
    "plan offsets not monotonic, checksums recomputed":
        lambda w: rewrite_plan(w / "plan" / "out.plan", lambda a: a["pack_offsets"].__setitem__(1, 0)),
    "plan sequences swapped between packs, checksums recomputed":
        lambda w: rewrite_plan(w / "plan" / "out.plan", swap_ids),
    "plan receipt count is a string":
        lambda w: edit_json(w / "receipts/plan/000000.json", lambda b: b.update(conversations="many")),
    "plan receipt packs changed":
        lambda w: edit_json(w / "receipts/plan/000000.json", lambda b: b["splits"][0].update(packs=1)),
    "plan receipt garbage": lambda w: garbage(w / "receipts/plan/000000.json"),
}

STAGED_CASES = {  # artifacts of the run's work directory, after the checks (before publish)
    "staged .bin bit": lambda w: flip(w / "staged" / "ds_train_000001.bin"),
    "staged .seq.idx bit": lambda w: flip(w / "staged" / "ds_train_000001.seq.idx", at=0.2),
    "staged .bin deleted": lambda w: os.unlink(w / "staged" / "ds_train_000001.bin"),
    "materialize receipt packs changed":
        lambda w: edit_json(w / "receipts/materialize/000001.json", lambda b: b.update(packs=b["packs"] + 1)),
    "materialize receipt metadata mistyped":
        lambda w: edit_json(w / "receipts/materialize/000001.json", lambda b: b["metadata"]["stats"].update(pack_count="20")),
    "materialize receipt final changed":
        lambda w: edit_json(w / "receipts/materialize/000001.json", lambda b: b.update(final="/elsewhere/x")),
    "materialize receipt garbage": lambda w: garbage(w / "receipts/materialize/000001.json"),
    "checks receipt mistyped": lambda w: edit_json(w / "receipts/checks/000000.json", lambda b: b.update(gate="yes")),
    "intent receipt mistyped": lambda w: edit_json(w / "receipts/intent/000000.json", lambda b: b.update(files=[1])),
}


def _named(exc: ShardError, *where) -> None:
    assert isinstance(exc, ShardError) and exc.path, exc
    assert not where or any(str(w) in str(exc) for w in where), exc


# --------------------------------------------------------------------------- preprocess-sft --resume


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_resume_over_a_tampered_store_of_its_own_redoes_it(here, reference, monkeypatch, case):
    interrupted(monkeypatch, here / "out", "materialize")
    STORE_CASES[case](here / "out" / WORK / "store")
    preprocess(here / "out", resume=True)
    assert files_of(here / "out") == files_of(reference / "out")
    assert run_leftovers(here / "out") == []


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_resume_over_a_tampered_kept_store_redoes_it_or_names_it(here, reference, monkeypatch, case):
    interrupted(monkeypatch, here / "out", "materialize", store=str(here / "store"))
    STORE_CASES[case](here / "store")
    try:
        preprocess(here / "out", store=str(here / "store"), resume=True)
    except ShardError as exc:   # a --store that is not this run's own is not rebuilt
        assert case.startswith("store.json"), exc
        _named(exc, here / "store")
        assert files_of(here / "out") == {}
        return
    assert files_of(here / "out") == files_of(reference / "out")


@pytest.mark.parametrize("case", sorted(WORK_CASES))
def test_resume_over_a_tampered_plan_redoes_it(here, reference, monkeypatch, case):
    interrupted(monkeypatch, here / "out", "materialize")
    WORK_CASES[case](here / "out" / WORK)
    preprocess(here / "out", resume=True)
    assert files_of(here / "out") == files_of(reference / "out")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STAGED_CASES))
def test_resume_over_tampered_staged_shards_and_receipts_redoes_them(here, reference, monkeypatch, case):
    interrupted(monkeypatch, here / "out", "publish", check=True)
    STAGED_CASES[case](here / "out" / WORK)
    preprocess(here / "out", resume=True, check=True)
    assert files_of(here / "out") == files_of(reference / "out")


@pytest.mark.parametrize("where", ["materialize", "publish"])
@pytest.mark.parametrize("store", [False, True])
def test_resume_after_an_input_edited_in_place_keeping_size_and_mtime(here, monkeypatch, where, store):
    """The run proves its inputs by content (sha256), not by size and mtime: a resumed run
    whose input changed publishes exactly what a clean run on the changed input publishes
    (its own store is rebuilt), or refuses a kept --store made from the old bytes by name."""
    kw = dict(store=str(here / "store")) if store else {}
    interrupted(monkeypatch, here / "out", where, **kw)
    edit_input_in_place(here / INPUT)
    if store:
        with pytest.raises(ShardError, match="is not the file it was made from") as e:
            preprocess(here / "out", resume=True, **kw)
        _named(e.value, here / "store")
        assert files_of(here / "out") == {}
        return
    preprocess(here / "out", resume=True)
    clean = here / "clean"
    preprocess(clean)
    assert files_of(here / "out") == files_of(clean)
    meta = MMapIndexedDataset(str(here / "out" / "ds_train_000000")).metadata
    assert meta.source["inputs"][0]["sha256"] == MMapIndexedDataset(str(clean / "ds_train_000000")).metadata.source[
        "inputs"][0]["sha256"]


def test_resume_of_a_finished_run_whose_input_changed_runs_again(here, reference):
    preprocess(here / "out")
    edit_input_in_place(here / INPUT)
    s = preprocess(here / "out", resume=True)
    assert s["resumed_units"] != {"done": 1}
    clean = here / "clean"
    preprocess(clean)
    assert files_of(here / "out") == files_of(clean) != files_of(reference / "out")


# --------------------------------------------------------------------------- repack-sft and virtual packs


@pytest.fixture
def store_copy(reference, tmp_path):
    shutil.copytree(reference / "store", tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_repack_of_a_tampered_store_is_a_named_error(store_copy, reference, tmp_path, monkeypatch, case):
    STORE_CASES[case](store_copy)
    monkeypatch.chdir(reference)   # (the input as the store names it, for the clean comparison)
    cfg = RepackConfig(store=str(store_copy), output_prefix=str(tmp_path / "r" / "ds"), pack_size=1024,
                       split=[90, 10], max_packs_per_shard=20, progress=False)
    try:
        repack(cfg)
    except ShardError as exc:
        _named(exc, store_copy)
        assert files_of(tmp_path / "r") == {}
        return
    assert files_of(tmp_path / "r") == files_of(reference / "out")   # (a tamper that changes nothing used)


def _plan(store, path):
    repack(RepackConfig(store=str(store), output_prefix=None, plan_only=str(path), pack_size=1024, split=[90, 10],
                        max_packs_per_shard=20, progress=False))
    return path


@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_virtual_packs_of_a_tampered_store_are_a_named_error(store_copy, reference, tmp_path, case):
    plan = _plan(reference / "store", tmp_path / "v.plan")
    STORE_CASES[case](store_copy)
    try:
        ds = VirtualPackedDataset(str(store_copy), str(plan), split="train", shard=0)
    except ShardError as exc:
        _named(exc, store_copy)
        return
    real = MMapIndexedDataset(str(reference / "out" / "ds_train_000000"))
    for i in range(len(real)):
        assert all(np.array_equal(x, y) for x, y in zip(ds[i], real[i]))


VIRTUAL_PLAN_CASES = {k: v for k, v in WORK_CASES.items() if not k.startswith("plan receipt")
                      and "swapped" not in k and "deleted" not in k}


@pytest.mark.parametrize("case", sorted(VIRTUAL_PLAN_CASES))
def test_virtual_packs_of_a_tampered_plan_are_a_named_error(reference, tmp_path, case):
    work = tmp_path / "w"
    (work / "plan").mkdir(parents=True)
    _plan(reference / "store", work / "plan" / "out.plan")
    VIRTUAL_PLAN_CASES[case](work)
    with pytest.raises(ShardError) as e:
        VirtualPackedDataset(str(reference / "store"), str(work / "plan" / "out.plan"), split="train")
    _named(e.value, "out.plan")


def test_a_failed_resume_of_a_finished_run_keeps_its_record(here, reference):
    """A --resume that fails (here: the kept store was made with the input named otherwise)
    must not orphan the finished run's outputs: the same command as before is still a no-op."""
    store = str(here / "store")
    preprocess(here / "out", store=store)
    with pytest.raises(ShardError, match="named 'in.jsonl' in the store"):
        run(Config(inputs=[str(here / INPUT)], output_prefix=str(here / "out" / "ds"), store=store, resume=True,
                   **SETTINGS))
    assert preprocess(here / "out", store=store, resume=True)["resumed_units"] == {"done": 1}
    assert files_of(here / "out") == files_of(reference / "out") and run_leftovers(here / "out") == []


@pytest.mark.parametrize("case", ["plan sequences swapped between packs, checksums recomputed", "plan bit",
                                  "plan receipt packs changed"])
def test_repack_resume_over_a_tampered_plan_redoes_it(store_copy, reference, tmp_path, monkeypatch, case):
    """repack-sft runs the same pack stages as preprocess-sft, with the same verification on --resume."""
    cfg = dict(store=str(store_copy), output_prefix=str(tmp_path / "r" / "ds"), pack_size=1024, split=[90, 10],
               max_packs_per_shard=20, progress=False)
    with monkeypatch.context() as m:
        m.setattr(MaterializeStep, "run", lambda *a, **k: (_ for _ in ()).throw(Stop()))
        with pytest.raises(Stop):
            repack(RepackConfig(**cfg))
    WORK_CASES[case](tmp_path / "r" / WORK)
    s = repack(RepackConfig(resume=True, **cfg))
    assert s["resumed_units"]["plan"] == 0
    assert files_of(tmp_path / "r") == files_of(reference / "out")
