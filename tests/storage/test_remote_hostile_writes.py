"""Every door that writes object storage, against a hostile S3 server (the ``hostile`` fixture of
tests/conftest.py; see tests/storage/test_remote_hostile.py for the reads).

Uploads (``upload_shard``: data first, ``.idx`` last; multipart above the part size),
``publish`` with a manifest and ``preprocess-sft --output-prefix s3://`` meet a server that
stalls a PUT, trickles its answer, or lists forever when the destination is checked. Each
ends in a named error within its documented budget (asserted; plus a pytest timeout), leaves
nothing that opens (no ``.idx``, no manifest), and the same call — or ``--resume`` —
finishes once the server behaves, with the bytes of a clean run.
"""

import os
import time

import numpy as np
import pytest

from bench.s3loop import reset_clients
from conftest import HOSTILE_OPERATION_TIMEOUT
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset, open_packed
from megatron_sft_idx.errors import (IncompleteShardError, RemoteTimeoutError, ResponseMismatchError,
                                     ShardNotFoundError)
from megatron_sft_idx.publishing import publish, upload_shard

pytestmark = pytest.mark.timeout(180)

OP = HOSTILE_OPERATION_TIMEOUT
GRACE = 3.0
BUCKET = "hostile-writes"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SETTINGS = ["--input", os.path.join(EXAMPLES, "conversations.jsonl"), "--tokenizer", os.path.join(EXAMPLES, "tokenizer"),
            "--pack-size", "1024", "--max-packs-per-shard", "20", "--split", "80,10,10", "--quiet"]
LIST_ACTIONS = ["list-forever", "list-cycle", "list-fresh", "list-no-token"]


@pytest.fixture(scope="module", autouse=True)
def hostile_bucket(hostile_server):
    """The module's bucket, made before any of its tests (each runs alone too: ``-k``, xdist)."""
    hostile_server.make_bucket(BUCKET)
    return BUCKET


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("w") / "s")
    write_shard(prefix, random_packs(np.random.default_rng(0), 200, pack_size=256), pack_size=256, vocab_size=1000)
    return prefix


def timed(call, error):
    started = time.monotonic()
    with pytest.raises(error) as info:
        call()
    return info.value, time.monotonic() - started


def does_not_open(url):
    with pytest.raises((ShardNotFoundError, IncompleteShardError)):
        MMapIndexedDataset(url)


def same_shard(url, local):
    remote, ref = MMapIndexedDataset(url), MMapIndexedDataset(local)
    return len(remote) == len(ref) and all(
        np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        for a, b in zip(remote.get_many(range(len(ref))), ref))


# --------------------------------------------------------------------------- upload_shard


@pytest.mark.parametrize("action,suffix", [("stall", "/u/s.bin"), ("stall", "/u/s.idx"),
                                           ("trickle-headers", "/u/s.idx")])
def test_an_upload_to_a_server_that_does_not_answer(hostile, shard, action, suffix):
    url = f"s3://{BUCKET}/u/s"
    hostile.inject(action, method="PUT", suffix=suffix, times=1000, interval=0.5)
    exc, elapsed = timed(lambda: upload_shard(shard, url, replace=True), RemoteTimeoutError)
    assert elapsed <= OP + GRACE and url + suffix[len("/u/s"):] in str(exc), (elapsed, exc)
    hostile.clear()
    if suffix.endswith(".bin"):
        does_not_open(url)  # the commit point was never sent
    upload_shard(shard, url, replace=True)
    assert same_shard(url, shard)


def test_an_abandoned_put_is_cut_short_and_never_lands(hostile, tmp_path, monkeypatch):
    """A server reading a 23 MiB body slowly: at the deadline the PUT is abandoned and its body
    stops being sent (the server sees it end short), so it cannot land after the error."""
    from megatron_sft_idx.storage.objects import store_for
    from megatron_sft_idx.storage.urls import ObjectURL
    from megatron_sft_idx.storage.config import StorageConfig

    monkeypatch.setenv("MEGATRON_SFT_IDX_MIN_THROUGHPUT", "64M")  # the size allowance small: the budget is OP
    reset_clients()
    path = str(tmp_path / "blob")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(23 << 20))
    target = ObjectURL.parse(f"s3://{BUCKET}/slow/blob")
    config = StorageConfig.resolve()
    hostile.inject("slow-read", method="PUT", suffix="/slow/blob", times=1000, interval=0.2)
    _, elapsed = timed(lambda: store_for(target, config).upload(path, target), RemoteTimeoutError)
    assert elapsed <= config.operation_seconds(23 << 20) + GRACE
    deadline = time.monotonic() + 20  # the body would take 75 s at the server's pace
    while time.monotonic() < deadline:
        short = [r for r in hostile.stats()["requests"] if r[0] == "PUT-short"]
        if len(short) >= 2:  # every attempt's body ended short
            break
        time.sleep(0.2)
    assert len(short) >= 2 and all(n < 23 << 20 for _, _, _, n in short), short
    hostile.clear()
    assert store_for(target, config).head(target) is None  # nothing landed


