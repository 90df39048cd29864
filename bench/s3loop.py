"""A real S3 API on loopback for the remote tests and the remote benchmark.

``python -m bench.s3loop`` serves one in its own process (the benchmark's readers must not
share a GIL with the server) and prints ``{"endpoint": ..., "direct": ...}``; it stops
when its stdin closes. ``GET /__loop/stats`` on the proxy returns the request counts,
``POST /__loop/clear`` resets them.

``S3Loop`` starts moto's ``ThreadedMotoServer`` on 127.0.0.1 and, in front of it, a
small HTTP proxy that forwards every request unchanged, counts them (method, key,
range, bytes sent) and injects faults on demand: a connection reset after part of the body has
been sent, a ``500 InternalError``, a ``503 SlowDown``. Clients are pointed at the proxy
with ``AWS_ENDPOINT_URL`` (boto3) or an MSC profile's ``endpoint_url``.

Nothing here is a stub of S3: requests reach moto's S3 implementation, byte ranges,
ETags, multipart uploads and ``If-Match`` included.
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, List, Optional
from urllib.parse import unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class Fault:
    """Inject ``action`` into the next ``times`` requests that ``match(method, key, headers)``."""

    def __init__(self, action: str, match: Callable[[str, str, dict], bool], times: int = 1) -> None:
        if action not in ("reset", "500", "503", "truncate"):
            raise ValueError(action)
        self.action, self.match, self.left = action, match, times


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

    def _control(self) -> None:
        loop = self.server.loop
        if self.path.startswith("/__loop/clear"):
            loop.clear()
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
            self._body()
            return self._control()
        body = self._body()
        loop = self.server.loop
        key = unquote(urlsplit(self.path).path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            headers["Content-Length"] = str(len(body))
        fault = loop._take_fault(self.command, key, dict(self.headers))
        if fault in ("500", "503"):
            loop._record(self.command, key, self.headers.get("Range"), 0)
            return self._error(int(fault), key)
        conn = http.client.HTTPConnection(*loop.upstream, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
        finally:
            conn.close()
        loop._record(self.command, key, self.headers.get("Range"), len(data))
        self.send_response(status, reason)
        head = self.command == "HEAD"
        for k, v in resp_headers:
            if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                self.send_header(k, v)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if head:
            return
        if fault in ("reset", "truncate") and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if fault == "reset":  # RST instead of FIN: the client sees ECONNRESET mid-body
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        self.wfile.write(data)

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


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class S3Loop:
    """moto on 127.0.0.1 behind a counting, fault-injecting proxy. Use as a context manager."""

    def __init__(self) -> None:
        self.requests: List[tuple] = []
        self.faults: List[Fault] = []
        self.injected = collections.Counter()
        self._lock = threading.Lock()
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
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
        if self._moto is not None:
            self._moto.stop()

    def __enter__(self) -> "S3Loop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ env and clients

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

    # ------------------------------------------------------------------ counting and faults

    def _record(self, method: str, key: str, byte_range: Optional[str], nbytes: int) -> None:
        with self._lock:
            self.requests.append((method, key, byte_range, nbytes))

    def _take_fault(self, method: str, key: str, headers: dict) -> Optional[str]:
        with self._lock:
            for fault in self.faults:
                if fault.left > 0 and fault.match(method, key, headers):
                    fault.left -= 1
                    self.injected[fault.action] += 1
                    return fault.action
        return None

    def inject(self, action: str, match: Callable[[str, str, dict], bool], times: int = 1) -> Fault:
        fault = Fault(action, match, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faults.clear()
            self.injected.clear()

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


def main() -> int:
    import sys

    with S3Loop() as loop:
        print(json.dumps({"endpoint": loop.endpoint, "direct": loop.direct_endpoint}), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin (or exits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
