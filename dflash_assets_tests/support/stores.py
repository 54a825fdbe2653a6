"""Stores that let a test see what the product did to them, and a sampler of the disk meanwhile."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from dflash_assets.storage.layout import MANIFEST_NAME
from dflash_assets.storage.local_state import store_namespace
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.open_store import open_store


def staging_of(env: dict[str, str], prefix: str, store_url: str | None = None) -> Path:
    """Where a run under `env` stages `prefix` of its store (or of `store_url`): the product's own rule,
    `<staging dir>/<store namespace>/<prefix>` (storage/local_state.py)."""
    root = env.get("DFLASH_STAGING_DIR") or str(Path(env["DFLASH_HOME"]) / "staging")
    url = open_store(store_url or env["DFLASH_STORE_URL"]).url
    return Path(root).expanduser() / store_namespace(url) / prefix


class WatchedStore(LocalStore):
    """A local store that records, for every deletion, whether the prefix's manifest was still there.

    `deletions` holds `(key or prefix, manifest still present)`: a partition deleted "manifest first"
    shows every object going after its manifest is gone."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.deletions: list[tuple[str, bool]] = []

    def _manifest_present(self, key: str) -> bool:
        prefix = key.rstrip("/").rsplit("/", 1)[0] if not key.endswith("/") else key.rstrip("/")
        return self.head(f"{prefix}/{MANIFEST_NAME}") is not None

    def delete(self, key: str) -> None:
        if not key.endswith(MANIFEST_NAME):
            self.deletions.append((key, self._manifest_present(key)))
        super().delete(key)

    def delete_prefix(self, prefix: str) -> int:
        self.deletions.append((prefix, self.head(prefix.rstrip("/") + "/" + MANIFEST_NAME) is not None))
        return super().delete_prefix(prefix)

    def objects_deleted_under_a_manifest(self) -> list[str]:
        return [key for key, manifest_present in self.deletions if manifest_present]


class SlowLocalStore(LocalStore):
    """A local store whose uploads take `delay_s` each: a store slower than the device."""

    def __init__(self, root: str | Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s

    def put_file(self, key: str, path: Path):
        time.sleep(self.delay_s)
        return super().put_file(key, path)


def staged_disk_bytes(directory: Path, *, samples_only: bool = False) -> int:
    """Bytes of the files in `directory` now; `samples_only` leaves out staging's bookkeeping files
    (fingerprint, boot marker, lock), which no budget counts."""
    from dflash_assets.storage.staging import BOOKKEEPING_NAMES

    total = 0
    for entry in os.scandir(directory):
        if samples_only and entry.name in BOOKKEEPING_NAMES:
            continue
        with contextlib.suppress(FileNotFoundError):  # uploaded and deleted while we looked
            total += entry.stat().st_size
    return total


class Sampler:
    """Calls `sample()` in a loop on another thread until stopped; keeps what the test asks for."""

    def __init__(self, sample) -> None:
        self._sample = sample
        self._stop = threading.Event()
        self.samples = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._sample()
                self.samples += 1
                self._stop.wait(0.002)
        except BaseException as err:  # surfaced by stop()
            self.error = err

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise self.error
