"""Every door that reads object storage, against a hostile S3 server.

The server (the ``hostile`` fixture of tests/conftest.py: moto behind bench/s3loop.py's proxy,
in a process of its own) stalls, trickles a byte at a time (body or headers), ignores ``Range``
or ``If-Match``, lies in ``Content-Range`` / ``Content-Length`` and lists forever. Every door —
``ds[i]`` and ``get_many`` on an ``s3://`` shard, opening one, ``open_packed`` (manifest,
directory, glob), the training adapters, a DataLoader worker, the gate, listings, and ``msc://``
— must end in a named error:

* within its documented budget (asserted: elapsed <= the operation budget + GRACE for thread
  scheduling on a loaded machine; this is the deadline, not a speed threshold), and every test
  also carries a pytest timeout, so a hang fails instead of holding the suite;
* at bounded memory (asserted with tracemalloc: the client's Python allocations stay far below
  the 23 MiB object that reading a whole response would have loaded — the server's memory is
  in its own process);
* and the same door reads correctly once the server behaves again.
"""

import json
import os
import time
import tracemalloc

import numpy as np
import pytest

from bench.s3loop import reset_clients
from conftest import HOSTILE_MAX_LIST_PAGES, HOSTILE_OPERATION_TIMEOUT
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset, open_packed
from megatron_sft_idx.errors import ObjectChangedError, RemoteTimeoutError, ResponseMismatchError, ShardError

pytestmark = pytest.mark.timeout(120)

OP = HOSTILE_OPERATION_TIMEOUT
#: What a failing call may take past its operation budget: the failures these tests guard against
#: are unbounded (a trickled body, a listing that never ends) or ~16 minutes (8 attempts x 120 s),
#: so a generous grace still tells them apart, and a loaded 2-core machine does not fail the test.
GRACE = 15.0
BUCKET = "hostile-reads"
SUFFIXES = (".bin", ".loss.bin", ".seq.bin", ".seq.idx", ".idx")
#: Python allocations one failing read may make; the big shard's .bin alone is 23 MiB.
MEMORY_BOUND = 4 << 20

# (id, proxy action, its options, the error, the field the error names)
GET_FAULTS = [
    ("stall", "stall", {}, RemoteTimeoutError, None),
    ("trickle", "trickle", {"interval": 0.5}, RemoteTimeoutError, None),
    ("trickle-headers", "trickle-headers", {"interval": 0.5}, RemoteTimeoutError, None),
    ("ignore-range", "ignore-range", {}, ResponseMismatchError, "status"),
    ("shift-range", "shift-range", {"amount": 2}, ResponseMismatchError, "Content-Range"),
    ("lie-content-range", "lie-content-range", {"amount": 2}, ResponseMismatchError, "Content-Range"),
    ("lie-content-length-longer", "lie-content-length", {"amount": 64}, ResponseMismatchError, "Content-Length"),
    ("lie-content-length-shorter", "lie-content-length", {"amount": -64}, ResponseMismatchError, "Content-Length"),
]
GET_IDS = [f[0] for f in GET_FAULTS]
# (id, proxy action, the error's field) for ListObjectsV2
LIST_FAULTS = [("same-token", "list-forever"), ("cycling-tokens", "list-cycle"),
               ("fresh-tokens", "list-fresh"), ("no-token", "list-no-token")]
LIST_IDS = [f[0] for f in LIST_FAULTS]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, hostile_server):
    """A small shard and a big one (23 MiB .bin), uploaded as they are to the hostile server."""
    root = tmp_path_factory.mktemp("hostile")
    small, big = str(root / "small"), str(root / "big")
    write_shard(small, random_packs(np.random.default_rng(0), 200, pack_size=256), pack_size=256, vocab_size=1000)
    write_shard(big, random_packs(np.random.default_rng(5), 3000, pack_size=4096, vocab=30000, full=True),
                pack_size=4096, vocab_size=30000)
    hostile_server.make_bucket(BUCKET)
    for prefix, key in ((small, "d/small"), (big, "d/big")):
        put(hostile_server, prefix, key)
    return {"small": small, "big": big}


