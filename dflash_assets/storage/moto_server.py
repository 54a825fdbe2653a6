"""An S3 server on loopback: `moto_server` (from the `moto[server]` package) as a subprocess on a free port.

For the benchmark's "upload over HTTP" figure and for the tests, which need a real S3 endpoint without
the network. `moto` is an optional dependency (the `test` extra): `moto_available()` says whether the
launcher can work here.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def moto_available() -> bool:
    """Whether `moto[server]` is installed (the `test` extra), so `start_moto_server` can work."""
    return importlib.util.find_spec("moto") is not None


LOOPBACK = "127.0.0.1"
# The server needs none of these, and a test server must never see real credentials.
_SCRUBBED_ENV_PREFIXES = ("AWS_",)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (and, being closed, one that refuses connections)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _answers_http(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.request("GET", "/moto-api/")
        conn.getresponse().read()
        conn.close()
        return True
    except (OSError, http.client.HTTPException):
        return False


def _moto_command() -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script)]
    found = shutil.which("moto_server")
    return [found] if found else [sys.executable, "-m", "moto.server"]


@dataclass
class MotoServer:
    """A running moto_server subprocess; `endpoint_url` is what boto3's endpoint_url expects."""

    endpoint_url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.log_path.parent)

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""


def start_moto_server(*, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> MotoServer:
    """Launch moto_server on a free loopback port and wait until it answers HTTP.

    `env` adds variables for the server, e.g. {"INITIAL_NO_AUTH_ACTION_COUNT": "4"} to make it check
    credentials after the first four requests."""
    server_env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
    server_env.update(env or {})
    last_error = ""
    for _ in range(3):  # another process may grab the free port before moto binds it
        port = free_port()
        log_dir = Path(tempfile.mkdtemp(prefix="moto-server-"))
        log_path = log_dir / "moto_server.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                [*_moto_command(), "-H", LOOPBACK, "-p", str(port)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env,
            )
        server = MotoServer(f"http://{LOOPBACK}:{port}", process, log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if _answers_http(LOOPBACK, port):
                atexit.register(server.stop)  # no orphaned server if a caller forgets stop()
                return server
            time.sleep(0.1)
        last_error = server.log_tail()
        server.stop()
    raise RuntimeError(
        f"moto_server did not start on loopback within {timeout_s}s; its output:\n{last_error}"
    )
