"""A Hugging Face Hub on loopback for one dataset repository (for `HF_ENDPOINT`): the routes
`huggingface_hub.snapshot_download` uses for a dataset without Xet storage, its files served from a
local folder, every request recorded (path and `Authorization` header)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from dflash_assets.storage.moto_server import LOOPBACK


class HubServer:
    def __init__(self, repo_id: str, folder: Path, revisions: dict[str, str] | None = None) -> None:
        """`folder`'s files are the repository at every revision; `revisions` maps names (`main`, a tag)
        to the commit they resolve to."""
        self.repo_id, self.folder = repo_id, folder
        self.revisions = revisions or {"main": "a" * 40}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None
        return f"http://{LOOPBACK}:{self._httpd.server_address[1]}"

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())

    def commit(self, revision: str) -> str | None:
        if revision in self.revisions.values():
            return revision
        return self.revisions.get(revision)

    def start(self) -> HubServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path, handler.headers.get("Authorization")))
        info = f"/api/datasets/{self.repo_id}/revision/"
        tree = f"/api/datasets/{self.repo_id}/tree/"
        resolve = f"/datasets/{self.repo_id}/resolve/"
        if path.startswith(info) and (commit := self.commit(path[len(info) :])):
            siblings = [{"rfilename": name} for name in self.files()]
            return self._json(handler, {"id": self.repo_id, "sha": commit, "siblings": siblings}, body)
        if path.startswith(tree) and self.commit(path[len(tree) :].split("/", 1)[0]):
            entries = [
                {
                    "type": "file",
                    "path": name,
                    "size": (self.folder / name).stat().st_size,
                    "oid": _oid(self.folder / name),
                }
                for name in self.files()
            ]
            return self._json(handler, entries, body)
        if path.startswith(resolve):
            revision, _, name = path[len(resolve) :].partition("/")
            commit = self.commit(revision)
            local = self.folder / name
            if commit and local.is_file():
                data = local.read_bytes()
                handler.send_response(200)
                handler.send_header("Content-Length", str(len(data)))
                handler.send_header("ETag", f'"{_oid(local)}"')
                handler.send_header("X-Repo-Commit", commit)
                handler.end_headers()
                if body:
                    handler.wfile.write(data)
                return None
        return self._json(
            handler, {"error": "Repository Not Found"}, body, status=404, error_code="RepoNotFound"
        )

    @staticmethod
    def _json(handler, value, body: bool, status: int = 200, error_code: str | None = None) -> None:
        data = json.dumps(value).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if error_code:
            handler.send_header("X-Error-Code", error_code)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