def put(server, prefix, key, bucket=BUCKET):
    client = server.client()
    for suffix in SUFFIXES:
        with open(prefix + suffix, "rb") as f:
            client.put_object(Bucket=bucket, Key=key + suffix, Body=f.read())


def url(key):
    return f"s3://{BUCKET}/{key}"


def failing(call, error=ShardError, budget=OP, memory=False):
    """Run ``call``, which must raise ``error``; returns it after asserting the deadline (and
    with ``memory``, the bound on the Python memory allocated meanwhile)."""
    if memory:
        tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(error) as info:
            call()
    finally:
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
        if memory:
            tracemalloc.stop()
    assert elapsed <= budget + GRACE, f"took {elapsed:.1f} s, the budget is {budget} s: {info.value}"
    assert peak <= MEMORY_BOUND, f"allocated {peak >> 20} MiB while failing"
    return info.value


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- ds[i], get_many, open


@pytest.mark.parametrize("name,action,options,error,field", GET_FAULTS, ids=GET_IDS)
def test_a_pack_read_ends_in_a_named_error_within_budget_and_memory(hostile, shards, name, action, options,
                                                                    error, field):
    ds, ref = MMapIndexedDataset(url("d/big")), MMapIndexedDataset(shards["big"])
    hostile.inject(action, method="GET", suffix="/d/big.bin", times=1000, **options)
    exc = failing(lambda: ds[1234], error, memory=True)
    assert "s3://hostile-reads/d/big.bin" in str(exc) and (field is None or exc.field == field), exc
    if error is RemoteTimeoutError:
        assert exc.field in ("request_timeout", "operation_timeout") and "MEGATRON_SFT_IDX_" in str(exc)
    hostile.clear()
    assert same(ds[1234], ref[1234])  # the server behaves again: so does the reader


def test_a_batch_shares_one_deadline(hostile, shards):
    """get_many over 75 blocks apart (75 GETs, 8 at a time): they share one operation budget
    (of their bytes), where one budget each would take ten times as long."""
    from megatron_sft_idx.storage.config import StorageConfig

    ds = MMapIndexedDataset(url("d/big"))
    hostile.inject("stall", method="GET", suffix="/d/big.bin", times=10_000)
    packs = range(0, 3000, 40)  # 40 packs of 8 KiB: five 64 KiB blocks apart
    config = StorageConfig.resolve()
    budget = config.operation_seconds(len(packs) * 2 * config.block_size)  # each GET: a block and a pack's tail
    failing(lambda: ds.get_many(packs), RemoteTimeoutError, budget=budget)
    assert budget < len(packs) / config.concurrency * OP / 2  # what a budget per GET would allow, halved


@pytest.mark.parametrize("name,action,options,error,field", GET_FAULTS, ids=GET_IDS)
def test_opening_a_shard_ends_in_a_named_error(hostile, shards, name, action, options, error, field):
    """The index download at open (.seq.idx, then .idx) meets the same faults. An index file is
    downloaded whole, so a server ignoring Range answers exactly what was asked: it opens."""
    hostile.inject(action, method="GET", suffix="/d/small.seq.idx", times=1000, **options)
    if action == "ignore-range":
        assert same(MMapIndexedDataset(url("d/small"))[7], MMapIndexedDataset(shards["small"])[7])
        assert hostile.stats()["injected"] == {"ignore-range": 1}
        return
    exc = failing(lambda: MMapIndexedDataset(url("d/small")), error)
    assert "d/small.seq.idx" in str(exc) and (field is None or exc.field == field), exc
    hostile.clear()
    assert same(MMapIndexedDataset(url("d/small"))[7], MMapIndexedDataset(shards["small"])[7])


