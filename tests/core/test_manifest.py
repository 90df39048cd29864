"""Manifests parsed as strictly as a shard header (issue 21, item 5 for manifests): every
malformed document -- a wrong type, a value out of range, a missing key, a summary that
contradicts itself or its entry, a shard listed twice, an identity that disagrees with its
summary, numbers beyond int64, NaN, deep nesting, bytes that are not UTF-8, a file beyond
the size limit -- is one ShardError naming the file and the field, never another exception;
a hypothesis fuzz of mutated manifests holds the same line."""

import copy
import json
import os
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.refusals import concerns
from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx import manifest as M  # the format module (training.manifest is another name of it)
from megatron_sft_idx.multi import MultiShardDataset, read_manifest
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.publishing import write_manifest


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A real manifest of a whole 3-shard set, and its parsed JSON."""
    d = tmp_path_factory.mktemp("manifest")
    rng = np.random.default_rng(4)
    for i in range(3):
        write_shard(str(d / f"ds_{i:06d}"), random_packs(rng, 5 + i, pack_size=32), pack_size=32, vocab_size=1000,
                    metadata={"set": {"id": "s" * 32, "index": i, "count": 3, "name": "train"},
                              "tokenizer": {"name": "t", "files_sha256": "1" * 64}})
    path = d / "ds.json"
    write_manifest(str(path), str(d))
    return path, json.loads(path.read_text())


def _write(written, obj=None, raw=None):
    """The document as a manifest beside the shards (so its relative prefixes resolve)."""
    target = written[0].parent / f"case_{uuid.uuid4().hex}.json"
    target.write_bytes(raw if raw is not None else json.dumps(obj).encode())
    return target


def edit(doc, where, value):
    """``doc`` with the value at dotted ``where`` (``shards.0.summary.token_count``) replaced;
    ``...`` deletes the key."""
    doc = copy.deepcopy(doc)
    keys = where.split(".")
    target = doc
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = int(keys[-1]) if isinstance(target, list) else keys[-1]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return doc


CASES = [  # (dotted place, new value, field the error names)
    ("format", "other.manifest", "format"),
    ("version", 2, "version"),
    ("version", True, "version"),
    ("version", ..., "version"),
    ("shards", [], "shards"),
    ("shards", {"a": 1}, "shards"),
    ("shards.1", "ds_000001", "shards[1]"),
    ("shards.1.prefix", 7, "shards[1].prefix"),
    ("shards.1.prefix", "", "shards[1].prefix"),
    ("shards.1.prefix", "ds_\u0000x", "shards[1].prefix"),
    ("shards.1.prefix", ..., "shards[1].prefix"),
    ("shards.2.prefix", "ds_000000", "shards[2].prefix"),            # listed twice
    ("shards.2.prefix", "./sub/../ds_000000", "shards[2].prefix"),   # twice, spelled otherwise
    ("shards.1.packs", 0, "shards[1].packs"),
    ("shards.1.packs", -3, "shards[1].packs"),
    ("shards.1.packs", "6", "shards[1].packs"),
    ("shards.1.packs", 6.0, "shards[1].packs"),
    ("shards.1.packs", True, "shards[1].packs"),
    ("shards.1.packs", 7, "shards[1].summary.pack_count"),            # != summary.pack_count
    ("shards.1.summary", None, "shards[1].summary"),
    ("shards.1.summary", [], "shards[1].summary"),
    ("shards.1.summary.token_count", "12", "shards[1].summary.token_count"),
    ("shards.1.summary.token_count", -1, "shards[1].summary.token_count"),
    ("shards.1.summary.token_count", ..., "shards[1].summary.token_count"),
    ("shards.1.summary.token_count", 1, "shards[1].summary.token_count"),  # < sequence_count
    ("shards.1.summary.sequence_count", 1, "shards[1].summary.sequence_count"),  # < pack_count
    ("shards.1.summary.max_samples_per_bin", 0, "shards[1].summary.max_samples_per_bin"),
    ("shards.1.summary.min_packed_seqlen", 0, "shards[1].summary.min_packed_seqlen"),
    ("shards.1.summary.max_packed_seqlen", 33, "shards[1].summary.max_packed_seqlen"),  # > pack_size 32
    ("shards.1.summary.dataset_max_seqlen", 100, "shards[1].summary.dataset_max_seqlen"),
    ("shards.1.summary.min_packed_runtime_len", 10 ** 6, "shards[1].summary.min_packed_runtime_len"),
    ("shards.1.summary.pad_layout", "both", "shards[1].summary.pad_layout"),
    ("shards.1.summary.pad_seq_to_mult", 0, "shards[1].summary.pad_seq_to_mult"),
    ("shards.1.identity", [], "shards[1].identity"),
    ("shards.1.identity.token_dtype", "int8", "shards[1].identity.token_dtype"),
    ("shards.1.identity.vocab_size", 0, "shards[1].identity.vocab_size"),
    ("shards.1.identity.vocab_size", ..., "shards[1].identity.vocab_size"),
    ("shards.1.identity.pad_seq_to_mult", 2, "shards[1].identity.pad_seq_to_mult"),  # summary says 1
    ("shards.1.identity.pad_layout", "runtime", "shards[1].identity.pad_layout"),      # summary says stored
    ("shards.1.identity.tokenizer", "t", "shards[1].identity.tokenizer"),
    ("shards.1.identity.set", 3, "shards[1].identity.set"),
    ("shards.1.identity.set.index", 3, "shards[1].identity.set.index"),
    ("shards.1.identity.set.count", 0, "shards[1].identity.set.count"),
    ("shards.1.identity.set.id", "", "shards[1].identity.set.id"),
    ("shards.1.identity.kind", "rl", "shards[1].identity.kind"),
    # cross-entry rules: one entry's identity moved to another set or tokenizer
    ("shards.1.identity.set.id", "z" * 32, "set"),
    ("shards.1.identity.set.index", 0, "set.index"),
    ("shards.1.identity.tokenizer", {"name": "u", "files_sha256": "2" * 64}, "tokenizer"),
]


@pytest.mark.parametrize("where, value, field", CASES, ids=[f"{w}={v!r}"[:60] for w, v, _ in CASES])
def test_each_malformed_manifest_is_one_named_error(tmp_path, written, where, value, field):
    path = _write(written, edit(written[1], where, value))
    for read in (read_manifest, M.load_manifest, open_packed, MultiShardDataset.open):
        with pytest.raises(ShardError) as info:
            read(str(path))
        err = info.value
        assert err.field == field, (read, str(err))
        assert err.path in (str(path), str(path.parent / "ds_000000"), str(path.parent / "ds_000001"),
                            str(path.parent / "ds_000002")), str(err)
        assert "\n" not in str(err)


@pytest.mark.parametrize("raw, words", [
    (b"\xff\xfe{}", "not valid JSON"),
    (b'{"format": "megatron_sft_idx.manifest", "version": 1, "shards": [', "not valid JSON"),
    (b'{"format": "megatron_sft_idx.manifest", "version": NaN, "shards": []}', "not valid JSON"),
    (b'{"version": 99999999999999999999999}', "exceeds"),
    (b'{"version": 1e999}', "exceeds"),
    (b"[" * 200 + b"]" * 200, "exceeds"),
    (b"[]", "not a megatron_sft_idx manifest"),
    (b'"megatron_sft_idx.manifest"', "not a megatron_sft_idx manifest"),
])
def test_bytes_that_are_not_a_manifest(tmp_path, written, raw, words):
    path = _write(written, raw=raw)
    with pytest.raises(ShardError, match=words) as info:
        read_manifest(str(path))
    assert info.value.path == str(path)


def test_a_manifest_beyond_the_size_limit_is_refused_before_it_is_parsed(tmp_path, written, monkeypatch):
    monkeypatch.setattr(M, "MAX_MANIFEST_BYTES", 1000)
    doc = dict(written[1], padding="x" * 2000)
    path = _write(written, doc)
    with pytest.raises(ShardError, match="larger than") as info:
        read_manifest(str(path))
    assert info.value.field == "manifest"


def test_unknown_keys_are_ignored_and_an_old_manifest_still_reads(tmp_path, written):
    doc = copy.deepcopy(written[1])
    doc["written_by"] = "someone"
    for entry in doc["shards"]:
        entry["note"] = {"anything": [1, 2]}
    assert len(open_packed(str(_write(written, doc)))) == 18
    old = copy.deepcopy(written[1])  # as written before identities: the reader opens the shards to check
    for entry in old["shards"]:
        del entry["identity"]
    path = _write(written, old)
    ds = open_packed(str(path))
    assert len(ds) == 18 and ds.open_shards == [0, 1, 2]
    partial = copy.deepcopy(old)
    partial["shards"].pop(0)
    with pytest.raises(ShardError, match="incomplete"):
        open_packed(str(_write(written, partial)))


def test_a_written_manifest_opens_with_one_read(written):
    ds = open_packed(str(written[0]))
    assert len(ds) == 18 and ds.open_shards == []
    assert [e["identity"]["set"]["index"] for e in written[1]["shards"]] == [0, 1, 2]


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                             st.integers(), max_size=2))


def _places(doc, prefix=""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + k
            yield from _places(v, prefix + k + ".")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix + str(i)
            yield from _places(v, prefix + str(i) + ".")


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzzed_manifests_give_a_dataset_or_a_shard_error(written, data):
    doc = copy.deepcopy(written[1])
    places = sorted(set(_places(doc)))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(places))
        try:
            doc = edit(doc, where, data.draw(st.one_of(VALUES, st.just(...))))
        except (KeyError, IndexError, TypeError, ValueError):  # an earlier edit removed the place
            continue
    path = _write(written, doc)
    try:
        ds = open_packed(str(path))
    except ShardError as exc:   # the manifest, or a shard it lists (wherever the mutation put it)
        shards = doc.get("shards") if isinstance(doc, dict) else None
        named = [os.path.join(str(path.parent), e["prefix"]) for e in shards or ()
                 if isinstance(e, dict) and isinstance(e.get("prefix"), str)] if isinstance(shards, list) else []
        concerns(exc, written[0].parent, *named)
        return
    for i in range(len(ds)):  # what opened reads every pack, or names the stale entry
        try:
            ds[i]
        except ShardError:
            break


RECORD = M.OrderRecord(file="ds.order", size=4096, crc32=123, seed=1234, epochs=1, first_epoch=0,
                       topology={"data_parallel_size": 2, "micro_batch_size": 1, "global_batch_size": 4},
                       cost_model={"linear": 1.0, "attention": 0.5}, exchange_window=1)


def test_the_order_record_is_written_and_read_back_typed(written):
    """A set's balanced order record is an OrderRecord on both sides: manifest_document writes
    its fields under "order", parse_manifest gives it back equal; no order, None."""
    from megatron_sft_idx.reader import MMapIndexedDataset

    d = written[0].parent
    members = [(str(d / f"ds_{i:06d}"), MMapIndexedDataset(str(d / f"ds_{i:06d}"))) for i in range(3)]
    document = M.manifest_document(str(d / "ds.json"), members, order=RECORD)
    assert document["order"] == RECORD.to_dict()
    path = _write(written, raw=M.encode_manifest(document))
    assert M.load_manifest(str(path)).order == RECORD
    assert M.load_manifest(str(written[0])).order is None


@pytest.mark.parametrize("where, value, field", [
    ("order", [], "order"), ("order.size", "4096", "order.size"), ("order.size", 0, "order.size"),
    ("order.crc32", 1 << 32, "order.crc32"), ("order.file", "../x.order", "order.file"),
    ("order.file", ..., "order.file"), ("order.epochs", 0, "order.epochs"), ("order.topology", 2, "order.topology"),
    ("order.exchange_window", True, "order.exchange_window")])
def test_a_malformed_order_record_is_one_named_error(written, where, value, field):
    doc = edit(dict(written[1], order=RECORD.to_dict()), where, value)
    with pytest.raises(ShardError) as info:
        M.load_manifest(str(_write(written, doc)))
    assert info.value.field == field
