"""A loopback HTTP proxy that adds a fixed delay to every response: a store `delay_ms` away, for the feed
benchmark. Bodies stream through as they come (objects of ~100 MB are never held whole); requests are
counted by method, and `GET /__latency_proxy__/counters` answers the counts as JSON.

Run it as a process of its own, so its CPU is not the client's:
`python -m dflash_assets.bench.latency_proxy --upstream http://127.0.0.1:9000 --delay-ms 25` prints
`listening on http://127.0.0.1:<port>` and serves until killed.
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from typing import BinaryIO
from urllib.parse import urlparse

COUNTERS_PATH = "/__latency_proxy__/counters"
_CHUNK = 1 << 20


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_method: dict[str, int] = {}

    def count(self, method: str) -> None:
        with self._lock:
            self.by_method[method] = self.by_method.get(method, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.by_method)


def _read_head(stream: BinaryIO) -> list[bytes] | None:
    """The request or status line and header lines (CRLF kept), or None at a clean end of stream."""
    lines = []
    while True:
        line = stream.readline(65537)
        if not line:
            return None  # the stream ended, inside a head or before one
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return lines


def _header(lines: list[bytes], name: str) -> str | None:
    prefix = name.lower().encode() + b":"
    for line in lines[1:]:
        if line.lower().startswith(prefix):
            return line.split(b":", 1)[1].strip().decode("latin-1")
    return None


def _copy_exact(source: BinaryIO, sink: socket.socket, nbytes: int) -> None:
    buffer = bytearray(min(_CHUNK, max(nbytes, 1)))
    view = memoryview(buffer)
    left = nbytes
    while left:
        got = source.readinto(view[: min(left, len(buffer))])
        if not got:
            raise ConnectionError("the stream ended inside a body")
        sink.sendall(view[:got])
        left -= got


def _copy_chunked(source: BinaryIO, sink: socket.socket) -> None:
    """A chunked body as it is, trailers included."""
    while True:
        size_line = source.readline(65537)
        if not size_line:
            raise ConnectionError("the stream ended inside a chunked body")
        sink.sendall(size_line)
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            while True:
                trailer = source.readline(65537)
                sink.sendall(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return
        _copy_exact(source, sink, size + 2)  # the chunk and its CRLF


def _copy_body(lines: list[bytes], source: BinaryIO, sink: socket.socket) -> bool:
    """Copy the body the head announces; False when it runs to the end of the stream (close after)."""
    if "chunked" in (_header(lines, "Transfer-Encoding") or "").lower():
        _copy_chunked(source, sink)
        return True
    length = _header(lines, "Content-Length")
    if length is not None:
        _copy_exact(source, sink, int(length))
        return True
    return False


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        upstream: socket.socket | None = None
        upstream_reader: BinaryIO | None = None
        try:
            while True:
                head = _read_head(self.rfile)
                if head is None:
                    return
                method, path = head[0].split(b" ")[0].decode(), head[0].split(b" ")[1].decode()
                if path == COUNTERS_PATH:
                    self._answer_counters()
                    continue
                self.server.counters.count(method)
                if upstream is None:
                    upstream = socket.create_connection(self.server.upstream, timeout=120)
                    upstream_reader = upstream.makefile("rb", buffering=_CHUNK)
                expect = (_header(head, "Expect") or "").lower() == "100-continue"
                forwarded = [line for line in head if not line.lower().startswith(b"expect:")]
                upstream.sendall(b"".join(forwarded))
                if expect:  # answered here: the client sends its body without waiting on the store
                    self.connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                _copy_body(head, self.rfile, upstream)
                response = _read_head(upstream_reader)
                while response is not None and response[0].split(b" ")[1].startswith(b"1"):
                    response = _read_head(upstream_reader)  # interim answers are not the client's
                if response is None:
                    return
                time.sleep(self.server.delay_s)
                self.connection.sendall(b"".join(response))
                status = int(response[0].split(b" ")[1])
                if method == "HEAD" or status in (204, 304):
                    continue
                if not _copy_body(response, upstream_reader, self.connection):
                    while chunk := upstream_reader.read1(_CHUNK):
                        self.connection.sendall(chunk)
                    return
        except (OSError, ValueError, IndexError):
            return
        finally:
            if upstream is not None:
                upstream.close()

    def _answer_counters(self) -> None:
        body = json.dumps(self.server.counters.snapshot()).encode()
        self.connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s, self.counters = upstream, delay_s, _Counters()
        super().__init__(("127.0.0.1", port), _Handler)


class LatencyProxy:
    """The proxy as a process of its own (`start`), in front of `upstream_url`; point clients at
    `endpoint_url`."""

    def __init__(self, upstream_url: str, delay_ms: float) -> None:
        self.upstream_url, self.delay_ms = upstream_url, delay_ms
        self.endpoint_url = ""
        self._process: subprocess.Popen | None = None

    def start(self) -> LatencyProxy:
        command = [sys.executable, "-m", __name__, "--upstream", self.upstream_url]
        self._process = subprocess.Popen(
            [*command, "--delay-ms", str(self.delay_ms)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        line = self._process.stdout.readline() if self._process.stdout else ""
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the latency proxy did not start: {line!r}")
        self.endpoint_url = line.split()[-1]
        return self

    def counters(self) -> dict[str, int]:
        """Requests forwarded so far, by method."""
        with urllib.request.urlopen(self.endpoint_url + COUNTERS_PATH, timeout=10) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://host:port of the store")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="added before every response")
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    args = parser.parse_args(argv)
    upstream = urlparse(args.upstream)
    if upstream.scheme != "http" or not upstream.hostname or not upstream.port:
        parser.error(f"--upstream {args.upstream} is not http://host:port")
    server = _Server(args.port, (upstream.hostname, upstream.port), args.delay_ms / 1000)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
