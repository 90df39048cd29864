"""A real S3 API on loopback for the remote tests and the remote benchmark.

``python -m bench.s3loop`` serves one in its own process (the benchmark's readers must not
share a GIL with the server) and prints ``{"endpoint": ..., "direct": ...}``; it stops
when its stdin closes. ``GET /__loop/stats`` on the proxy returns the request counts,
``POST /__loop/clear`` resets them.

``S3Loop`` starts moto's ``ThreadedMotoServer`` on 127.0.0.1 and, in front of it, a
small HTTP proxy that forwards every request unchanged, counts them (method, key,
range, bytes sent) and injects faults on demand. Transient ones: a connection reset after
part of the body has been sent, a truncated body, a ``500 InternalError``, a ``503 SlowDown``.
Hostile ones, as a broken server or proxy behaves (:data:`HOSTILE`):

* ``stall`` — take the request, never answer (until the fault is cleared); ``slow-read`` —
  take a request body 64 KiB every ``interval`` seconds (a client that gives up leaves a short
  body, logged as ``PUT-short``, and nothing is stored);
* ``trickle`` — answer, then send the body a byte every ``interval`` seconds;
  ``trickle-headers`` — the status line and headers themselves a byte at a time;
* ``ignore-range`` — forward without ``Range`` (and ``If-Match``): the whole object, ``200``;
* ``ignore-if-match`` — forward without ``If-Match``: a replaced object is served anyway;
  ``ignore-conditional`` — forward a write without ``If-None-Match`` and ``If-Match``: a
  create-only or pinned PUT replaces whatever is there (older MinIO and Ceph RGW, some gateways);
  ``corrupt-write`` — forward a write's body with one byte flipped (in its middle) and without
  its checksum headers: the server stores other bytes than were sent, and answers for those;
* ``shift-range`` — forward the range moved by ``amount`` bytes (``Content-Range`` honest
  about it: the bytes are not the ones asked for); ``lie-content-range`` — the right bytes
  under a ``Content-Range`` moved by ``amount``; ``lie-content-length`` — a
  ``Content-Length`` off by ``amount`` and a body of that length;
* ``list-forever`` — every ListObjectsV2 page says more follows, with the same continuation
  token; ``list-cycle`` — two tokens in turn; ``list-fresh`` — a new token every page, the
  same keys; ``list-no-token`` — more follows, without a token.

Clients are pointed at the proxy with ``AWS_ENDPOINT_URL`` (boto3) or an MSC profile's
``endpoint_url``. ``python -m bench.s3loop`` serves one in its own process;
:class:`LoopProcess` starts it and drives it over HTTP (``POST /__loop/fault`` with a JSON
fault, ``/__loop/clear``, ``/__loop/stats``), so a test can measure its own memory without
the server's.

Nothing here is a stub of S3: requests reach moto's S3 implementation, byte ranges,
ETags, multipart uploads and ``If-Match`` included; the hostile faults change only what
they name.
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import re
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, List, Optional
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


TRANSIENT = ("reset", "500", "503", "truncate")
HOSTILE = ("stall", "slow-read", "trickle", "trickle-headers", "ignore-range", "ignore-if-match",
           "ignore-conditional", "corrupt-write", "shift-range",
           "lie-content-range", "lie-content-length", "list-forever", "list-cycle", "list-fresh",
           "list-no-token")
#: Longest a stalled or trickled answer is held (a cleared fault or a stopped server ends it sooner).
HOLD_SECONDS = 120.0


class Fault:
    """Inject ``action`` into the next ``times`` requests that ``match(method, key, headers)``
    (and whose query string contains ``query``). ``interval``: seconds between trickled bytes;
    ``amount``: bytes a shifted range or a lying header is off by."""

    def __init__(self, action: str, match: Callable[[str, str, dict], bool], times: int = 1, query: str = "",
                 interval: float = 0.5, amount: int = 1) -> None:
        if action not in TRANSIENT + HOSTILE:
            raise ValueError(action)
        self.action, self.match, self.left = action, match, times
        self.query, self.interval, self.amount = query, interval, amount
        self.pages = 0

    @classmethod
    def from_spec(cls, spec: dict) -> "Fault":
        """A fault from JSON: ``{"action", "method", "suffix", "query", "times", "interval", "amount"}``."""
        method, suffix = spec.get("method"), spec.get("suffix", "")
        return cls(spec["action"], lambda m, k, h: (method is None or m == method) and k.endswith(suffix),
                   int(spec.get("times", 1)), spec.get("query", ""), float(spec.get("interval", 0.5)),
                   int(spec.get("amount", 1)))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_ProxyServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes: without TCP_NODELAY, Nagle's algorithm and
        # the client's delayed ACK stall some responses by ~40 ms each.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length", 0) or 0)
        return self.rfile.read(length) if length else b""

    def _control(self, body: bytes) -> None:
        loop = self.server.loop
        if self.path.startswith("/__loop/clear"):
            loop.clear()
        elif self.path.startswith("/__loop/fault"):
            spec = json.loads(body)
            fault = Fault.from_spec(spec)
            with loop._lock:
                loop.faults.append(fault)
        with loop._lock:
            payload = json.dumps({"requests": [list(r) for r in loop.requests],
                                  "injected": dict(loop.injected)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _forward(self) -> None:
        if self.path.startswith("/__loop/"):
            return self._control(self._body())
        loop = self.server.loop
        split = urlsplit(self.path)
        key = unquote(split.path)
        fault = loop._take_fault(self.command, key, dict(self.headers), split.query)
        action = fault.action if fault is not None else None
        if action == "slow-read":
            body = self._slow_body(fault)
            if body is None:
                return
        else:
            body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            headers["Content-Length"] = str(len(body))
        if action in ("500", "503"):
            loop._record(self.command, key, self.headers.get("Range"), 0)
            return self._error(int(action), key)
        if action == "stall":
            loop._record(self.command, key, self.headers.get("Range"), 0)
            loop._hold(HOLD_SECONDS)
            self.close_connection = True
            return
        path = self.path
        if fault is not None:
            path, headers = _hostile_request(fault, split, headers)
            if action == "corrupt-write" and body:
                middle = len(body) // 2
                body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
        conn = http.client.HTTPConnection(*loop.upstream, timeout=60)
        try:
            conn.request(self.command, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
        finally:
            conn.close()
        if fault is not None:
            status, resp_headers, data = _hostile_response(fault, status, resp_headers, data)
        loop._record(self.command, key, self.headers.get("Range"), len(data))
        if action in ("trickle", "trickle-headers"):
            return self._trickle(fault, status, reason, resp_headers, data)
        self._send(fault, status, reason, resp_headers, data)

    def _send(self, fault: Optional[Fault], status: int, reason: str, resp_headers, data: bytes) -> None:
        """The answer, as the fault (if any) has it: a lying length, a reset or a cut body."""
        action = fault.action if fault is not None else None
        self.send_response(status, reason)
        head = self.command == "HEAD"
        for k, v in resp_headers:
            if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                self.send_header(k, v)
        if not head:
            length = len(data) + (fault.amount if action == "lie-content-length" else 0)
            self.send_header("Content-Length", str(length))
            if action == "lie-content-length":  # the body the header promises: real bytes, then filler
                data = (data + b"\0" * max(0, fault.amount))[:max(0, length)]
        self.end_headers()
        if head:
            return
        if action in ("reset", "truncate") and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if action == "reset":  # RST instead of FIN: the client sees ECONNRESET mid-body
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        self.wfile.write(data)

    def _slow_body(self, fault: "Fault") -> Optional[bytes]:
        """The request body 64 KiB every ``fault.interval`` s; None (logged ``<METHOD>-short``)
        when the client hangs up first."""
        loop, want = self.server.loop, int(self.headers.get("Content-Length", 0) or 0)
        out = bytearray()
        while len(out) < want:
            if loop._hold(fault.interval):
                break
            piece = self.rfile.read1(min(64 << 10, want - len(out)))
            if not piece:
                break
            out += piece
        if len(out) < want:
            loop._record(self.command + "-short", unquote(urlsplit(self.path).path), None, len(out))
            self.close_connection = True
            return None
        return bytes(out)

    def _trickle(self, fault: "Fault", status: int, reason: str, headers, data: bytes) -> None:
        """The answer a byte every ``fault.interval`` s: its headers too for ``trickle-headers``."""
        is_head = self.command == "HEAD"  # a HEAD keeps the object's Content-Length
        head = [f"HTTP/1.1 {status} {reason}\r\n".encode()]
        for k, v in headers:
            if k.lower() not in _HOP and (is_head or k.lower() != "content-length"):
                head.append(f"{k}: {v}\r\n".encode())
        head.append(b"\r\n" if is_head else f"Content-Length: {len(data)}\r\n\r\n".encode())
        head = b"".join(head)
        slow = head + data if fault.action == "trickle-headers" else data
        if fault.action == "trickle":
            self.wfile.write(head)
            self.wfile.flush()
        loop = self.server.loop
        try:
            for i in range(len(slow)):
                if loop._hold(fault.interval):
                    break  # cleared or stopped
                self.wfile.write(slow[i:i + 1])
                self.wfile.flush()
        except OSError:
            pass  # the client gave up: what a deadline is for
        self.close_connection = True

    def _error(self, status: int, key: str) -> None:
        code, message = _ERRORS[status]
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}'
                f'</Message><Resource>{key}</Resource><RequestId>loop</RequestId></Error>').encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


def _hostile_request(fault: Fault, split, headers: dict) -> tuple:
    """The request as a hostile fault forwards it: ``(path, headers)``."""
    action = fault.action
    drop = {"ignore-range": ("range", "if-match"), "ignore-if-match": ("if-match",),
            "ignore-conditional": ("if-match", "if-none-match")}.get(action, ())
    headers = {k: v for k, v in headers.items() if k.lower() not in drop
               and not (action == "corrupt-write" and (k.lower().startswith("x-amz-checksum")
                                                       or k.lower() in ("content-md5", "x-amz-sdk-checksum-algorithm")))}
    path = split.path + (f"?{split.query}" if split.query else "")
    if action == "shift-range":
        for k, v in list(headers.items()):
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", v.strip()) if k.lower() == "range" else None
            if m:
                headers[k] = f"bytes={int(m.group(1)) + fault.amount}-{int(m.group(2)) + fault.amount}"
    if action.startswith("list-") and "list-type=2" in split.query:  # always the first page upstream
        query = [(k, v) for k, v in parse_qsl(split.query, keep_blank_values=True) if k != "continuation-token"]
        path = split.path + "?" + urlencode(query)
    return path, headers


def _hostile_response(fault: Fault, status: int, headers, data: bytes) -> tuple:
    """The response as a hostile fault returns it: ``(status, headers, body)``."""
    action = fault.action
    if action == "lie-content-range":
        out = []
        for k, v in headers:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", v.strip()) if k.lower() == "content-range" else None
            if m:
                a, b = int(m.group(1)) + fault.amount, int(m.group(2)) + fault.amount
                v = f"bytes {a}-{b}/{m.group(3)}"
            out.append((k, v))
        headers = out
    if action.startswith("list-") and status == 200 and b"<ListBucketResult" in data:
        fault.pages += 1
        token = {"list-forever": "same-token", "list-cycle": f"token-{fault.pages % 2}",
                 "list-fresh": f"fresh-{fault.pages}", "list-no-token": ""}[action]
        text = data.decode("utf-8")
        text = re.sub(r"<IsTruncated>\w+</IsTruncated>", "<IsTruncated>true</IsTruncated>", text)
        text = re.sub(r"<NextContinuationToken>.*?</NextContinuationToken>", "", text)
        if token:
            text = text.replace("</ListBucketResult>",
                                f"<NextContinuationToken>{token}</NextContinuationToken></ListBucketResult>")
        data = text.encode("utf-8")
    return status, headers, data


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up is not news
            super().handle_error(request, client_address)


class _Clients:
    """What a client of the server needs: the AWS variables, a boto3 client, buckets, MSC profiles.
    Subclasses set ``endpoint`` (the proxy) and ``direct_endpoint`` (moto itself)."""

    endpoint = direct_endpoint = ""

    def env(self, endpoint: Optional[str] = None) -> dict:
        """The standard AWS variables pointing boto3 at this server (through the proxy)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REGION": "us-east-1"}

    def client(self, direct: bool = True):
        import boto3

        return boto3.client("s3", endpoint_url=self.direct_endpoint if direct else self.endpoint,
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            region_name="us-east-1")

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def msc_config(self, path: str, profile: str, bucket: str) -> str:
        """Write an MSC config with an s3 profile ``profile`` on ``bucket`` through the proxy."""
        config = {"profiles": {profile: {
            "storage_provider": {"type": "s3", "options": {"base_path": bucket, "endpoint_url": self.endpoint,
                                                           "region_name": "us-east-1"}},
            "credentials_provider": {"type": "S3Credentials",
                                     "options": {"access_key": "testing", "secret_key": "testing"}},
            "retry": {"attempts": 1, "delay": 0.01}}}}
        with open(path, "w") as f:
            json.dump(config, f)
        return path