@pytest.mark.parametrize("name,action", LIST_FAULTS, ids=LIST_IDS)
def test_opening_a_shard_whose_listing_never_ends(hostile, shards, name, action):
    hostile.inject(action, method="GET", query="list-type=2", times=10_000)
    exc = failing(lambda: MMapIndexedDataset(url("d/small")), ResponseMismatchError)
    assert exc.field in ("Key", "NextContinuationToken", "max_list_pages"), exc


@pytest.mark.parametrize("target", ["stat", "head"])
@pytest.mark.parametrize("action", ["stall", "trickle-headers"])
def test_a_stalled_listing_or_head_ends_on_time(hostile, shards, target, action):
    if target == "stat":
        hostile.inject(action, method="GET", query="list-type=2", times=1000, interval=0.5)
    else:  # a manifest is found by HEAD
        hostile.inject(action, method="HEAD", suffix="/d/m.json", times=1000, interval=0.5)
    call = (lambda: MMapIndexedDataset(url("d/small"))) if target == "stat" else (lambda: open_packed(url("d/m.json")))
    failing(call, RemoteTimeoutError)


def test_a_changed_object_served_despite_if_match_is_refused(hostile, shards, tmp_path):
    """A gateway that ignores If-Match serves the re-uploaded object: the ETag tells, the pack
    is never a mix of two generations."""
    put(hostile, shards["small"], "e/s")
    ds = MMapIndexedDataset(url("e/s"))
    other = str(tmp_path / "other")
    write_shard(other, random_packs(np.random.default_rng(9), 200, pack_size=256), pack_size=256, vocab_size=1000)
    put(hostile, other, "e/s")
    hostile.inject("ignore-if-match", method="GET", times=1000)
    exc = failing(lambda: ds[3], ObjectChangedError)
    assert exc.field == "ETag" and "ignored If-Match" in str(exc)
    hostile.clear()
    with pytest.raises(ObjectChangedError):  # a faithful server refuses by If-Match itself (412)
        ds[3]
    assert same(MMapIndexedDataset(url("e/s"))[3], MMapIndexedDataset(other)[3])  # reopened: the new one


# --------------------------------------------------------------------------- open_packed and listings


def test_open_packed_manifest_directory_and_glob(hostile, shards, tmp_path):
    from megatron_sft_idx.publishing import publish

    local = []
    for k in range(2):
        local.append(str(tmp_path / f"a_{k:03d}"))
        write_shard(local[-1], random_packs(np.random.default_rng(k), 30, pack_size=256), pack_size=256,
                    vocab_size=1000)
    publish(local, url("set"), manifest="m.json")
    ref = [p for prefix in local for p in MMapIndexedDataset(prefix)]

    hostile.inject("stall", method="GET", suffix="/set/m.json", times=1000)
    failing(lambda: open_packed(url("set/m.json")), RemoteTimeoutError)
    hostile.clear()
    hostile.inject("ignore-range", method="GET", suffix="/set/m.json", times=1000)
    # The manifest is read whole, so a 200 carrying exactly it answers the range asked for.
    assert same(open_packed(url("set/m.json"))[31], ref[31])
    for spec in (url("set/"), url("set/a_*")):
        for _, action in LIST_FAULTS:
            hostile.clear()
            hostile.inject(action, method="GET", query="list-type=2", times=10_000)
            failing(lambda: open_packed(spec), ResponseMismatchError)
        hostile.clear()
        assert same(open_packed(spec)[45], ref[45])