@pytest.mark.parametrize("action", LIST_ACTIONS)
def test_an_upload_whose_destination_lists_forever(hostile, shard, action):
    url = f"s3://{BUCKET}/l/s"
    hostile.inject(action, method="GET", query="list-type=2", times=10_000)
    _, elapsed = timed(lambda: upload_shard(shard, url), ResponseMismatchError)
    assert elapsed <= OP + GRACE
    assert not [r for r in hostile.stats()["requests"] if r[0] == "PUT"]  # refused before any upload


def test_a_multipart_part_that_stalls(hostile, tmp_path, monkeypatch):
    """Parts are retried on their own within the upload's one deadline; the upload is aborted
    (no orphaned parts) and the .idx never sent."""
    from megatron_sft_idx.storage.config import StorageConfig

    monkeypatch.setenv("MEGATRON_SFT_IDX_PART_SIZE", "5M")
    monkeypatch.setenv("MEGATRON_SFT_IDX_MIN_THROUGHPUT", "64M")  # the size allowance small: the budget is OP
    reset_clients()
    big = str(tmp_path / "big")
    write_shard(big, random_packs(np.random.default_rng(5), 1600, pack_size=4096, vocab=30000, full=True),
                pack_size=4096, vocab_size=30000)
    size = os.path.getsize(big + ".bin")
    assert size > 10 << 20
    url = f"s3://{BUCKET}/mp/big"
    hostile.inject("stall", method="PUT", suffix="/mp/big.bin", query="partNumber=2", times=1000)
    exc, elapsed = timed(lambda: upload_shard(big, url), RemoteTimeoutError)
    assert elapsed <= StorageConfig.resolve().operation_seconds(size) + GRACE and "part 2/" in str(exc), exc
    requests = hostile.stats()["requests"]
    assert any(m == "DELETE" and k.endswith("/mp/big.bin") for m, k, _, _ in requests)  # aborted
    hostile.clear()
    does_not_open(url)
    upload_shard(big, url, replace=True)
    assert same_shard(url, big)


def test_a_manifest_put_that_stalls_leaves_no_manifest(hostile, tmp_path):
    shards = []
    for k in range(2):
        shards.append(str(tmp_path / f"p_{k}"))
        write_shard(shards[-1], random_packs(np.random.default_rng(k), 20, pack_size=256), pack_size=256,
                    vocab_size=1000)
    dest = f"s3://{BUCKET}/man"
    hostile.inject("stall", method="PUT", suffix="/man/all.json", times=1000)
    _, elapsed = timed(lambda: publish(shards, dest, manifest="all.json"), RemoteTimeoutError)
    assert elapsed <= OP + GRACE
    hostile.clear()
    with pytest.raises(ShardNotFoundError):
        open_packed(dest + "/all.json")
    publish(shards, dest, manifest="all.json", replace=True)
    assert len(open_packed(dest + "/all.json")) == 40


# --------------------------------------------------------------------------- preprocess-sft


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    from megatron_sft_idx.preprocess.cli import main as preprocess_main

    root = tmp_path_factory.mktemp("local")
    assert preprocess_main(SETTINGS + ["--output-prefix", str(root / "out" / "ds")]) == 0
    return root / "out"


def bucket_files(server, prefix):
    client = server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    return {k[len(prefix):]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in sorted(keys)}


def local_files(directory):
    """The published files (a finished run keeps its record in ``.<name>.preprocess/``: not an output)."""
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))
            if not name.startswith(".")}


def test_preprocess_to_a_stalling_server_then_resume(hostile, shard, local_run, tmp_path, capsys):
    """A PUT that never answers: one line naming the object and the deadline, no manifest;
    --resume once the server behaves publishes the bytes of the clean local run."""
    from megatron_sft_idx.preprocess.cli import main as preprocess_main

    url = f"s3://{BUCKET}/pp/ds"
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage")]
    hostile.inject("stall", method="PUT", suffix="/pp/ds_train_000001.bin", times=1000)
    assert preprocess_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{url}_train_000001: cannot upload the shard" in err, err
    assert "no complete response" in err and "MEGATRON_SFT_IDX_" in err and "--resume" in err, err
    assert not [k for k in bucket_files(hostile, "pp/") if k.endswith(".json")]
    does_not_open(url + "_train_000001")
    hostile.clear()
    assert preprocess_main(args + ["--resume"]) == 0
    assert bucket_files(hostile, "pp/") == local_files(local_run)


