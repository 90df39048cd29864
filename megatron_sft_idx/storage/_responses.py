"""A response is checked against its request before its body is read, and no more is read
than was asked for.

For a GET (ranged, as every read of this package is), before the first body byte:

* status ``206``, or ``200`` only when the range asked for is the whole object (a server
  that ignores ``Range`` and starts sending a 600 MiB object for a 143 KB read is refused
  here, not after it filled memory);
* ``Content-Range`` is exactly the range asked for, and ``Content-Length`` its length;
* ``ETag`` is the one the request pinned with ``If-Match`` (a gateway that ignores
  ``If-Match`` and serves the replaced object is refused: :class:`ObjectChangedError`).

The body is then read in pieces of at most :data:`PIECE` bytes, each at most one socket
read, up to ``Content-Length`` and never past it; between pieces the request's deadline is
checked (:mod:`._deadline`), so a trickling server is abandoned on time. A full-object
response carrying ``x-amz-checksum-crc32`` is checked against it.

For a listing, :class:`PageGuard` refuses a page that cannot be progress: a continuation
token seen before, "more results" without a token, a key listed twice, more pages than
``max_list_pages``.

A write is checked like a read (:func:`check_write`): the answer to a PUT (an object, or one part
of a multipart upload) must prove the server holds the bytes sent -- its ``x-amz-checksum-crc32``
equal to the CRC-32 of those bytes, or, when it gives none, its ETag their MD5 -- and a completed
multipart upload's ETag must be the one its parts make (:func:`check_multipart`). An answer that
proves neither is :class:`~megatron_sft_idx.errors.ResponseMismatchError`: a server that stored
other bytes than were sent never makes a write look done.

Both run as botocore event handlers (:func:`instrument`), so the same checks hold for our
boto3 client and for multi-storage-client's, whose ``read`` returns a body it read itself.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import zlib
from typing import List, Optional, Sequence, Set, Tuple

from .._crc import crc32
from ..errors import ObjectChangedError, ResponseMismatchError
from ._deadline import check_attempt
from ._retry import ShortReadError

#: Largest piece of a body read at once (a piece is at most one socket read).
PIECE = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)")
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{1,19})")
_DIGITS = re.compile(r"\d{1,19}")
_MD5 = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG = re.compile(r"([0-9a-f]{32})-(\d{1,5})")

_local = threading.local()


def normalize_etag(tag: Optional[str]) -> str:
    """``"abc"``, ``abc`` and ``W/"abc"`` are the same entity tag."""
    text = (tag or "").strip()
    if text.startswith("W/"):
        text = text[2:]
    return text.strip('"')


def parse_range(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """``(first, last)`` of a ``Range: bytes=first-last`` header; None when absent or another form."""
    match = _RANGE.fullmatch((text or "").strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def expected_length(path: str, status: int, headers, sent_range: Optional[Tuple[int, int]],
                    if_match: str) -> int:
    """Bytes the body of this GET response must have, from its status and headers checked
    against the request (see the module doc). ``headers`` is case-insensitive (botocore's).

    Raises:
        ResponseMismatchError: status, Content-Range or Content-Length do not answer the request.
        ObjectChangedError: the ETag is not the one ``If-Match`` asked for.
    """
    length_text = (headers.get("content-length") or "").strip()
    if not _DIGITS.fullmatch(length_text):
        raise ResponseMismatchError("the response carries no valid Content-Length", path=path,
                                    field="Content-Length", actual=length_text or None)
    length = int(length_text)
    if if_match:
        tag = headers.get("etag")
        if not tag:
            raise ResponseMismatchError("the response carries no ETag, so it cannot be matched to the object "
                                        "opened", path=path, field="ETag", expected=if_match)
        if normalize_etag(tag) != normalize_etag(if_match):
            raise ObjectChangedError("the server answered with another version of the object (it ignored "
                                     "If-Match): reading on would mix two generations", path=path, field="ETag",
                                     expected=if_match, actual=tag)
    if sent_range is None:
        return length
    first, last = sent_range
    want = last - first + 1
    asked = f"bytes {first}-{last}"
    if status == 200:
        if first == 0 and length == want:
            return length  # the whole object is exactly the range asked for
        raise ResponseMismatchError("the server ignored Range and sent the whole object; it was not read",
                                    path=path, field="status", expected=f"206 with {asked}",
                                    actual=f"200 with {length} bytes")
    if status != 206:
        raise ResponseMismatchError(f"unexpected status {status} for a ranged GET", path=path, field="status",
                                    expected=206, actual=status)
    content_range = (headers.get("content-range") or "").strip()
    match = _CONTENT_RANGE.fullmatch(content_range)
    if match is None or (int(match.group(1)), int(match.group(2))) != (first, last) or (
            match.group(3) != "*" and int(match.group(3)) <= last):
        raise ResponseMismatchError("Content-Range is not the range asked for; the body was not read", path=path,
                                    field="Content-Range", expected=f"{asked}/<size>", actual=content_range or None)
    if length != want:
        raise ResponseMismatchError("Content-Length is not the length of the range asked for; the body was not "
                                    "read", path=path, field="Content-Length", expected=want, actual=length)
    return length


def read_exactly(raw, length: int, path: str, crc32: Optional[int] = None) -> memoryview:
    """``length`` bytes of the response body ``raw`` (urllib3), read-only, in pieces of at most
    :data:`PIECE` bytes (one socket read each), never past ``length``; the connection is
    dropped on any failure and reused after success.

    Raises:
        ShortReadError: the body ended early, or its CRC-32 is not ``crc32`` (retried).
        AttemptTimeout: the attempt's deadline passed or its caller gave up (between pieces).
    """
    read1 = getattr(raw, "read1", None) or raw._fp.read1  # urllib3 1.26 has no read1: http.client's
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    try:
        while got < length:
            check_attempt()
            piece = read1(min(PIECE, length - got))
            n = len(piece)
            if n == 0:
                raise ShortReadError(f"the body ended after {got} of {length} bytes")
            if n > length - got:
                raise ShortReadError(f"the body ran past its {length} bytes")
            view[got:got + n] = piece
            got += n
        if crc32 is not None and zlib.crc32(view) != crc32:
            raise ShortReadError("the body does not match its x-amz-checksum-crc32")
    except BaseException:
        raw.close()  # never reuse a connection with unread bytes on it
        raise
    release = getattr(raw, "release_conn", None)
    if release is not None:
        release()
    return view.toreadonly()


def check_write(path: str, data, answer: dict, what: str = "the upload") -> str:
    """The ETag of the server's ``answer`` (a parsed PutObject / UploadPart response) to ``data``
    sent to ``path``, once the answer proves the server holds those bytes: its
    ``ChecksumCRC32`` equal to their CRC-32, else (no checksum answered) its ETag their MD5.
    Returns the ETag as answered. ``what`` names the write in the error.

    Raises:
        ResponseMismatchError: the answer names other bytes, or proves nothing (no checksum, an
            ETag that is not an MD5)."""
    etag = answer.get("ETag") or ""
    checksum = answer.get("ChecksumCRC32")
    if checksum:
        sent = base64.b64encode(crc32(data).to_bytes(4, "big")).decode()
        if checksum != sent:
            raise ResponseMismatchError(f"the server's answer to {what} carries the CRC-32 of other bytes than "
                                        "were sent: it stored something else", path=path,
                                        field="x-amz-checksum-crc32", expected=sent, actual=checksum,
                                        hint="the object cannot be trusted; write it again, and check the store "
                                             "or the proxy in front of it")
        return etag
    tag = normalize_etag(etag)
    if not _MD5.fullmatch(tag):
        raise ResponseMismatchError(f"the server's answer to {what} proves nothing of what it stored (no "
                                    "CRC-32 checksum, and an ETag that is not an MD5)", path=path, field="ETag",
                                    actual=etag or None, hint="use a store that answers x-amz-checksum-crc32 "
                                                              "(S3 and S3-compatible stores do for boto3 uploads)")
    sent = hashlib.md5(data).hexdigest()
    if tag != sent:
        raise ResponseMismatchError(f"the server's answer to {what} is the ETag (MD5) of other bytes than were "
                                    "sent: it stored something else", path=path, field="ETag", expected=sent,
                                    actual=tag, hint="the object cannot be trusted; write it again, and check the "
                                                     "store or the proxy in front of it")
    return etag


def check_multipart(path: str, parts: Sequence[str], answer: dict) -> str:
    """The ETag of a completed multipart upload (``answer``) whose parts were answered with the
    ETags ``parts`` (each already proven by :func:`check_write`): when every part's ETag is an MD5,
    the object's must be S3's composite of them (the MD5 of their digests, ``-`` the part count).
    Returns the ETag as answered.

    Raises:
        ResponseMismatchError: the completed object is not the parts sent."""
    etag = answer.get("ETag") or ""
    tags: List[str] = [normalize_etag(p) for p in parts]
    if all(_MD5.fullmatch(t) for t in tags):
        want = f"{hashlib.md5(b''.join(bytes.fromhex(t) for t in tags)).hexdigest()}-{len(tags)}"
        if normalize_etag(etag) != want:
            raise ResponseMismatchError("the completed multipart upload is not the parts that were sent (its ETag "
                                        "is not theirs)", path=path, field="ETag", expected=want, actual=etag or None,
                                        hint="the object cannot be trusted; upload it again")
    return etag


def is_md5_etag(etag: str) -> bool:
    """Whether ``etag`` is of the form a single-part upload's MD5 ETag has."""
    return bool(_MD5.fullmatch(normalize_etag(etag)))


class BoundedBody:
    """Stands in for botocore's ``StreamingBody`` once the response passed :func:`expected_length`."""

    def __init__(self, raw, length: int, path: str, crc32: Optional[int]) -> None:
        self._raw, self._length, self._path, self._crc32 = raw, length, path, crc32
        self._done = False

    def read(self, amt=None) -> memoryview:
        """The whole body (``amt`` is accepted for the interface and ignored: a body is read once)."""
        if self._done:
            return memoryview(b"")
        self._done = True
        return read_exactly(self._raw, self._length, self._path, self._crc32)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._raw.close()


class PageGuard:
    """Refuses a listing page that cannot be progress (see the module doc)."""

    def __init__(self, path: str, max_pages: int) -> None:
        self.path, self.max_pages = path, max_pages
        self.pages = 0
        self.tokens: Set[str] = set()
        self.keys: Set[str] = set()

    def page(self, parsed: dict, first: bool = False) -> Optional[str]:
        """Check one parsed ListObjectsV2 page; returns its continuation token (None: last page).
        ``first``: the request carried no continuation token, so the client started a listing
        (MSC lists more than once in one call); tokens and keys are counted afresh, pages not.

        Raises:
            ResponseMismatchError: a repeated token or key, a truncated page without a token,
                more than ``max_pages`` pages.
        """
        if first:
            self.tokens.clear()
            self.keys.clear()
        self.pages += 1
        for item in parsed.get("Contents", []) or []:
            key = item.get("Key")
            if key in self.keys:
                raise ResponseMismatchError("the listing returned a key it had already returned: it started over",
                                            path=self.path, field="Key", actual=key)
            self.keys.add(key)
        if not parsed.get("IsTruncated"):
            return None
        token = parsed.get("NextContinuationToken")
        if not token:
            raise ResponseMismatchError("a listing page says more results follow but carries no continuation "
                                        "token", path=self.path, field="NextContinuationToken")
        if token in self.tokens:
            raise ResponseMismatchError("the listing repeated a continuation token: it would never end",
                                        path=self.path, field="NextContinuationToken", actual=token[:80])
        if self.pages >= self.max_pages:
            raise ResponseMismatchError(f"the listing did not end within {self.max_pages} pages", path=self.path,
                                        field="max_list_pages", expected=self.max_pages,
                                        hint="list a narrower prefix, or raise MEGATRON_SFT_IDX_MAX_LIST_PAGES")
        self.tokens.add(token)
        return token


# --------------------------------------------------------------------------- botocore handlers


class expect:
    """Within this block, on this thread: GETs carry ``If-Match: etag`` (when given and not
    already set), errors name ``path``, listing pages go through ``guard``."""

    def __init__(self, path: str, etag: str = "", guard: Optional[PageGuard] = None) -> None:
        self.state = (path, etag, guard)

    def __enter__(self) -> "expect":
        self.saved = getattr(_local, "state", None)
        _local.state = self.state
        return self

    def __exit__(self, *exc) -> None:
        _local.state = self.saved


def _state(params_or_context: dict) -> Tuple[str, str, Optional[PageGuard]]:
    state = getattr(_local, "state", None)
    if state is not None:
        return state
    return (params_or_context.get("msi_path", "s3 object"), "", None)


def instrument(client) -> None:
    """Register this module's checks on a boto3 S3 ``client`` (once per client)."""
    if getattr(client, "_msi_instrumented", False):
        return
    events = client.meta.events
    events.register("before-parameter-build.s3.GetObject", _before_get)
    events.register("before-call.s3.GetObject", _record_request)
    events.register("after-call.s3.GetObject", _check_get)
    events.register("before-parameter-build.s3.ListObjectsV2", _before_list)
    events.register("after-call.s3.ListObjectsV2", _check_page)
    client._msi_instrumented = True


def _before_get(params, context, **kwargs) -> None:
    context["msi_path"] = f"s3://{params.get('Bucket')}/{params.get('Key')}"
    path, etag, _ = _state(context)
    if etag and not params.get("IfMatch"):
        params["IfMatch"] = etag


def _record_request(params, context, **kwargs) -> None:
    headers = params.get("headers", {})
    context["msi_sent"] = (parse_range(headers.get("Range")), headers.get("If-Match", ""))


def _check_get(http_response, parsed, context, **kwargs) -> None:
    if http_response.status_code >= 300 or "msi_sent" not in context:
        return  # botocore raises its ClientError for this status; nothing here to read
    path = _state(context)[0]
    sent_range, if_match = context["msi_sent"]
    headers = http_response.headers
    try:
        length = expected_length(path, http_response.status_code, headers, sent_range, if_match)
    except BaseException:
        http_response.raw.close()  # refused before the body: the connection is dropped, never read
        raise
    parsed["Body"] = BoundedBody(http_response.raw, length, path, _full_crc32(headers, length))


def _full_crc32(headers, length: int) -> Optional[int]:
    """The object's CRC-32 when the response covers the whole object and carries one."""
    text = headers.get("x-amz-checksum-crc32")
    match = _CONTENT_RANGE.fullmatch((headers.get("content-range") or "").strip())
    whole = match is None or (match.group(1) == "0" and match.group(3) == str(length))
    if not text or not whole:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def _before_list(params, context, **kwargs) -> None:
    context["msi_first_page"] = not params.get("ContinuationToken")


def _check_page(parsed, context, **kwargs) -> None:
    guard = _state({})[2]
    if guard is not None and parsed.get("ResponseMetadata", {}).get("HTTPStatusCode", 200) < 300:
        guard.page(parsed, first=context.get("msi_first_page", False))