@pytest.mark.parametrize("name,action", LIST_FAULTS, ids=LIST_IDS)
def test_listing_an_empty_prefix_forever_is_refused(hostile, shards, name, action):
    """No keys to repeat: the repeated token, or the page bound, ends it."""
    from megatron_sft_idx.storage.objects import store_for
    from megatron_sft_idx.storage.urls import ObjectURL
    from megatron_sft_idx.storage.config import StorageConfig

    hostile.inject(action, method="GET", query="list-type=2", times=10_000)
    store = store_for(ObjectURL.parse(url("nothing/")), StorageConfig.resolve())
    exc = failing(lambda: store.list(ObjectURL.parse(url("nothing/"))), ResponseMismatchError)
    expected = {"list-forever": "NextContinuationToken", "list-cycle": "NextContinuationToken",
                "list-fresh": "max_list_pages", "list-no-token": "NextContinuationToken"}[action]
    assert exc.field == expected, exc
    if action == "list-fresh":
        assert hostile.count("GET", f"/{BUCKET}") == HOSTILE_MAX_LIST_PAGES


def test_a_long_listing_pages_through(hostile, shards):
    """More keys than one page holds: every page taken, none twice (the guard lets it be)."""
    import concurrent.futures as futures

    client = hostile.client()
    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=f"many/k{k:05d}", Body=b"x"), range(1001)))
    from megatron_sft_idx.storage.objects import store_for
    from megatron_sft_idx.storage.urls import ObjectURL
    from megatron_sft_idx.storage.config import StorageConfig

    hostile.clear()
    listed = store_for(ObjectURL.parse(url("many/")), StorageConfig.resolve()).list(ObjectURL.parse(url("many/")))
    assert sorted(u.key for u, _ in listed) == [f"many/k{k:05d}" for k in range(1001)]
    assert hostile.count("GET", f"/{BUCKET}") == 2  # two pages


# --------------------------------------------------------------------------- training adapters


@pytest.mark.parametrize("action", ["stall", "ignore-range", "lie-content-length"])
def test_the_bridge_adapter(hostile, shards, action):
    pytest.importorskip("torch")
    from megatron_sft_idx.training.bridge import PackedSFTDataset

    ds = PackedSFTDataset(url("d/big"), max_num_samples=64, pad_to_max_length=True)
    hostile.inject(action, method="GET", suffix="/d/big.bin", times=1000, amount=64)
    failing(lambda: ds[17], RemoteTimeoutError if action == "stall" else ResponseMismatchError, memory=True)
    hostile.clear()
    ref = PackedSFTDataset(shards["big"], max_num_samples=64, pad_to_max_length=True)
    assert all(np.array_equal(ds[17][k], ref[17][k]) for k in ("input_ids", "loss_mask", "seq_boundaries"))


def test_the_megatron_adapter(hostile, shards):
    pytest.importorskip("torch")
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron_sft_idx.training import megatron as M

    blend = M.parse_data_path(url("d/small"))
    config = M.SFTIndexedDatasetConfig(random_seed=3, sequence_length=256, blend=blend, split="100,0,0")
    train, _, _ = builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [50, 0, 0], lambda: True,
                                                        config).build()
    train[0]
    train.datasets[0].dataset.clear_block_cache() if hasattr(train, "datasets") else train.dataset.clear_block_cache()
    hostile.inject("trickle", method="GET", suffix="/d/small.bin", times=1000, interval=0.5)
    failing(lambda: train[1], RemoteTimeoutError)


def test_a_dataloader_worker(hostile, shards):
    torch = pytest.importorskip("torch")
    ds = MMapIndexedDataset(url("d/small"))
    hostile.inject("stall", method="GET", suffix="/d/small.bin", times=1000)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork",
                                         collate_fn=lambda pack: int(pack.input_ids.sum()))
    exc = failing(lambda: next(iter(loader)), RemoteTimeoutError, budget=OP + 10)  # + a worker's start
    assert "d/small.bin" in str(exc)


# --------------------------------------------------------------------------- the gate


def gate(capsys, target):
    """``check-idx TARGET --json``: (exit code, error findings or None, stderr)."""
    from megatron_sft_idx.gate.cli import main

    code = main([target, "--json"])
    captured = capsys.readouterr()
    if not captured.out:
        return code, None, captured.err
    report = json.loads(captured.out)
    return code, [f for s in report["shards"] for f in s["findings"] if f["severity"] == "error"], captured.err


