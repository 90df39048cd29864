"""Fuzzing the JSON run artifacts (issue 21, item 5): any value anywhere replaced, any key dropped.

Whatever a store descriptor, a receipt of any step, a finished run's record or a plan's metadata
holds, the tools that read it back end in one ShardError naming the file, or in success with
the bytes of a clean run -- never a KeyError/ValueError/TypeError/IndexError traceback. A refusal
is checked by its class and the file it concerns (``support.refusals.concerns``: any of the files
legitimately involved), not by one spelling of its message.
Hypothesis draws the mutation: a path into the JSON document (a random walk) and what to put
there (nothing, null, a bool, an integer of any size, a float, a string, a list, an object).
"""

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import stages
from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run
from megatron_sft_idx.preprocess.planfile import HEADER, HEADER_SIZE, PackPlan
from megatron_sft_idx.preprocess.store import SequenceStore
from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset

from support.refusals import concerns

# mutation sweeps over every run artifact (the fuzz of test_run_artifacts.py's cases): long, not the edit loop
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
SOURCE = os.path.join(ROOT, "examples", "conversations.jsonl")
SETTINGS = dict(tokenizer=TOKENIZER, pack_size=1024, split=[90, 10], max_packs_per_shard=20,
                partition_bytes=60_000, progress=False)

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.integers(-(2 ** 70), 2 ** 70),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
                   st.just([]), st.just({}), st.lists(st.integers(-1, 3), max_size=3))
MUTATION = st.tuples(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=6), st.booleans(), VALUES)


def mutate(doc, mutation):
    """Walk ``steps`` into ``doc`` (each step picks a child by index modulo its size), then drop
    what is there (``drop``) or put ``value`` in its place. Returns the mutated copy."""
    steps, drop, value = mutation
    doc = json.loads(json.dumps(doc))
    parent, key = None, None
    node = doc
    for step in steps:
        if isinstance(node, dict) and node:
            k = sorted(node)[step % len(node)]
        elif isinstance(node, list) and node:
            k = step % len(node)
        else:
            break
        parent, key, node = node, k, node[k]
    if parent is None:
        return value
    if drop and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = value
    return doc


def files_of(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".") and os.path.isfile(os.path.join(directory, n))} if os.path.isdir(directory) else {}


class Stop(KeyboardInterrupt):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A clean run (its outputs, kept store and a plan) and an interrupted run's pristine work directory."""
    d = tmp_path_factory.mktemp("fuzz")
    shutil.copyfile(SOURCE, d / "in.jsonl")
    cwd = os.getcwd()
    os.chdir(d)
    try:
        run(Config(inputs=["in.jsonl"], output_prefix=str(d / "ref" / "ds"), store=str(d / "store"), **SETTINGS))
        repack(RepackConfig(store=str(d / "store"), output_prefix=None, plan_only=str(d / "v.plan"), pack_size=1024,
                            split=[90, 10], max_packs_per_shard=20, progress=False))
        real = stages.publish

        def stop(*a, **k):
            raise Stop()

        stages.publish = stop
        try:
            with pytest.raises(Stop):
                run(Config(inputs=["in.jsonl"], output_prefix=str(d / "out" / "ds"), **SETTINGS))
        finally:
            stages.publish = real
    finally:
        os.chdir(cwd)
    shutil.copytree(d / "out" / ".ds.preprocess", d / "pristine")
    return d


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("artifact", ["store.json", "receipts/tokenize/000001.json", "receipts/index/000000.json"])
@FUZZ
@given(mutation=MUTATION)
def test_a_mutated_store_artifact_is_refused_by_name_or_changes_nothing(world, tmp_path_factory, artifact, mutation):
    store = tmp_path_factory.mktemp("s") / "store"
    shutil.copytree(world / "store", store)
    _write(store / artifact, mutate(json.load(open(world / "store" / artifact)), mutation))
    try:
        s = SequenceStore(str(store))
        s.verify()
        ds = VirtualPackedDataset(str(store), str(world / "v.plan"), split="valid")
    except ShardError as exc:   # by the store's reader, or by the plan's check against the store
        concerns(exc, store, world / "v.plan")
        return
    ref = VirtualPackedDataset(str(world / "store"), str(world / "v.plan"), split="valid")
    for i in range(len(ref)):
        assert all(np.array_equal(x, y) for x, y in zip(ds[i], ref[i]))


