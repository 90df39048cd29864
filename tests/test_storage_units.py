"""The storage layer's parts that need no server: URLs, settings, the retry policy, the
classification of the real clients' exceptions."""

import pytest

from megatron_sft_idx.errors import ObjectChangedError, RemoteStorageError, ShardError, ShardNotFoundError
from megatron_sft_idx.storage import ObjectURL, StorageConfig, is_remote
from megatron_sft_idx.storage._retry import Outcome, ShortReadError, with_retries
from megatron_sft_idx.storage._stores import classify
from megatron_sft_idx.storage._url import join_url
from megatron_sft_idx.storage.config import parse_size


def test_urls():
    assert is_remote("s3://b/k") and is_remote("msc://p/x") and not is_remote("/d/s3://x")
    assert not is_remote(None) and not is_remote(b"s3://b/k")
    url = ObjectURL.parse("s3://bucket/dir/train_000")
    assert (url.bucket, url.key, url.name, str(url.parent)) == ("bucket", "dir/train_000", "train_000", "s3://bucket/dir")
    assert str(url.with_suffix(".idx")) == "s3://bucket/dir/train_000.idx"
    assert str(ObjectURL.parse("msc://prof/").join("a.json")) == "msc://prof/a.json"
    assert join_url("s3://b/d/m.json", "train_000") == "s3://b/d/train_000"
    assert join_url("s3://b/d/m.json", "msc://p/x") == "msc://p/x"
    pattern = ObjectURL.parse("s3://b/d/train_*.idx")
    assert ObjectURL.parse("s3://b/d/train_7.idx").matches(pattern)
    assert not ObjectURL.parse("s3://b/d/sub/train_7.idx").matches(pattern)  # * stays in one level
    for bad in ("s3://", "s3:///k", "gs://b/k", "/local/path", "s3:/b/k"):
        with pytest.raises(ShardError, match="not an object-storage URL"):
            ObjectURL.parse(bad)


def test_settings_from_arguments_environment_and_defaults(monkeypatch, tmp_path):
    for var in ("CACHE", "BLOCK_SIZE", "CACHE_BLOCKS", "RETRIES"):
        monkeypatch.delenv("MEGATRON_SFT_IDX_" + var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = StorageConfig.resolve()
    assert default.block_size == 1 << 20 and default.cache_root == str(tmp_path / "megatron_sft_idx")
    monkeypatch.setenv("MEGATRON_SFT_IDX_BLOCK_SIZE", "4M")
    monkeypatch.setenv("MEGATRON_SFT_IDX_CACHE", "/scratch/idx")
    monkeypatch.setenv("MEGATRON_SFT_IDX_RETRIES", "3")
    env = StorageConfig.resolve()
    assert (env.block_size, env.cache_root, env.retries) == (4 << 20, "/scratch/idx", 3)
    assert StorageConfig.resolve(block_size=65536).block_size == 65536  # an argument wins
    assert StorageConfig.resolve(env, cache_dir="/other").cache_root == "/other"
    assert [parse_size(t) for t in ("4096", "64K", "4M", "1G", "4MiB", "2.5M")] == \
        [4096, 65536, 4 << 20, 1 << 30, 4 << 20, int(2.5 * (1 << 20))]
    monkeypatch.setenv("MEGATRON_SFT_IDX_BLOCK_SIZE", "lots")
    with pytest.raises(ShardError, match="MEGATRON_SFT_IDX_BLOCK_SIZE"):
        StorageConfig.resolve()
    monkeypatch.setenv("MEGATRON_SFT_IDX_BLOCK_SIZE", "5000")
    with pytest.raises(ShardError, match="multiple of 4096"):
        StorageConfig.resolve()


def _client_error(status, code):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def test_classification_of_real_client_exceptions():
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    assert classify(_client_error(503, "SlowDown")) is Outcome.RETRY
    assert classify(_client_error(500, "InternalError")) is Outcome.RETRY
    assert classify(_client_error(429, "TooManyRequests")) is Outcome.RETRY
    assert classify(_client_error(404, "NoSuchKey")) is Outcome.MISSING
    assert classify(_client_error(412, "PreconditionFailed")) is Outcome.CHANGED
    assert classify(_client_error(403, "AccessDenied")) is Outcome.FATAL
    assert classify(_client_error(416, "InvalidRange")) is Outcome.FATAL
    assert classify(EndpointConnectionError(endpoint_url="http://x")) is Outcome.RETRY
    assert classify(ConnectionClosedError(endpoint_url="http://x")) is Outcome.RETRY
    assert classify(ReadTimeoutError(endpoint_url="http://x")) is Outcome.RETRY
    assert classify(NoCredentialsError()) is Outcome.FATAL
    assert classify(ConnectionResetError(104, "reset")) is Outcome.RETRY
    assert classify(ShortReadError("short")) is Outcome.RETRY
    assert classify(RuntimeError("Failed to GET ... status_code: 500, error_type: ClientError")) is Outcome.RETRY
    assert classify(ValueError("a bug")) is Outcome.FATAL
    wrapped = RuntimeError("MSC wrapper")
    wrapped.__cause__ = _client_error(503, "SlowDown")
    assert classify(wrapped) is Outcome.RETRY


def test_retry_loop(monkeypatch):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "reset")
        return "data"

    run = dict(what="GET", path="s3://b/k.bin", classify=classify, attempts=4, base=0.001, ceiling=0.002)
    assert with_retries(flaky, **run) == "data" and len(calls) == 3
    with pytest.raises(RemoteStorageError, match=r"s3://b/k\.bin: GET failed after 4 attempts.*ConnectionResetError"):
        with_retries(lambda: (_ for _ in ()).throw(ConnectionResetError(104, "reset")), **run)
    with pytest.raises(ShardNotFoundError, match="no such object"):
        with_retries(lambda: (_ for _ in ()).throw(_client_error(404, "NoSuchKey")), **run)
    with pytest.raises(ObjectChangedError):
        with_retries(lambda: (_ for _ in ()).throw(_client_error(412, "PreconditionFailed")), **run)
    denied = []
    with pytest.raises(RemoteStorageError, match="AccessDenied|ClientError"):
        with_retries(lambda: denied.append(1) or (_ for _ in ()).throw(_client_error(403, "AccessDenied")), **run)
    assert len(denied) == 1  # never retried
