"""The storage layer's parts that need no server: URLs, settings, the retry policy, the
classification of the real clients' exceptions."""

import pytest

from megatron_sft_idx.errors import ObjectChangedError, RemoteStorageError, ShardError, ShardNotFoundError
from megatron_sft_idx.storage import ObjectURL, StorageConfig, is_remote
from megatron_sft_idx.storage._retry import Outcome, ShortReadError, with_retries
from megatron_sft_idx.storage._stores import classify
from megatron_sft_idx.storage.urls import join_url
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


# --------------------------------------------------------------------------- deadlines


def test_deadline_settings(monkeypatch):
    for var in ("REQUEST_TIMEOUT", "OPERATION_TIMEOUT", "MIN_THROUGHPUT", "MAX_LIST_PAGES"):
        monkeypatch.delenv("MEGATRON_SFT_IDX_" + var, raising=False)
    c = StorageConfig.resolve()
    assert (c.request_timeout, c.operation_timeout, c.min_throughput, c.max_list_pages) == (20.0, 300.0, 1 << 20, 10_000)
    assert c.request_seconds(0) == 20.0 and c.request_seconds(4 << 20) == 24.0
    assert c.operation_seconds(64 << 20) == 364.0
    monkeypatch.setenv("MEGATRON_SFT_IDX_REQUEST_TIMEOUT", "2.5")
    monkeypatch.setenv("MEGATRON_SFT_IDX_OPERATION_TIMEOUT", "60")
    monkeypatch.setenv("MEGATRON_SFT_IDX_MIN_THROUGHPUT", "8M")
    monkeypatch.setenv("MEGATRON_SFT_IDX_MAX_LIST_PAGES", "50")
    c = StorageConfig.resolve()
    assert (c.request_timeout, c.operation_timeout, c.min_throughput, c.max_list_pages) == (2.5, 60.0, 8 << 20, 50)
    for var, value, match in (("REQUEST_TIMEOUT", "soon", "not a number of seconds"),
                              ("REQUEST_TIMEOUT", "0", "positive number of seconds"),
                              ("OPERATION_TIMEOUT", "nan", "positive number of seconds"),
                              ("OPERATION_TIMEOUT", "inf", "positive number of seconds"),
                              ("MAX_LIST_PAGES", "0", "at least 1"),
                              ("MIN_THROUGHPUT", "0", "at least 1")):
        monkeypatch.setenv("MEGATRON_SFT_IDX_" + var, value)
        with pytest.raises(ShardError, match=match):
            StorageConfig.resolve()
        monkeypatch.delenv("MEGATRON_SFT_IDX_" + var)


def test_an_attempt_is_abandoned_at_its_budget_and_stops_at_its_next_piece():
    import threading

    from megatron_sft_idx.storage._deadline import AttemptTimeout, check_attempt, run_bounded

    assert run_bounded(lambda: 42, 5.0) == 42
    with pytest.raises(KeyError):
        run_bounded(lambda: {}["missing"], 5.0)
    release, stopped = threading.Event(), threading.Event()

    def slow():
        release.wait(30)
        try:
            check_attempt()  # where a body reader checks between pieces
        except AttemptTimeout:
            stopped.set()
            raise

    with pytest.raises(AttemptTimeout):
        run_bounded(slow, 0.2)  # the caller gives up at once ...
    release.set()
    assert stopped.wait(30)  # ... and the abandoned attempt stops at its next check
    before = threading.active_count()
    for _ in range(50):
        run_bounded(lambda: None, 5.0)
    assert threading.active_count() <= before + 1  # pooled threads, not one per request


def test_an_operation_ends_within_its_deadline_whatever_the_attempts():
    import threading

    from megatron_sft_idx.errors import RemoteTimeoutError
    from megatron_sft_idx.storage._deadline import Deadline

    never = threading.Event()
    calls = []

    def stalls():
        calls.append(1)
        never.wait(30)

    run = dict(what="GET bytes 0-9", path="s3://b/k.bin", classify=classify, attempts=50, base=0.001, ceiling=0.002)
    deadline = Deadline(1.0)
    with pytest.raises(RemoteTimeoutError, match=r"s3://b/k\.bin: GET bytes 0-9: no complete response within the "
                                                 r"operation's budget of 1 s \(\d attempts of at most 0\.3 s") as info:
        with_retries(stalls, deadline=deadline, request_seconds=0.3, **run)
    assert info.value.field == "operation_timeout" and 3 <= len(calls) <= 5 and deadline.remaining() <= 0.1
    calls.clear()
    with pytest.raises(RemoteTimeoutError, match=r"within the request budget of 0\.2 s \(2 attempts") as info:
        with_retries(stalls, deadline=Deadline(30), request_seconds=0.2, **dict(run, attempts=2))
    assert info.value.field == "request_timeout" and len(calls) == 2
    never.set()
    from megatron_sft_idx.storage._deadline import AttemptTimeout
    assert classify(AttemptTimeout(1.0)) is Outcome.RETRY


# --------------------------------------------------------------------------- responses against requests


class _Headers(dict):
    def get(self, key, default=None):
        return super().get(key.lower(), default)


def _check(status, range_=(100, 199), if_match="", **headers):
    from megatron_sft_idx.storage._responses import expected_length

    h = _Headers({k.lower().replace("_", "-"): v for k, v in headers.items()})
    return expected_length("s3://b/k.bin", status, h, range_, if_match)