@pytest.mark.parametrize("name,action,options,error,field", GET_FAULTS, ids=GET_IDS)
def test_the_gate_fails_the_shard_by_name_within_budget(hostile, shards, capsys, monkeypatch, name, action,
                                                        options, error, field):
    """The store failing the gate is FILE_UNREADABLE (exit 2: not the shard's verdict, the check's).
    The gate streams in chunks of whole packs; small ones here, so the shard is several chunks."""
    from megatron_sft_idx.gate import remote as gate_remote

    monkeypatch.setattr(gate_remote, "CHUNK_TOKENS", 4096)
    hostile.inject(action, method="GET", suffix="/d/small.bin", times=1000, **options)
    started = time.monotonic()
    code, errors, _ = gate(capsys, url("d/small"))
    assert time.monotonic() - started <= OP + GRACE + 5  # + the gate's own passes over the index files
    assert code == 2 and [f["code"] for f in errors] == ["FILE_UNREADABLE"], errors
    assert errors[0]["file"].endswith("d/small.bin"), errors
    hostile.clear()
    assert gate(capsys, url("d/small"))[0] == 0


@pytest.mark.parametrize("name,action", LIST_FAULTS, ids=LIST_IDS)
def test_the_gate_on_a_listing_that_never_ends(hostile, shards, capsys, name, action):
    hostile.inject(action, method="GET", query="list-type=2", times=10_000)
    started = time.monotonic()
    code, errors, err = gate(capsys, url("d/small"))
    assert time.monotonic() - started <= OP + GRACE
    assert code == 2 and errors is None and err.startswith("check-idx: error: s3://hostile-reads/d/small")
    assert "listing" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- msc://


@pytest.fixture
def msc(hostile, tmp_path, monkeypatch):
    monkeypatch.setenv("MSC_CONFIG", hostile.msc_config(str(tmp_path / "msc.json"), "hostile", BUCKET))
    reset_clients()
    return hostile


@pytest.mark.parametrize("name,action,options,error,field",
                         [f for f in GET_FAULTS if f[0] in ("stall", "trickle", "ignore-range", "shift-range",
                                                            "lie-content-length-longer")],
                         ids=["stall", "trickle", "ignore-range", "shift-range", "lie-content-length"])
def test_msc_reads_end_in_a_named_error_within_budget_and_memory(msc, shards, name, action, options, error,
                                                                 field):
    from megatron_sft_idx.storage._stores import _STORES

    ds = MMapIndexedDataset("msc://hostile/d/big")
    assert any(getattr(s, "instrumented", {}).get("hostile") for s in _STORES.values())  # checks are on MSC's client
    msc.inject(action, method="GET", suffix="/d/big.bin", times=1000, **options)
    exc = failing(lambda: ds[1234], error, memory=True)
    assert "msc://hostile/d/big.bin" in str(exc) and (field is None or exc.field == field), exc
    msc.clear()
    assert same(ds[1234], MMapIndexedDataset(shards["big"])[1234])


def test_msc_changed_object_and_listing(msc, shards, tmp_path):
    put(msc, shards["small"], "f/s")
    ds = MMapIndexedDataset("msc://hostile/f/s")
    other = str(tmp_path / "other")
    write_shard(other, random_packs(np.random.default_rng(9), 200, pack_size=256), pack_size=256, vocab_size=1000)
    put(msc, other, "f/s")
    msc.inject("ignore-if-match", method="GET", times=1000)
    failing(lambda: ds[3], ObjectChangedError)  # MSC's read takes no If-Match: ours is added to its requests
    for _, action in LIST_FAULTS:
        msc.clear()
        msc.inject(action, method="GET", query="list-type=2", times=10_000)
        failing(lambda: open_packed("msc://hostile/f/"), ResponseMismatchError)
    msc.clear()
    assert same(open_packed("msc://hostile/f/")[3], MMapIndexedDataset(other)[3])
