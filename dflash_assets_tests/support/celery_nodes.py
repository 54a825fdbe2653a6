"""Worker nodes on loopback: `dflash-assets worker` processes started as a user starts one on each
node (a session of its own, so a test can kill its whole process group), and a Redis database of
their own as the broker."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
_CLAIM_KEY = "dflash-test:claimed"


@contextlib.contextmanager
def redis_database() -> Iterator[int]:
    """An empty database number of the Redis server on loopback, flushed afterwards (skips the test
    when no server is reachable)."""
    import redis

    try:
        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis on {REDIS_HOST}:{REDIS_PORT} (the CI machine provides one)")
    numbers = list(range(1, 16))
    random.shuffle(numbers)
    for number in numbers:
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=number)
        if client.dbsize() == 0 and client.set(_CLAIM_KEY, str(os.getpid()), nx=True):
            break
    else:
        pytest.skip("every Redis database 1..15 is in use")
    try:
        yield number
    finally:
        client.flushdb()
        client.close()


def process_children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux procfs)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` is gone (or a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Node:
    """One `dflash-assets worker --queue … --name NAME` process and its log file."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: Path,
        queues: Sequence[str] = ("gpu", "default"),
        concurrency: int | None = None,
    ):
        self.name, self.env, self.log_path = name, env, log_path
        self.args = [str(Path(sys.executable).with_name("dflash-assets")), "worker"]
        for queue in queues:
            self.args += ["--queue", queue]
        self.args += ["--name", name]
        if concurrency is not None:
            self.args += ["--concurrency", str(concurrency)]
        self.process: subprocess.Popen | None = None
        self._log_start = 0

    def start(self, ready_timeout_s: float = 180.0) -> Node:
        """Start the worker (again, if it was stopped) and wait until it says it is ready."""
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + ready_timeout_s
        while " ready." not in self.log[self._log_start :]:
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.process.returncode}:\n{self.log}")
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name} not ready after {ready_timeout_s}s:\n{self.log}")
            time.sleep(0.2)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def step_processes(self) -> list[int]:
        """The worker's pool processes: where its steps run."""
        return process_children(self.pid)

    def kill_group(self) -> None:
        """The node lost: SIGKILL to every process of the worker's group at once."""
        os.killpg(self.pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@contextlib.contextmanager
def rabbitmq_vhost() -> Iterator[str]:
    """A virtual host of its own on the RabbitMQ server on loopback (guest/guest), deleted afterwards;
    yields its broker URL (skips the test without a server and `rabbitmqctl`)."""
    import shutil
    import socket
    import uuid

    ctl = shutil.which("rabbitmqctl")
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=3).close()
    except OSError:
        ctl = None
    if ctl is None:
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 with rabbitmqctl to make a virtual host")
    vhost = f"dflash-test-{uuid.uuid4().hex[:8]}"

    def rabbitmqctl(*args: str) -> None:
        done = subprocess.run([ctl, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.skip(f"rabbitmqctl {args[0]} failed: {done.stderr.strip()[-300:]}")

    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    finally:
        subprocess.run([ctl, "delete_vhost", vhost], capture_output=True, timeout=120)
