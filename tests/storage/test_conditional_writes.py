"""Conditional writes, server-side copies and the lease lock in object storage
(storage/_stores.py put_bytes / copy, storage/lease.py), on moto behind the counting proxy."""

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_sft_idx.errors import PreconditionError, ShardError, ShardNotFoundError
from megatron_sft_idx.storage.objects import store_for
from megatron_sft_idx.storage.urls import ObjectURL
from megatron_sft_idx.storage.config import MIB, StorageConfig
from megatron_sft_idx.storage.destination import ObjectDestination
from megatron_sft_idx.storage.lease import ObjectLock, require_conditional_writes


def _store(**settings):
    config = StorageConfig.resolve(**settings)
    return store_for(ObjectURL.parse("s3://x/y"), config), config


def test_create_only_and_replace_only_writes(bucket):
    store, _ = _store()
    url = ObjectURL.parse(f"s3://{bucket}/lock")
    first = store.put_bytes(url, b"one", create_only=True)
    with pytest.raises(PreconditionError, match="If-None-Match"):
        store.put_bytes(url, b"two", create_only=True)
    second = store.put_bytes(url, b"two", if_match=first)
    assert second != first
    with pytest.raises(PreconditionError, match="If-Match"):
        store.put_bytes(url, b"three", if_match=first)     # the version read is gone
    assert bytes(store.read_range(url, 0, 3)) == b"two"


def test_server_side_copy_single_and_in_parts(bucket, s3):
    store, _ = _store()
    data = os.urandom(11 * MIB + 123)
    src = ObjectURL.parse(f"s3://{bucket}/staged/a.bin")
    store.put_bytes(src, data)
    s3.clear()
    store.copy(src, ObjectURL.parse(f"s3://{bucket}/final/a.bin"))
    assert s3.count("PUT") == 1 and s3.count("GET") == 0      # one CopyObject, no byte through the client
    parted, _ = _store(copy_limit=5 * MIB, part_size=5 * MIB)
    s3.clear()
    parted.copy(src, ObjectURL.parse(f"s3://{bucket}/final/b.bin"))
    assert (s3.count("PUT"), s3.count("POST"), s3.count("GET")) == (3, 2, 0)   # 3 UploadPartCopy, create + complete
    for name in ("a", "b"):
        got = ObjectURL.parse(f"s3://{bucket}/final/{name}.bin")
        assert bytes(store.read_range(got, 0, len(data))) == data
    with pytest.raises(ShardNotFoundError):
        store.copy(ObjectURL.parse(f"s3://{bucket}/nothing"), ObjectURL.parse(f"s3://{bucket}/x"))


def test_destination_put_from_a_url_copies_server_side(bucket, s3, tmp_path):
    dest = ObjectDestination()
    dest.write_bytes(f"s3://{bucket}/w/staged/s.idx", b"index bytes")
    s3.clear()
    dest.put(f"s3://{bucket}/w/staged/s.idx", f"s3://{bucket}/out/s.idx")
    assert s3.count("GET") == 0
    assert dest.read(f"s3://{bucket}/out/s.idx", 100) == b"index bytes"
    dest.finish(f"s3://{bucket}/out/s", {".idx": f"s3://{bucket}/w/staged/s.idx"})


def test_a_lock_refuses_a_second_holder_naming_the_first(bucket):
    url = f"s3://{bucket}/store/lock"
    first = ObjectLock(url, "sequence store s3://x")
    first.acquire()
    try:
        body = json.loads(bytes(first.store.read_range(first.url, 0, first.store.head(first.url).size)))
        assert body["pid"] == os.getpid() and body["nonce"] == first.nonce
        with pytest.raises(ShardError, match=rf"another process \(pid {os.getpid()} on .*\) is writing sequence store"):
            ObjectLock(url, "sequence store s3://x").acquire()
    finally:
        first.release()
    assert first.owner() is None                 # released: the object is gone
    again = ObjectLock(url, "sequence store s3://x")
    again.acquire()
    again.release()