def test_a_ranged_response_must_answer_its_request():
    from megatron_sft_idx.errors import ObjectChangedError, ResponseMismatchError

    good = dict(content_range="bytes 100-199/1000", content_length="100", etag='"abc"')
    assert _check(206, if_match='"abc"', **good) == 100
    assert _check(206, if_match="abc", **dict(good, etag='W/"abc"')) == 100  # quoting and weakness aside
    assert _check(206, **dict(good, content_range="bytes 100-199/*")) == 100
    assert _check(200, range_=(0, 99), content_length="100") == 100  # the whole object is the range
    assert _check(200, range_=None, content_length="7") == 7  # not a ranged request
    refused = {
        "ignored Range": (200, dict(good, content_range=None, content_length="1000"), "status"),
        "whole object from 0": (200, dict(content_length="1000", etag='"abc"'), "status"),
        "other status": (204, good, "status"),
        "shifted": (206, dict(good, content_range="bytes 101-200/1000"), "Content-Range"),
        "shorter": (206, dict(good, content_range="bytes 100-150/1000"), "Content-Range"),
        "past the end": (206, dict(good, content_range="bytes 100-199/150"), "Content-Range"),
        "garbage range": (206, dict(good, content_range="100-199"), "Content-Range"),
        "no range": (206, dict(good, content_range=None), "Content-Range"),
        "longer body": (206, dict(good, content_length="4096"), "Content-Length"),
        "shorter body": (206, dict(good, content_length="99"), "Content-Length"),
        "no length": (206, dict(good, content_length=None), "Content-Length"),
        "negative length": (206, dict(good, content_length="-1"), "Content-Length"),
        "no etag": (206, dict(good, etag=None), "ETag"),
    }
    for case, (status, headers, field) in refused.items():
        headers = {k: v for k, v in headers.items() if v is not None}
        with pytest.raises(ResponseMismatchError) as info:
            _check(status, if_match='"abc"', **headers)
        assert info.value.field == field and info.value.path == "s3://b/k.bin", case
    with pytest.raises(ObjectChangedError, match="ignored If-Match") as info:
        _check(206, if_match='"abc"', **dict(good, etag='"def"'))
    assert info.value.field == "ETag"


class _Raw:
    """A urllib3-like response body: ``read1`` gives the next of ``pieces``."""

    def __init__(self, pieces):
        self.pieces, self.closed, self.released, self.asked = list(pieces), False, False, []

    def read1(self, n):
        self.asked.append(n)
        return self.pieces.pop(0) if self.pieces else b""

    def close(self):
        self.closed = True

    def release_conn(self):
        self.released = True


def test_a_body_is_read_up_to_its_length_and_never_past_it():
    import zlib

    from megatron_sft_idx.storage._responses import PIECE, read_exactly

    raw = _Raw([b"abc", b"defg", b"hij"])
    data = read_exactly(raw, 10, "s3://b/k")
    assert bytes(data) == b"abcdefghij" and data.readonly and raw.released and not raw.closed
    assert raw.asked == [10, 7, 3]  # never more than what is left
    raw = _Raw([b"x" * PIECE] * 3)
    read_exactly(raw, 3 * PIECE, "s3://b/k")
    assert max(raw.asked) == PIECE
    for pieces, length in (([b"abc"], 10), ([b"abcdefghijk"], 10)):
        raw = _Raw(pieces)
        with pytest.raises(ShortReadError):
            read_exactly(raw, length, "s3://b/k")
        assert raw.closed  # a connection with unread bytes is never reused
    raw = _Raw([b"abcdefghij"])
    with pytest.raises(ShortReadError, match="checksum"):
        read_exactly(raw, 10, "s3://b/k", crc32=zlib.crc32(b"abcdefghiJ"))


def test_a_listing_page_must_be_progress():
    from megatron_sft_idx.errors import ResponseMismatchError
    from megatron_sft_idx.storage._responses import PageGuard

    def page(keys, token=None, more=None):
        doc = {"Contents": [{"Key": k} for k in keys], "IsTruncated": bool(token) if more is None else more}
        if token:
            doc["NextContinuationToken"] = token
        return doc

    guard = PageGuard("s3://b/p/", max_pages=10)
    assert guard.page(page(["a", "b"], "t1")) == "t1"
    assert guard.page(page(["c"], "t2")) == "t2"
    assert guard.page(page(["d"])) is None
    refused = {
        "repeated token": ([page(["a"], "t1"), page(["b"], "t1")], "NextContinuationToken"),
        "cycling tokens": ([page([], "t1"), page([], "t2"), page([], "t1")], "NextContinuationToken"),
        "no token": ([page(["a"], more=True)], "NextContinuationToken"),
        "repeated key": ([page(["a"], "t1"), page(["a"], "t2")], "Key"),
        "too many pages": ([page([], f"t{k}") for k in range(10)], "max_list_pages"),
    }
    for case, (pages, field) in refused.items():
        guard = PageGuard("s3://b/p/", max_pages=10)
        with pytest.raises(ResponseMismatchError) as info:
            for p in pages:
                guard.page(p)
        assert info.value.field == field and info.value.path == "s3://b/p/", case
    guard = PageGuard("s3://b/p/", max_pages=10)  # a client that lists again starts afresh
    guard.page(page(["a"]))
    assert guard.page(page(["a"]), first=True) is None
