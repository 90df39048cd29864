"""megatron_sft_idx.storage.objects: a read-only, seekable file over one object, against the real
S3 API (moto on loopback behind the counting, fault-injecting proxy: the ``s3`` / ``bucket``
fixtures). It reads what a local file of the same bytes reads, by ranged GETs of bounded size,
pinned to the ETag seen at open, through transient faults."""

import io
import os

import numpy as np
import pytest

from megatron_sft_idx.errors import ObjectChangedError, RemoteStorageError
from megatron_sft_idx.storage.objects import list_objects, open_object, stat_object

SIZE = 3 * (1 << 20) + 12345


@pytest.fixture
def blob(s3, bucket, tmp_path):
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    s3.client().put_object(Bucket=bucket, Key="d/blob.bin", Body=data)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    s3.clear()
    return f"s3://{bucket}/d/blob.bin", str(path), data


def gets(s3):
    return [(r, n) for m, k, r, n in s3.requests if m == "GET" and r is not None]


def test_reads_and_seeks_as_a_local_file_does(blob, s3):
    url, path, data = blob
    rng = np.random.default_rng(1)
    with open_object(url, read_ahead=64 << 10) as remote, open(path, "rb") as local:
        assert remote.seekable() and remote.readable() and not remote.writable()
        for _ in range(200):
            whence = int(rng.integers(0, 3))
            offset = int(rng.integers(-1000, 1000)) if whence else int(rng.integers(0, SIZE + 100))
            if whence == io.SEEK_CUR and local.tell() + offset < 0 or whence == io.SEEK_END and SIZE + offset < 0:
                continue
            assert remote.seek(offset, whence) == local.seek(offset, whence)
            n = int(rng.choice([0, 1, 100, 70_000, 300_000]))
            assert remote.read(n) == local.read(n)
            assert remote.tell() == local.tell()
        remote.seek(SIZE - 5)
        assert remote.read() == data[-5:] and remote.read(10) == b""
    assert all(n <= 300_000 + (64 << 10) for _, n in gets(s3))   # never more than one read plus the buffer


def test_sequential_reads_are_gets_of_the_read_ahead_and_stop_at_the_range_end(blob, s3):
    url, _, data = blob
    with open_object(url, read_ahead=1 << 20) as f:
        assert b"".join(iter(lambda: f.read(4096), b"")) == data
    sizes = [n for _, n in gets(s3)]
    assert sizes == [1 << 20] * 3 + [12345]   # one GET per read-ahead, not one per read
    s3.clear()
    stop = 1_500_000
    with open_object(url, read_ahead=1 << 20, stop=stop) as f:
        f.seek(1_000_000)
        assert f.read(stop - 1_000_000) == data[1_000_000:stop]
        assert [r for r, _ in gets(s3)] == [f"bytes=1000000-{stop - 1}"]   # nothing fetched past the range
        assert f.read(10) == data[stop:stop + 10]   # (reading past it still works)


def test_reading_the_whole_rest_is_one_get_not_one_per_8_kib(blob, s3):
    """Issue 44, item 3: ``read()`` to the end (how a tokenizer's files are read) asked 8 KiB per
    GET (io.RawIOBase.readall): 860 GETs for a 7 MB tokenizer.json."""
    url, _, data = blob
    with open_object(url) as f:
        assert f.read() == data
    assert [r for r, _ in gets(s3)] == [f"bytes=0-{SIZE - 1}"]
    s3.clear()
    with open_object(url, read_ahead=1 << 20) as f:
        assert f.read(100) == data[:100] and f.read() == data[100:] and f.read() == b""
    assert sum(n for _, n in gets(s3)) == SIZE and len(gets(s3)) == 2


def test_a_replaced_object_fails_at_open_or_at_the_next_get(blob, s3, bucket):
    url, _, data = blob
    info = stat_object(url)
    assert info.size == SIZE and info.etag
    f = open_object(url, read_ahead=64 << 10)
    s3.client().put_object(Bucket=bucket, Key="d/blob.bin", Body=data[::-1])
    with pytest.raises(ObjectChangedError):
        f.read(10)
    f.close()
    with pytest.raises(ObjectChangedError, match="replaced since it was read before"):
        open_object(url, etag=info.etag)


def test_transient_faults_are_retried_and_a_missing_object_is_file_not_found(blob, s3, bucket):
    url, _, data = blob
    s3.inject("500", lambda m, k, h: m == "GET" and k.endswith("/blob.bin"), times=2)
    s3.inject("truncate", lambda m, k, h: m == "GET" and k.endswith("/blob.bin"), times=1)
    with open_object(url) as f:
        assert f.read() == data
    assert s3.injected["500"] == 2 and s3.injected["truncate"] == 1
    with pytest.raises(FileNotFoundError):
        open_object(f"s3://{bucket}/d/none.bin")
    s3.inject("500", lambda m, k, h: m == "GET" and k.endswith("/blob.bin"), times=100)
    with open_object(url, read_ahead=4096) as f, pytest.raises(RemoteStorageError):
        f.read(10)


def test_list_objects_lists_every_level_sorted(s3, bucket):
    client = s3.client()
    for key in ("p/b.jsonl", "p/a/z.jsonl", "p/a.jsonl", "q/x.jsonl"):
        client.put_object(Bucket=bucket, Key=key, Body=key.encode())
    listed = list_objects(f"s3://{bucket}/p/")
    assert [u for u, _ in listed] == [f"s3://{bucket}/p/{k}" for k in ("a.jsonl", "a/z.jsonl", "b.jsonl")]
    assert [i.size for _, i in listed] == [len(f"p/{k}") for k in ("a.jsonl", "a/z.jsonl", "b.jsonl")]
    assert os.path.basename(listed[0][0]) == "a.jsonl"
