"""Clients of object storage behind one small interface: boto3 for ``s3://``, MSC for ``msc://``.

A store answers six questions — list, head, read a byte range, download, upload,
delete — and raises only the project's errors: every request runs through
:func:`~._retry.with_retries` with this module's classification of the client's
exceptions. The clients are the optional extra ``[s3]``, imported the first time a URL is
used, never on the local read path; without them the error is one line naming the extra.

boto3's own retries are switched off (one attempt per call) so that the policy,
the attempt count and the final error are ours. Every operation has a wall-clock
deadline and every attempt a budget (:mod:`._deadline`, settings in
:class:`~.config.StorageConfig`). Ranged reads carry ``If-Match`` with the ETag seen
at open, so a shard replaced mid-read fails with
:class:`~megatron_sft_idx.errors.ObjectChangedError` instead of mixing generations.
Every GET response is checked against its request before its body is read, and the
body is read in bounded pieces, never past the length asked for; listing pages are
guarded against repeating forever (:mod:`._responses`). Every write is checked the same way:
the answer to an upload (each part of a multipart one, and the completed object) must prove the
server holds the bytes sent -- a CRC-32 checksum, or an MD5 ETag -- and a server-side copy of a
single-part object must answer the source's ETag. For ``msc://`` the same
checks run as handlers on MSC's own boto3 client (profiles on S3-compatible storage);
a profile on another backend gets the deadlines and a length check after the read.

Clients are created once per process (a DataLoader worker or a forked rank gets its own:
connection pools do not survive ``fork``).
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import hashlib
import io
import os
import re
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .._extras import require_extra
from ..errors import (ObjectChangedError, PreconditionError, RemoteStorageError, RemoteTimeoutError,
                      ResponseMismatchError, ShardError, ShardNotFoundError, SizeMismatchError)
from . import _responses
from ._deadline import Deadline, check_attempt
from ._retry import Outcome, ShortReadError, with_retries
from .config import StorageConfig
from .urls import ObjectURL

#: Requests made by this process, by kind (``get``, ``head``, ``list``, ``put``, ...) plus
#: ``get_bytes``; attempts count, so a retried GET counts twice. Benchmarks and tests read it.
REQUESTS: collections.Counter = collections.Counter()
_REQ_LOCK = threading.Lock()

_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests", "Busy", "503", "500"}
_MISSING_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchBucket"}
_STATUS = re.compile(r"status_code:\s*(\d{3})")
#: Who needs the extra, in the one-line MissingExtraError.
_S3_USER, _MSC_USER = "s3:// URLs", "msc:// URLs"


def _count(kind: str, nbytes: int = 0) -> None:
    with _REQ_LOCK:
        REQUESTS[kind] += 1
        if nbytes:
            REQUESTS[kind + "_bytes"] += nbytes


def _count_bytes(nbytes: int) -> None:
    with _REQ_LOCK:
        REQUESTS["get_bytes"] += nbytes


def request_counts() -> Dict[str, int]:
    """A copy of this process's request counters."""
    with _REQ_LOCK:
        return dict(REQUESTS)


@dataclass(frozen=True)
class ObjectInfo:
    """Size and version tag (ETag; empty when the store gives none) of one object."""

    size: int
    etag: str = ""


# --------------------------------------------------------------------------- classification


def classify(exc: BaseException) -> Outcome:
    """What to do about one failed request, from the exception and its causes."""
    seen = 0
    while exc is not None and seen < 8:
        outcome = _classify_one(exc)
        if outcome is not None:
            return outcome
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return Outcome.FATAL