class S3Loop(_Clients):
    """moto on 127.0.0.1 behind a counting, fault-injecting proxy. Use as a context manager."""

    def __init__(self) -> None:
        self.requests: List[tuple] = []
        self.faults: List[Fault] = []
        self.injected = collections.Counter()
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._moto = None
        self._proxy: Optional[_ProxyServer] = None

    def start(self) -> "S3Loop":
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        self.upstream = self._moto.get_host_and_port()
        self._proxy = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._proxy.loop = self
        threading.Thread(target=self._proxy.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self.direct_endpoint = "http://%s:%d" % self.upstream
        return self

    def stop(self) -> None:
        self._release.set()
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
        if self._moto is not None:
            self._moto.stop()

    def __enter__(self) -> "S3Loop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ counting and faults

    def _record(self, method: str, key: str, byte_range: Optional[str], nbytes: int) -> None:
        with self._lock:
            self.requests.append((method, key, byte_range, nbytes))

    def _take_fault(self, method: str, key: str, headers: dict, query: str = "") -> Optional[Fault]:
        with self._lock:
            for fault in self.faults:
                if fault.left > 0 and fault.query in query and fault.match(method, key, headers):
                    fault.left -= 1
                    self.injected[fault.action] += 1
                    return fault
        return None

    def _hold(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the faults are cleared or the server stops; True if they were."""
        with self._lock:
            release = self._release
        return release.wait(seconds)

    def inject(self, action: str, match: Callable[[str, str, dict], bool], times: int = 1, **options) -> Fault:
        """Add a fault (``options``: ``query``, ``interval``, ``amount``; see :class:`Fault`)."""
        fault = Fault(action, match, times, **options)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Forget requests and faults; answers being stalled or trickled end now."""
        with self._lock:
            self.requests.clear()
            self.faults.clear()
            self.injected.clear()
            self._release.set()
            self._release = threading.Event()

    def count(self, method: str = "GET", suffix: str = "", ranged: Optional[bool] = None) -> int:
        with self._lock:
            return sum(1 for m, k, r, _ in self.requests if m == method and k.endswith(suffix)
                       and (ranged is None or (r is not None) == ranged))


def reset_clients() -> None:
    """Forget this process's cached store clients (after changing AWS_ENDPOINT_URL)."""
    from megatron_sft_idx.storage import _stores

    _stores._STORES.clear()


def fetch_stats(endpoint: str, clear: bool = False) -> dict:
    """The request log of a server started with ``python -m bench.s3loop`` (optionally reset)."""
    host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST" if clear else "GET", "/__loop/clear" if clear else "/__loop/stats", body=b"")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


class LoopProcess(_Clients):
    """``python -m bench.s3loop`` in a process of its own, driven over HTTP. A context manager.

    Its faults are JSON (:meth:`Fault.from_spec`): they match a method and a key suffix
    (and a query substring), not a callable.
    """

    def __init__(self, env: Optional[dict] = None) -> None:
        self.env_vars = env

    def start(self) -> "LoopProcess":
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, **(self.env_vars or {}))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.s3loop"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError("the S3 server did not start (is moto[server] installed?)")
        doc = json.loads(line)
        self.endpoint, self.direct_endpoint = doc["endpoint"], doc["direct"]
        return self

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "LoopProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _post(self, path: str, doc=None) -> dict:
        split = urlsplit(self.endpoint)
        conn = http.client.HTTPConnection(split.hostname, split.port, timeout=30)
        try:
            conn.request("POST", path, body=json.dumps(doc).encode() if doc is not None else b"")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def inject(self, action: str, method: Optional[str] = None, suffix: str = "", times: int = 1,
               **options) -> None:
        """Add a fault (``options``: ``query``, ``interval``, ``amount``; see :class:`Fault`)."""
        self._post("/__loop/fault", {"action": action, "method": method, "suffix": suffix, "times": times,
                                     **options})

    def clear(self) -> None:
        """Forget requests and faults; answers being stalled or trickled end now."""
        self._post("/__loop/clear")

    def stats(self) -> dict:
        """``{"requests": [[method, key, range, bytes], ...], "injected": {action: count}}``."""
        return self._post("/__loop/stats")

    def count(self, method: str = "GET", suffix: str = "") -> int:
        return sum(1 for m, k, _, _ in self.stats()["requests"] if m == method and k.endswith(suffix))


def main() -> int:
    with S3Loop() as loop:
        print(json.dumps({"endpoint": loop.endpoint, "direct": loop.direct_endpoint}), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin (or exits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
