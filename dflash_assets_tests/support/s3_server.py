"""Test support: a fault-injecting HTTP proxy, beside the real `moto_server` launcher (which lives in
the product package, `dflash_assets.storage.moto_server`, because the benchmark uses it too).

`FaultyProxy` sits between a client and any HTTP endpoint and can fail requests (HTTP 500/503 or a
dropped connection), slow them down, or go down entirely. Decisions are seeded, so a test that fails
"the first 3 PUTs" or "20% of requests" sees the same faults on every run.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

from dflash_assets.storage.moto_server import LOOPBACK, free_port

# ------------------------------------------------------------------------------------ fault injection

FAULT_KINDS = ("500", "503", "drop")
_FAULT_BODIES = {
    500: b"<Error><Code>InternalError</Code><Message>injected by FaultyProxy</Message></Error>",
    503: b"<Error><Code>SlowDown</Code><Message>injected by FaultyProxy</Message></Error>",
}
# Connection-level headers that describe one hop, not the message.
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
}


@dataclass
class ProxyCounters:
    requests: int = 0  # requests received, faulted or not
    forwarded: int = 0  # requests sent on to the upstream endpoint
    injected_500: int = 0
    injected_503: int = 0
    dropped: int = 0  # connections closed without an answer ("drop" faults and requests while down)
    by_method: dict[str, int] = field(default_factory=dict)  # requests received, per HTTP method

    @property
    def faults(self) -> int:
        return self.injected_500 + self.injected_503 + self.dropped


@dataclass
class _FaultRule:
    kind: str
    first: int  # fail this many more matching requests
    share: float  # then fail this share of matching requests (seeded)
    methods: frozenset[str] | None
    after_forward: bool  # apply the request upstream, then fail the answer (a "ghost" success)
    path_contains: str | None = None  # only requests whose path contains this


class FaultyProxy:
    """A threaded HTTP proxy on a free loopback port in front of `upstream_url`.

    Point a client at `endpoint_url`. By default it forwards everything faithfully; `fail_first`,
    `fail_share`, `throttle` and `go_down` change that at any time, from any thread."""

    def __init__(self, upstream_url: str, *, seed: int = 0, connection_timeout_s: float = 30.0):
        parsed = urlparse(upstream_url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"FaultyProxy needs an http://host:port upstream, got {upstream_url!r}")
        self.upstream_url = upstream_url
        self._upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._rule: _FaultRule | None = None
        self._counters = ProxyCounters()
        self._forwarded: list[tuple[str, str]] = []  # (method, path) of every request sent upstream
        self._latency_s = 0.0
        self._bytes_per_s: float | None = None
        self._down = False
        self._connections: set[socket.socket] = set()
        self._connection_timeout_s = connection_timeout_s
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = free_port()
        self.endpoint_url = f"http://{LOOPBACK}:{self.port}"

    # -- lifecycle

    def start(self) -> FaultyProxy:
        if self._server is None:
            self._serve()
        return self

    def stop(self) -> None:
        self._stop_serving()
        self._close_connections()

    def __enter__(self) -> FaultyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        proxy = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False  # idle keep-alive connections must not hold up stop()
            allow_reuse_address = True

            def handle_error(self, request: object, client_address: object) -> None:
                # Broken connections are what this proxy is for; anything else is a bug worth printing.
                if not isinstance(sys.exc_info()[1], OSError):
                    super().handle_error(request, client_address)

        class Handler(_ProxyHandler):
            timeout = proxy._connection_timeout_s

        Handler.proxy = proxy
        self._server = Server((LOOPBACK, self.port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="faulty-proxy",
            daemon=True,
        )
        self._thread.start()

    def _stop_serving(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _close_connections(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # -- behaviour switches

    def fail_first(
        self, n: int, kind: str = "503", *, methods: Iterable[str] | None = None, after_forward: bool = False
    ) -> None:
        """Fail the next `n` requests (only those with a method in `methods`, if given)."""
        self._set_rule(kind, first=n, share=0.0, methods=methods, after_forward=after_forward)

    def fail_share(
        self,
        share: float,
        kind: str = "503",
        *,
        methods: Iterable[str] | None = None,
        after_forward: bool = False,
        path_contains: str | None = None,
    ) -> None:
        """Fail each matching request with probability `share`, from the seeded generator."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be within [0, 1], got {share}")
        self._set_rule(
            kind,
            first=0,
            share=share,
            methods=methods,
            after_forward=after_forward,
            path_contains=path_contains,
        )

    def clear_faults(self) -> None:
        with self._lock:
            self._rule = None

    def _set_rule(
        self,
        kind: str,
        *,
        first: int,
        share: float,
        methods: Iterable[str] | None,
        after_forward: bool,
        path_contains: str | None = None,
    ) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {FAULT_KINDS}")
        method_set = frozenset(m.upper() for m in methods) if methods is not None else None
        with self._lock:
            self._rule = _FaultRule(kind, first, share, method_set, after_forward, path_contains)

    def throttle(self, latency_s: float = 0.0, bytes_per_s: float | None = None) -> None:
        """Delay every request by `latency_s`, and its bodies by their size / `bytes_per_s`."""
        with self._lock:
            self._latency_s = latency_s
            self._bytes_per_s = bytes_per_s

    def go_down(self, *, refuse: bool = False) -> None:
        """Drop every request from now on; with `refuse`, also stop listening (connections refused)."""
        with self._lock:
            self._down = True
        if refuse:
            self._stop_serving()
        self._close_connections()

    def go_up(self) -> None:
        with self._lock:
            self._down = False
        if self._server is None:
            self._serve()

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down

    @property
    def counters(self) -> ProxyCounters:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._counters, by_method=dict(self._counters.by_method))

    def forwarded_paths(self, method: str) -> list[str]:
        """Paths (query stripped) of the `method` requests forwarded upstream so far, in order."""
        with self._lock:
            return [path.split("?", 1)[0] for m, path in self._forwarded if m == method.upper()]

    def reset_counters(self) -> None:
        with self._lock:
            self._counters = ProxyCounters()

    # -- used by the handler

    def _decide(self, method: str, path: str = "") -> tuple[str | None, bool]:
        """(fault kind or None, whether to apply it after forwarding); counts the request."""
        with self._lock:
            self._counters.requests += 1
            self._counters.by_method[method] = self._counters.by_method.get(method, 0) + 1
            if self._down:
                return "drop", False
            rule = self._rule
            if (
                rule is None
                or (rule.methods is not None and method not in rule.methods)
                or (rule.path_contains is not None and rule.path_contains not in path)
            ):
                return None, False
            if rule.first > 0:
                rule.first -= 1
                return rule.kind, rule.after_forward
            if rule.share > 0 and self._random.random() < rule.share:
                return rule.kind, rule.after_forward
            return None, False

    def _record_forwarded(self, method: str, path: str) -> None:
        with self._lock:
            self._forwarded.append((method, path))

    def _count(self, kind: str) -> None:
        with self._lock:
            if kind == "forwarded":
                self._counters.forwarded += 1
            elif kind == "drop":
                self._counters.dropped += 1
            else:
                setattr(self._counters, f"injected_{kind}", getattr(self._counters, f"injected_{kind}") + 1)

    def _latency(self) -> float:
        with self._lock:
            return self._latency_s

    def _transfer_time(self, nbytes: int) -> float:
        with self._lock:
            rate = self._bytes_per_s
        return nbytes / rate if rate else 0.0

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue handled by the base class
    proxy: FaultyProxy

    def setup(self) -> None:
        super().setup()
        self.proxy._track(self.connection, add=True)

    def finish(self) -> None:
        self.proxy._track(self.connection, add=False)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base-class signature
        pass  # keep test output clean

    def _proxy_request(self) -> None:
        try:
            body, chunked = self._read_body()
        except (OSError, ValueError):
            self.close_connection = True
            return
        fault, after_forward = self.proxy._decide(self.command, self.path)
        delay = self.proxy._latency() + self.proxy._transfer_time(len(body))
        if delay:
            time.sleep(delay)
        if fault is not None and not after_forward:
            self._inject(fault)
            return
        try:
            status, reason, headers, response_body = self._forward(body, chunked)
        except (OSError, http.client.HTTPException):
            self._inject("drop")  # upstream unreachable: the client sees a dropped connection
            return
        self.proxy._count("forwarded")
        self.proxy._record_forwarded(self.command, self.path)
        if fault is not None:
            self._inject(fault)
            return
        transfer_time = self.proxy._transfer_time(len(response_body))
        if transfer_time:
            time.sleep(transfer_time)
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_HEADERS:
                self.send_header(name, value)
        if self.command == "HEAD":
            # A HEAD answer carries the object's length but no body.
            length = next((v for n, v in headers if n.lower() == "content-length"), "0")
            self.send_header("Content-Length", length)
        else:
            self.send_header("Content-Length", str(len(response_body)))
        self.end_headers()
        if self.command != "HEAD" and response_body:
            self.wfile.write(response_body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = do_OPTIONS = _proxy_request

    def _read_body(self) -> tuple[bytes, bool]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline(65537).split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # HTTP trailers (aws-chunked trailers live inside the chunk data)
                    return b"".join(parts), True
                parts.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length", "0") or "0")
        return (self.rfile.read(length) if length else b""), False

    def _forward(self, body: bytes, chunked: bool) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_HEADERS}
        if chunked:
            headers["Transfer-Encoding"] = "chunked"
        conn = http.client.HTTPConnection(*self.proxy._upstream, timeout=60)
        try:
            # The Host header stays the client's: it is part of the request signature.
            conn.request(
                self.command,
                self.path,
                body=body if (body or chunked) else None,
                headers=headers,
                encode_chunked=chunked,
            )
            response = conn.getresponse()
            response_body = response.read()
            return response.status, response.reason, response.getheaders(), response_body
        finally:
            conn.close()

    def _inject(self, fault: str) -> None:
        self.proxy._count(fault)
        if fault == "drop":
            # Reset instead of a clean close, like a crashed server or a cut network.
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        status = int(fault)
        body = _FAULT_BODIES[status]
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