def _classify_one(exc: BaseException) -> Optional[Outcome]:
    name = type(exc).__name__
    if isinstance(exc, ShortReadError) or name in ("RetryableError",):
        return Outcome.RETRY
    if name == "PreconditionFailedError":
        return Outcome.CHANGED
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore ClientError
        code = str(response["Error"].get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status == 404 or code in _MISSING_CODES:
            return Outcome.MISSING
        if status == 412 or code == "PreconditionFailed":
            return Outcome.CHANGED
        if status >= 500 or status == 429 or code in _RETRY_CODES:
            return Outcome.RETRY
        return Outcome.FATAL
    if isinstance(exc, FileNotFoundError):
        return Outcome.MISSING
    if isinstance(exc, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError"):
        return Outcome.FATAL
    if name in ("EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
                "IncompleteReadError", "ResponseStreamingError", "ProtocolError", "HTTPClientError",
                "RustRetryableError") or isinstance(exc, (ConnectionError, TimeoutError)):
        return Outcome.RETRY
    match = _STATUS.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if match:  # MSC maps unlisted statuses (e.g. 500) to RuntimeError("... status_code: 500")
        status = int(match.group(1))
        return Outcome.RETRY if status >= 500 or status == 429 else Outcome.FATAL
    if isinstance(exc, OSError) and not isinstance(exc, PermissionError):
        return Outcome.RETRY  # resets and broken pipes surface as plain OSErrors from the socket
    return None


# --------------------------------------------------------------------------- the base


class ObjectStore:
    """One scheme's client with the project's retry policy and deadlines. Use :func:`store_for`.

    Every public method is one *operation* with a :class:`~._deadline.Deadline` of
    ``config.operation_seconds(bytes)``; reads take an optional shared ``deadline`` so that
    several requests of one read (a batch's runs, a download's chunks) share one budget.
    """

    scheme = ""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config

    def endpoint(self, url: ObjectURL) -> str:
        """Where requests for ``url`` go, as a message names it."""
        return f"{url.scheme}://{url.bucket}"

    def _retry(self, op, what: str, url: ObjectURL, nbytes: int = 0, deadline: Optional[Deadline] = None,
               request_seconds: Optional[float] = None):
        """``op`` as one operation (or a step of ``deadline``'s), each attempt within its budget."""
        c = self.config
        if deadline is None:
            deadline = Deadline(c.operation_seconds(nbytes))
        if request_seconds is None:
            request_seconds = c.request_seconds(nbytes)
        return with_retries(op, what=what, path=str(url), classify=classify, attempts=c.retries,
                            base=c.backoff, ceiling=c.backoff_max, deadline=deadline,
                            request_seconds=request_seconds)

    # The primitives each client implements (one attempt each, client exceptions allowed).
    def _head(self, url: ObjectURL) -> ObjectInfo: raise NotImplementedError
    def _get(self, url: ObjectURL, start: int, length: int, etag: str): raise NotImplementedError
    def _put(self, url: ObjectURL, path: str, size: int) -> str: raise NotImplementedError
    def _delete(self, url: ObjectURL) -> None: raise NotImplementedError
    def _put_data(self, url: ObjectURL, data: bytes, create_only: bool, if_match: str) -> str:
        raise NotImplementedError
    def _copy(self, source: ObjectURL, url: ObjectURL, info: ObjectInfo) -> str: raise NotImplementedError

    # ------------------------------------------------------------------ public, retried

    def head(self, url: ObjectURL) -> Optional[ObjectInfo]:
        """Size and ETag of ``url``, or None when it does not exist."""
        try:
            return self._retry(lambda: self._head(url), "HEAD", url)
        except ShardNotFoundError:
            return None

    def stat_files(self, url: ObjectURL, suffixes: Sequence[str]) -> Dict[str, ObjectInfo]:
        """``{suffix: ObjectInfo}`` of the objects ``url + suffix`` that exist (one HEAD each)."""
        infos = {}
        for suffix in suffixes:
            info = self.head(url.with_suffix(suffix))
            if info is not None:
                infos[suffix] = info
        return infos

    def list(self, url: ObjectURL, recursive: bool = False) -> List[Tuple[ObjectURL, ObjectInfo]]:
        """Objects whose key starts with ``url.key`` (not below a further ``/`` unless recursive).
        One operation: every page within ``config.operation_timeout``, at most
        ``config.max_list_pages`` pages, none repeating a token or a key."""
        raise NotImplementedError

    def read_range(self, url: ObjectURL, start: int, length: int, etag: str = "",
                   deadline: Optional[Deadline] = None):
        """Exactly ``length`` bytes of ``url`` from ``start`` (``If-Match: etag`` when given), as
        a read-only bytes-like object. ``deadline``: the operation this read is part of."""
        if length <= 0:
            return b""

        def op():
            data = self._get(url, start, length, etag)
            if len(data) != length:
                raise ShortReadError(f"asked for {length} bytes at {start}, got {len(data)}")
            return data

        return self._retry(op, f"GET bytes {start}-{start + length - 1}", url, length, deadline)

    def read_chunks(self, url: ObjectURL, size: int, etag: str = "", chunk: int = 16 << 20) -> Iterator[bytes]:
        """The whole object in order, ``chunk`` bytes per ranged GET (each retried on its own),
        all within one operation's deadline."""
        deadline = Deadline(self.config.operation_seconds(size))
        for start in range(0, size, chunk):
            yield self.read_range(url, start, min(chunk, size - start), etag, deadline)

    def download(self, url: ObjectURL, dest: str, info: ObjectInfo, chunk: int = 64 << 20) -> None:
        """Write ``url`` to the local file ``dest`` (created or truncated), chunk by chunk."""
        with open(dest, "wb") as f:
            for data in self.read_chunks(url, info.size, info.etag, chunk):
                f.write(data)

    def upload(self, path: str, url: ObjectURL) -> str:
        """Upload local file ``path`` to ``url``: one PUT, or above ``config.part_size`` a
        multipart upload where the client has one (:meth:`_multipart`): one operation whose
        steps are retried on their own within its deadline. Returns the object's ETag, once the
        server's answer proved it holds the bytes sent (:func:`._responses.check_write`).

        Raises:
            ResponseMismatchError: the answer names other bytes than were sent."""
        size = os.path.getsize(path)
        if size > self.config.part_size and self.multipart:
            return self._multipart(url, path, size)
        return self._retry(lambda: self._put(url, path, size), "PUT", url, size)

    multipart = False

    def _multipart(self, url: ObjectURL, path: str, size: int) -> str: raise NotImplementedError

    def put_bytes(self, url: ObjectURL, data: bytes, create_only: bool = False, if_match: str = "",
                  deadline: Optional[Deadline] = None) -> str:
        """One PUT of ``data`` (a small object: a receipt, a lock); returns its new ETag.
        ``create_only``: only if no object is there (``If-None-Match: *``); ``if_match``: only if
        the object there is still that ETag (``If-Match``). A retried conditional PUT whose first
        attempt landed fails its condition: the caller reads the object back to tell (a lock does).
        ``deadline``: the operation's budget (default: the configured one).

        Raises:
            PreconditionError: the condition does not hold (naming the URL and the condition).
            ResponseMismatchError: the answer names other bytes than were sent.
        """
        try:
            return self._retry(lambda: self._put_data(url, bytes(data), create_only, if_match), "PUT", url,
                               len(data), deadline)
        except ObjectChangedError:
            rule = "If-None-Match: * (create only)" if create_only else f"If-Match: {if_match}"
            raise PreconditionError("the object is not as this write requires: another writer created or "
                                    "replaced it", path=str(url), field="precondition", expected=rule) from None

    def copy(self, source: ObjectURL, url: ObjectURL) -> ObjectInfo:
        """Copy ``source`` to ``url`` inside the store (server-side: no byte passes through this
        process): one request up to ``config.copy_limit``, else part by part. The copy's answer is
        checked (a single-part source's ETag is its MD5: the copy's must be the same; parts
        copied must make the completed object), then its size against the source's; returns the
        copy's ObjectInfo (its size and ETag as listed after).

        Raises:
            ShardNotFoundError: no ``source``; SizeMismatchError: the copy is not the source's size;
            ObjectChangedError: the source was replaced during the copy; ResponseMismatchError:
            the copy's answer is not the source's content.
        """
        info = self.head(source)
        if info is None:
            raise ShardNotFoundError("no object to copy", path=str(source), hint="check the URL")
        answered = self._copy(source, url, info)
        got = self.head(url)
        if got is None or got.size != info.size:
            raise SizeMismatchError("the server-side copy differs in size from its source", path=str(url),
                                    field="size", expected=info.size, actual=None if got is None else got.size,
                                    hint=f"copy {source} again")
        if answered and _responses.normalize_etag(got.etag) != _responses.normalize_etag(answered):
            raise ObjectChangedError("the object copied is not the one listed after the copy (another writer "
                                     "replaced it)", path=str(url), field="ETag", expected=answered, actual=got.etag)
        return got

    def delete(self, url: ObjectURL) -> None:
        try:
            self._retry(lambda: self._delete(url), "DELETE", url)
        except ShardNotFoundError:
            pass


# --------------------------------------------------------------------------- boto3


class S3Store(ObjectStore):
    """``s3://bucket/key`` through boto3; endpoint and credentials from the AWS environment."""

    scheme = "s3"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        require_extra("s3", "boto3", user=_S3_USER)
        import boto3   # (heavy and optional, the [s3] extra: imported the first time an s3:// URL is used)
        import botocore.config as botocore_config

        # Socket timeouts bound one connect / one recv (an abandoned attempt ends by them);
        # the wall-clock budgets are enforced around every attempt (._deadline).
        cfg = botocore_config.Config(retries={"total_max_attempts": 1},
                                     max_pool_connections=max(10, 2 * config.concurrency),
                                     connect_timeout=min(10.0, config.request_timeout),
                                     read_timeout=config.request_timeout)
        self.client = boto3.session.Session().client("s3", config=cfg)
        _responses.instrument(self.client)

    def endpoint(self, url: ObjectURL) -> str:
        return f"{self.client.meta.endpoint_url} (bucket {url.bucket})"

    def stat_files(self, url: ObjectURL, suffixes: Sequence[str]) -> Dict[str, ObjectInfo]:
        """One LIST of the keys starting with ``url.key + "."``; HEADs where listing is denied
        (a listing that timed out or answered wrongly is an error, not a reason to try more)."""
        try:
            listed = self.list(url.with_suffix("."))
        except (RemoteTimeoutError, ResponseMismatchError):
            raise
        except RemoteStorageError:  # e.g. AccessDenied on ListBucket with GetObject allowed
            return super().stat_files(url, suffixes)
        by_key = {u.key: info for u, info in listed}
        return {s: by_key[url.key + s] for s in suffixes if url.key + s in by_key}

    def _head(self, url):
        _count("head")
        r = self.client.head_object(Bucket=url.bucket, Key=url.key)
        return ObjectInfo(int(r["ContentLength"]), r.get("ETag", ""))

    def list(self, url, recursive=False):
        """Page by page, each page a request of its own within the listing's deadline."""
        deadline = Deadline(self.config.operation_seconds())
        guard = _responses.PageGuard(str(url), self.config.max_list_pages)
        kwargs = {"Bucket": url.bucket, "Prefix": url.key}
        if not recursive:
            kwargs["Delimiter"] = "/"
        out = []
        while True:
            def page(kwargs=dict(kwargs)):
                _count("list")
                with _responses.expect(str(url)):
                    return self.client.list_objects_v2(**kwargs)

            r = self._retry(page, f"LIST page {guard.pages + 1}", url, deadline=deadline)
            token = guard.page(r)
            for item in r.get("Contents", []):
                out.append((ObjectURL("s3", url.bucket, item["Key"]), ObjectInfo(int(item["Size"]), item.get("ETag", ""))))
            if token is None:
                return out
            kwargs["ContinuationToken"] = token

    def _get(self, url, start, length, etag):
        """Status, Content-Range, Content-Length and ETag are checked before the body is read
        (by the handlers :func:`._responses.instrument` registered), then exactly the range."""
        _count("get")
        kwargs = {"Bucket": url.bucket, "Key": url.key, "Range": f"bytes={start}-{start + length - 1}"}
        if etag:
            kwargs["IfMatch"] = etag
        with _responses.expect(str(url)):
            body = self.client.get_object(**kwargs)["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        _count_bytes(len(data))
        return data

    multipart = True

    def _put(self, url, path, size):
        _count("put")
        with open(path, "rb") as f:
            data = f.read()
        return _responses.check_write(str(url), data,
                                      self.client.put_object(Bucket=url.bucket, Key=url.key, Body=_Body(data)))

    def _multipart(self, url, path, size):
        """Parts in parallel, each retried on its own; any failure aborts the upload (no
        orphaned parts are left billed)."""
        deadline = Deadline(self.config.operation_seconds(size))

        def create():
            _count("put")
            return self.client.create_multipart_upload(Bucket=url.bucket, Key=url.key)["UploadId"]

        upload_id = self._retry(create, "POST (start a multipart upload)", url, deadline=deadline)
        part = self.config.part_size
        starts = list(range(0, size, part))

        def send(k: int) -> dict:
            start = starts[k]
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(min(part, size - start))

            def op():
                _count("put_part", len(data))
                r = self.client.upload_part(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                            PartNumber=k + 1, Body=_Body(data))
                out = {"PartNumber": k + 1, "ETag": _responses.check_write(str(url), data, r, f"part {k + 1}")}
                if r.get("ChecksumCRC32"):   # (completing names each part's checksum where parts had one)
                    out["ChecksumCRC32"] = r["ChecksumCRC32"]
                return out

            return self._retry(op, f"PUT part {k + 1}/{len(starts)}", url, len(data), deadline)

        def complete(parts):
            _count("put")
            r = self.client.complete_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                                      MultipartUpload={"Parts": parts})
            return _responses.check_multipart(str(url), [p["ETag"] for p in parts], r)

        try:
            with futures.ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
                parts = list(pool.map(send, range(len(starts))))
            return self._retry(lambda: complete(parts), "POST (complete the multipart upload)", url,
                               deadline=deadline)
        except BaseException:
            try:  # best effort, one short operation of its own: the original error matters
                self._retry(lambda: self.client.abort_multipart_upload(Bucket=url.bucket, Key=url.key,
                                                                       UploadId=upload_id),
                            "DELETE (abort the multipart upload)", url,
                            deadline=Deadline(self.config.request_timeout))
            except Exception:
                pass
            raise

    def _delete(self, url):
        _count("delete")
        self.client.delete_object(Bucket=url.bucket, Key=url.key)

    def _put_data(self, url, data, create_only, if_match):
        _count("put")
        kwargs = {"Bucket": url.bucket, "Key": url.key, "Body": _Body(data)}
        if create_only:
            kwargs["IfNoneMatch"] = "*"
        if if_match:
            kwargs["IfMatch"] = if_match
        return _responses.check_write(str(url), data, self.client.put_object(**kwargs), "the write")

    def _copy(self, source, url, info):
        """CopyObject pinned to the source's ETag; above ``copy_limit`` UploadPartCopy in
        ``part_size`` ranges (each pinned too), in parallel, aborted on any failure."""
        pin = {"CopySourceIfMatch": info.etag} if info.etag else {}
        where = {"Bucket": source.bucket, "Key": source.key}
        if info.size <= self.config.copy_limit:
            def one():
                _count("copy", info.size)
                r = self.client.copy_object(Bucket=url.bucket, Key=url.key, CopySource=where, **pin)
                etag = (r.get("CopyObjectResult") or {}).get("ETag", "")
                if _responses.is_md5_etag(info.etag) and \
                        _responses.normalize_etag(etag) != _responses.normalize_etag(info.etag):
                    raise ResponseMismatchError("the server's answer to the copy is the ETag (MD5) of other bytes "
                                                "than the source's: it stored something else", path=str(url),
                                                field="ETag", expected=info.etag, actual=etag or None,
                                                hint=f"copy {source} again")
                return etag

            return self._retry(one, f"COPY from {source}", url, deadline=Deadline(self.config.operation_seconds()))
        deadline = Deadline(self.config.operation_seconds())

        def create():
            _count("put")
            return self.client.create_multipart_upload(Bucket=url.bucket, Key=url.key)["UploadId"]

        upload_id = self._retry(create, "POST (start a multipart copy)", url, deadline=deadline)
        part = self.config.part_size
        starts = list(range(0, info.size, part))

        def send(k: int) -> dict:
            end = min(info.size, starts[k] + part) - 1

            def op():
                _count("copy_part", end + 1 - starts[k])
                r = self.client.upload_part_copy(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                                 PartNumber=k + 1, CopySource=where,
                                                 CopySourceRange=f"bytes={starts[k]}-{end}", **pin)
                return {"PartNumber": k + 1, "ETag": r["CopyPartResult"]["ETag"]}

            return self._retry(op, f"COPY part {k + 1}/{len(starts)} from {source}", url, deadline=deadline)

        try:
            with futures.ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
                parts = list(pool.map(send, range(len(starts))))

            def complete():
                _count("put")
                r = self.client.complete_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                                          MultipartUpload={"Parts": parts})
                return _responses.check_multipart(str(url), [p["ETag"] for p in parts], r)

            return self._retry(complete, "POST (complete the multipart copy)", url, deadline=deadline)
        except BaseException:
            try:
                self._retry(lambda: self.client.abort_multipart_upload(Bucket=url.bucket, Key=url.key,
                                                                       UploadId=upload_id),
                            "DELETE (abort the multipart copy)", url, deadline=Deadline(self.config.request_timeout))
            except Exception:
                pass
            raise


class _Body(io.BytesIO):
    """A request body that stops being sent once its attempt is over (abandoned at its deadline,
    or by a signal in the caller): the server gets a short body and stores nothing, so an
    abandoned PUT cannot land after its caller reported it failed (unless it was all sent)."""

    def read(self, size=-1):
        check_attempt()
        return super().read(size)


# --------------------------------------------------------------------------- multi-storage-client


class MscStore(ObjectStore):
    """``msc://profile/path`` through multi-storage-client (its config names the backend).

    MSC runs each call in its own code, so a call is one attempt here (MSC's own retries, as
    its profile sets them, run inside that attempt's budget). A profile on S3-compatible
    storage has a boto3 client inside; :func:`._responses.instrument` puts the response
    checks, the ``If-Match`` pin and the page guard on it (``instrumented`` says whether it
    could). Errors MSC wraps in its own are unwrapped to the project's.
    """

    scheme = "msc"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        require_extra("s3", "multistorageclient", user=_MSC_USER)
        import multistorageclient   # (heavy and optional, the [s3] extra: the first msc:// URL)

        self._msc = multistorageclient
        self._clients: Dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.instrumented: Dict[str, bool] = {}

    def _client(self, url: ObjectURL):
        # MSC's own cache keeps the first client made for a profile name for the whole process;
        # keyed here also by the config file (and its mtime), a changed MSC_CONFIG is honoured.
        key = (url.bucket, *_msc_config_identity())
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._msc.StorageClient(config=self._msc.StorageClientConfig.from_file(profile=url.bucket))
                boto = getattr(getattr(client, "_storage_provider", None), "_s3_client", None)
                if boto is not None and hasattr(getattr(boto, "meta", None), "events"):
                    _responses.instrument(boto)
                self.instrumented[url.bucket] = boto is not None
                self._clients[key] = client
        return client

    def _head(self, url):
        _count("head")
        meta = _unwrapped(lambda: self._client(url).info(url.key))
        if getattr(meta, "type", "file") != "file":   # MSC answers for a "directory" too; S3 has no such object
            raise FileNotFoundError(2, "not an object (a directory)", str(url))
        return ObjectInfo(int(meta.content_length), meta.etag or "")

    def list(self, url, recursive=False):
        """MSC lists directories, not key prefixes: list the key's directory, keep the prefix.
        MSC pages inside one call: the call is one attempt with the listing's whole budget,
        its pages guarded, its entries counted against ``max_list_pages`` pages' worth."""
        deadline = Deadline(self.config.operation_seconds())
        return self._retry(lambda: self._list(url, recursive), "LIST", url, deadline=deadline,
                           request_seconds=deadline.seconds)

    def _list(self, url, recursive):
        _count("list")
        client = self._client(url)
        directory = url.key[: url.key.rfind("/") + 1]
        guard = _responses.PageGuard(str(url), self.config.max_list_pages)
        most = 1000 * self.config.max_list_pages
        out, seen = [], 0

        def walk():
            nonlocal seen
            with _responses.expect(str(url), guard=guard):
                for meta in client.list(path=directory, include_directories=not recursive):
                    seen += 1
                    check_attempt()
                    if seen > most:
                        raise ResponseMismatchError(
                            f"the listing did not end within {most} entries", path=str(url), field="max_list_pages",
                            expected=self.config.max_list_pages)
                    key = meta.key
                    if getattr(meta, "type", "file") != "file" or not key.startswith(url.key):
                        continue
                    if not recursive and "/" in key[len(directory):]:
                        continue
                    out.append((ObjectURL("msc", url.bucket, key),
                                ObjectInfo(int(meta.content_length), meta.etag or "")))

        _unwrapped(walk)
        return out

    def _get(self, url, start, length, etag):
        _count("get")
        pin = f'"{_responses.normalize_etag(etag)}"' if etag else ""
        with _responses.expect(str(url), etag=pin):
            data = _unwrapped(lambda: self._client(url).read(
                url.key, byte_range=self._msc.types.Range(offset=start, size=length)))
        _count_bytes(len(data))
        return data if isinstance(data, (bytes, memoryview)) else bytes(data)

    def _put(self, url, path, size):
        _count("put")
        _unwrapped(lambda: self._client(url).upload_file(url.key, path))
        return self._written(url, size, lambda: _file_md5(path))

    def _written(self, url, size: int, md5) -> str:
        """MSC gives no answer to a write: the object is asked for (HEAD) instead, and must be
        ``size`` bytes and, when its ETag is an MD5 (a single-part upload), ``md5()``; a multipart
        upload's ETag cannot be recomputed without MSC's part size (its size is checked).

        Raises:
            ResponseMismatchError: the object is not what was sent."""
        meta = _unwrapped(lambda: self._client(url).info(url.key))
        etag = getattr(meta, "etag", "") or ""
        length = getattr(meta, "content_length", None)
        if length is None or int(length) != size:
            raise ResponseMismatchError("the object written is not the size that was sent", path=str(url),
                                        field="size", expected=size, actual=length)
        if _responses.is_md5_etag(etag) and _responses.normalize_etag(etag) != md5():
            raise ResponseMismatchError("the object written has the ETag (MD5) of other bytes than were sent",
                                        path=str(url), field="ETag", actual=etag)
        return etag

    def _delete(self, url):
        _count("delete")
        _unwrapped(lambda: self._client(url).delete(url.key))

    def _put_data(self, url, data, create_only, if_match):
        if create_only or if_match:
            raise ShardError("conditional writes (locks in object storage) are not available through msc://",
                             path=str(url), field="precondition",
                             hint="give the store or work directory as an s3:// URL of the same bucket")
        _count("put")
        _unwrapped(lambda: self._client(url).write(url.key, data))
        return self._written(url, len(data), lambda: hashlib.md5(data).hexdigest())

    def _copy(self, source, url, info):
        if source.bucket != url.bucket:
            raise ShardError("msc:// copies only within one profile", path=str(url), field="source",
                             actual=str(source))
        _count("copy", info.size)
        _unwrapped(lambda: self._client(url).copy(source.key, url.key))
        return ""


def _file_md5(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unwrapped(call):
    """``call()``, with a project error that MSC wrapped in its own exception raised as itself."""
    try:
        return call()
    except ShardError:
        raise
    except Exception as exc:
        inner, seen = exc.__cause__ or exc.__context__, 0
        while inner is not None and seen < 8:
            if isinstance(inner, ShardError):
                raise inner from None
            inner, seen = inner.__cause__ or inner.__context__, seen + 1
        raise


def _msc_config_identity() -> tuple:
    """Which MSC config a client made now would read: ``MSC_CONFIG`` and that file's mtime."""
    path = os.environ.get("MSC_CONFIG", "")
    try:
        return path, os.stat(path).st_mtime_ns if path else 0
    except OSError:
        return path, 0


# --------------------------------------------------------------------------- per process

_STORES: Dict[tuple, ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def store_for(url: ObjectURL, config: StorageConfig) -> ObjectStore:
    """This process's store for ``url``'s scheme and ``config`` (created on first use)."""
    key = (os.getpid(), url.scheme, config)
    store = _STORES.get(key)
    if store is None:
        with _STORES_LOCK:
            store = _STORES.get(key)
            if store is None:
                store = (S3Store if url.scheme == "s3" else MscStore)(config)
                _STORES[key] = store
    return store
