"""`transformers serve` as a subprocess on loopback: the OpenAI-compatible server the generation tests
talk to.

It serves one model directory (pinned, as a production server is), on the CPU, one torch thread so its
greedy answers are computed the way the tests' in-process target computes them.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_assets.storage.moto_server import LOOPBACK, free_port


class TransformersServer:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"

    def start(self, timeout_s: float = 180.0) -> TransformersServer:
        command = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [command, "serve", str(self.model_dir), "--host", LOOPBACK, "--port", str(self.port),
                 "--device", "cpu", "--log-level", "warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited: {self.log_path.read_text()[-2000:]}")
            if self.served_models():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"transformers serve did not answer in {timeout_s}s: {self.log_path.read_text()[-2000:]}"
        )

    def served_models(self) -> list[str]:
        try:
            conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=5)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            body = json.loads(response.read() or b"{}")
            conn.close()
        except (OSError, ValueError, http.client.HTTPException):
            return []
        return [entry["id"] for entry in body.get("data", [])] if response.status == 200 else []

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