def test_a_killed_holders_lease_is_taken_over_and_a_live_one_renewed(bucket, monkeypatch):
    monkeypatch.setenv("MEGATRON_SFT_IDX_LEASE_SECONDS", "1.5")
    monkeypatch.setenv("MEGATRON_SFT_IDX_REQUEST_TIMEOUT", "1")   # (the lease's floor: 1.5 x the request timeout)
    url = f"s3://{bucket}/work/lock"
    taker = ObjectLock(url, "w")
    require_conditional_writes(taker.store, taker.url)   # (probed first: the acquire below is one read)
    # a holder on "another host" (the lease alone decides), killed: it never renews
    code = ("import socket,sys; socket.gethostname=lambda: 'elsewhere';"
            "from megatron_sft_idx.storage.lease import ObjectLock; l=ObjectLock(sys.argv[1], 'w'); l.acquire();"
            "import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code, url], check=True, env=dict(os.environ))
    with pytest.raises(ShardError, match="pid .* on elsewhere"):
        taker.acquire()                           # its lease still runs
    time.sleep(1.6)
    taker.acquire()                               # expired: taken over with If-Match on its ETag
    try:
        stamp = taker.etag
        time.sleep(1.2)                           # the heartbeat renews every 0.5 s
        assert taker.etag != stamp and taker.lost is None
        with pytest.raises(ShardError, match="is writing w"):
            ObjectLock(url, "w").acquire()        # renewed: never expires while held
        taker.check()
    finally:
        taker.release()


@pytest.mark.parametrize("lease,timeout", [("0.001", "20"), ("0.9", "0.1"), ("29", "20")])
def test_a_lease_shorter_than_a_renewal_needs_is_refused_naming_the_floor(bucket, monkeypatch, lease, timeout):
    """A 1 ms lease is "a positive number", but a renewal (one request) sent a third into it can
    never land in time: the lock is refused before anything is written, the floor named (issue 41)."""
    monkeypatch.setenv("MEGATRON_SFT_IDX_LEASE_SECONDS", lease)
    monkeypatch.setenv("MEGATRON_SFT_IDX_REQUEST_TIMEOUT", timeout)
    floor = max(1.0, 1.5 * float(timeout))
    with pytest.raises(ShardError, match=rf"below the floor of {floor:g} s") as e:
        ObjectLock(f"s3://{bucket}/st/lock", "w")
    assert "MEGATRON_SFT_IDX_LEASE_SECONDS" in str(e.value) and "\n" not in str(e.value)
    assert store_for(ObjectURL.parse(f"s3://{bucket}/x"), StorageConfig.resolve()).list(
        ObjectURL.parse(f"s3://{bucket}/"), recursive=True) == []
    monkeypatch.setenv("MEGATRON_SFT_IDX_LEASE_SECONDS", str(floor))
    ObjectLock(f"s3://{bucket}/st/lock", "w")     # at the floor: taken


def test_preprocess_refuses_a_store_lock_below_the_floor(bucket, s3, monkeypatch, tmp_path, capsys):
    from megatron_sft_idx.preprocess.cli import main as preprocess_main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("MEGATRON_SFT_IDX_LEASE_SECONDS", "0.001")
    s3.clear()
    assert preprocess_main(["--input", os.path.join(root, "examples", "conversations.jsonl"), "--tokenizer",
                            os.path.join(root, "examples", "tokenizer"), "--pack-size", "256", "--quiet",
                            "--store", f"s3://{bucket}/st", "--output-prefix", str(tmp_path / "ds")]) == 1
    err = capsys.readouterr().err
    assert "below the floor of 30 s" in err and len(err.strip().splitlines()) == 1, err
    assert s3.count("PUT") == 0 and not (tmp_path / "ds").exists(), s3.requests