@FUZZ
@given(mutation=MUTATION)
def test_a_mutated_store_json_with_its_id_recomputed_is_refused_by_name_or_changes_nothing(world, tmp_path_factory,
                                                                                            mutation):
    """The store id is the digest of store.json's content, so most edits are caught by it; here
    the id (and every receipt's key) is recomputed, and the strict types and ranges must hold."""
    from megatron_sft_idx.preprocess.receipts import settings_key

    store = tmp_path_factory.mktemp("s") / "store"
    shutil.copytree(world / "store", store)
    doc = mutate(json.load(open(world / "store" / "store.json")), mutation)
    if isinstance(doc, dict) and all(k in doc for k in ("format", "version", "identity", "inputs", "partitions")):
        doc["store_id"] = settings_key({k: doc[k] for k in ("format", "version", "identity", "inputs", "partitions")})
        for name in os.listdir(store / "receipts" / "tokenize"):
            receipt = json.load(open(store / "receipts" / "tokenize" / name))
            _write(store / "receipts" / "tokenize" / name, dict(receipt, key=doc["store_id"]))
    _write(store / "store.json", doc)
    try:
        s = SequenceStore(str(store))
        s.verify()
        ds = VirtualPackedDataset(str(store), str(world / "v.plan"), split="valid")
    except ShardError as exc:   # by the store's reader, or by the plan's check against the store
        concerns(exc, store, world / "v.plan")
        return
    ref = VirtualPackedDataset(str(world / "store"), str(world / "v.plan"), split="valid")
    for i in range(len(ref)):
        assert all(np.array_equal(x, y) for x, y in zip(ds[i], ref[i]))


def _rewrite_plan_metadata(src, dst, metadata):
    data = open(src, "rb").read()
    fields = list(HEADER.unpack(data[:HEADER_SIZE]))
    meta = json.dumps(metadata).encode()
    body = data[HEADER_SIZE:fields[4]] + meta
    fields[5], fields[6] = len(meta), HEADER_SIZE + len(body)
    fields[8] = zlib.crc32(body)
    head = HEADER.pack(*fields)
    open(dst, "wb").write(head[:60] + struct.pack("<I", zlib.crc32(head[:60])) + body)


@FUZZ
@given(mutation=MUTATION)
def test_a_mutated_plan_metadata_is_refused_by_name_or_serves_the_same_packs(world, tmp_path_factory, mutation):
    plan = str(tmp_path_factory.mktemp("p") / "v.plan")
    _rewrite_plan_metadata(world / "v.plan", plan, mutate(PackPlan(str(world / "v.plan")).metadata, mutation))
    try:
        ds = VirtualPackedDataset(str(world / "store"), plan, split="valid")
    except ShardError as exc:   # by the plan's reader, or by its check against the store it names
        concerns(exc, plan, world / "store")
        return
    ref = VirtualPackedDataset(str(world / "store"), str(world / "v.plan"), split="valid")
    assert len(ds) == len(ref)
    for i in range(len(ref)):
        assert all(np.array_equal(x, y) for x, y in zip(ds[i], ref[i]))


WORK_ARTIFACTS = ["store/store.json", "store/receipts/tokenize/000000.json", "receipts/plan/000000.json",
                  "receipts/materialize/000002.json", "receipts/checks/000000.json", "receipts/intent/000000.json"]


@pytest.mark.parametrize("artifact", WORK_ARTIFACTS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATION)
def test_resume_over_a_mutated_receipt_redoes_or_names_it(world, monkeypatch, artifact, mutation):
    work = world / "out" / ".ds.preprocess"
    shutil.rmtree(world / "out")
    shutil.copytree(world / "pristine", work)
    _write(work / artifact, mutate(json.load(open(world / "pristine" / artifact)), mutation))
    monkeypatch.chdir(world)
    try:
        run(Config(inputs=["in.jsonl"], output_prefix=str(world / "out" / "ds"), resume=True, **SETTINGS))
    except ShardError as exc:   # the work directory's artifacts, the input, the output prefix
        concerns(exc, world / "out", world / "in.jsonl")
        assert files_of(world / "out") == {}
        return
    assert files_of(world / "out") == files_of(world / "ref")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATION)
def test_resume_of_a_finished_run_with_a_mutated_record_is_a_no_op_a_redo_or_a_named_error(world, monkeypatch,
                                                                                             capsys, mutation):
    """The record of a finished run is read back too, and its summary printed as a table."""
    from megatron_sft_idx.preprocess.cli import main

    monkeypatch.chdir(world)
    argv = ["--input", "in.jsonl", "--tokenizer", TOKENIZER, "--output-prefix", str(world / "done" / "ds"),
            "--pack-size", "1024", "--split", "90,10", "--max-packs-per-shard", "20", "--partition-bytes", "60000"]
    record = world / "done" / ".ds.preprocess" / "receipts" / "done" / "000000.json"
    if not record.exists():
        assert main(argv + ["--quiet"]) == 0
        shutil.copyfile(record, world / "record.json")
    _write(record, mutate(json.load(open(world / "record.json")), mutation))
    code = main(argv + ["--resume"])
    err = capsys.readouterr().err
    assert code in (0, 1) and "Traceback" not in err and "this is a bug" not in err, err
    assert files_of(world / "done") == files_of(world / "ref")
    shutil.copyfile(world / "record.json", record)   # (the next example starts from the real record)