@pytest.mark.parametrize("action", ["list-forever", "stall"])
def test_preprocess_whose_destination_check_never_ends(hostile, shard, tmp_path, capsys, action):
    from megatron_sft_idx.preprocess.cli import main as preprocess_main

    url = f"s3://{BUCKET}/pq/ds"
    hostile.inject(action, method="GET", query="list-type=2", times=10_000)
    started = time.monotonic()
    assert preprocess_main(SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage"),
                                       "--json"]) == 1
    assert time.monotonic() - started <= OP + GRACE + 10  # + starting the tool
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "Traceback" not in err, err
    assert ("listing" in err) if action != "stall" else ("no complete response" in err), err
    assert not (tmp_path / "stage").exists()  # refused before any work


# --------------------------------------------------------------------------- conditional writes (issue 41)


def test_a_store_that_ignores_conditional_writes_is_refused_before_a_lock_is_trusted(hostile, shard):
    """A gateway that forwards PUTs without If-None-Match / If-Match would give two runs one lock
    (each create-only PUT "succeeds") and let a release delete the live holder's lock. The first
    lock of a bucket probes the store and refuses it by its endpoint; a faithful store passes."""
    from megatron_sft_idx.errors import ShardError
    from megatron_sft_idx.storage.lease import ObjectLock

    url = f"s3://{BUCKET}/locks/a/lock"
    hostile.inject("ignore-conditional", method="PUT", times=10_000)
    with pytest.raises(ShardError) as e:
        ObjectLock(url, "w").acquire()
    assert "ignores If-None-Match" in str(e.value) and hostile.endpoint in str(e.value), e.value
    assert not bucket_files(hostile, "locks/")                      # no lock left, the probe deleted
    reset_clients()                                                 # (a new process: probed afresh)
    hostile.clear()
    hostile.inject("ignore-if-match", method="PUT", times=10_000)   # create-only honoured, If-Match not
    with pytest.raises(ShardError, match="ignores If-Match"):
        ObjectLock(url, "w").acquire()
    reset_clients()
    hostile.clear()
    first = ObjectLock(url, "w")
    first.acquire()
    try:
        with pytest.raises(ShardError, match="is writing w"):
            ObjectLock(url, "w").acquire()                          # the store honours them: one holder
    finally:
        first.release()
    assert not bucket_files(hostile, "locks/")


def test_preprocess_refuses_a_store_on_a_server_that_ignores_conditional_writes(hostile, shard, tmp_path, capsys):
    from megatron_sft_idx.preprocess.cli import main as preprocess_main

    hostile.inject("ignore-conditional", method="PUT", times=10_000)
    store = f"s3://{BUCKET}/cond/st"
    assert preprocess_main(SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "o" / "ds")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ignores If-None-Match" in err and hostile.endpoint in err, err
    assert not bucket_files(hostile, "cond/")
    assert not (tmp_path / "o").exists() or not local_files(tmp_path / "o")     # nothing published


# --------------------------------------------------------------------------- what a write answers (issue 41)


@pytest.mark.parametrize("suffix", ["/cw/s.bin", "/cw/s.idx"])
def test_an_upload_the_server_stores_otherwise_is_an_error_naming_the_object(hostile, shard, suffix):
    """A server (or a proxy in front of it) that stores other bytes than were sent answers for
    those bytes: the upload's answer is compared with what was sent and the upload fails, the
    .idx never sent after a bad data file; a clean retry gives the shard."""
    url = f"s3://{BUCKET}/cw/s"
    hostile.inject("corrupt-write", method="PUT", suffix=suffix, times=1000)
    with pytest.raises(ResponseMismatchError, match="other bytes than were sent") as e:
        upload_shard(shard, url, replace=True)
    assert url + suffix[len("/cw/s"):] in str(e.value)
    hostile.clear()
    if suffix.endswith(".bin"):
        does_not_open(url)
    upload_shard(shard, url, replace=True)
    assert same_shard(url, shard)


def test_a_multipart_part_or_a_small_write_stored_otherwise_is_an_error(hostile, tmp_path, monkeypatch):
    from megatron_sft_idx.storage.config import StorageConfig
    from megatron_sft_idx.storage.objects import store_for
    from megatron_sft_idx.storage.urls import ObjectURL

    monkeypatch.setenv("MEGATRON_SFT_IDX_PART_SIZE", "5M")
    reset_clients()
    path = str(tmp_path / "blob")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(1).bytes(11 << 20))
    url = ObjectURL.parse(f"s3://{BUCKET}/cw/blob")
    store = store_for(url, StorageConfig.resolve())
    hostile.inject("corrupt-write", method="PUT", suffix="/cw/blob", query="partNumber=2", times=1000)
    with pytest.raises(ResponseMismatchError, match="part 2"):
        store.upload(path, url)
    assert store.head(url) is None                                  # aborted: nothing completed
    hostile.clear()
    etag = store.upload(path, url)
    assert etag.strip('"').endswith("-3") and store.head(url).etag == etag
    hostile.inject("corrupt-write", method="PUT", suffix="/cw/receipt.json", times=1000)
    with pytest.raises(ResponseMismatchError):
        store.put_bytes(ObjectURL.parse(f"s3://{BUCKET}/cw/receipt.json"), b'{"done": true}')
