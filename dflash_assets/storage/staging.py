"""One range's local staging directory: finished sample files waiting for the store to confirm them.

Which copies are fsynced, and why. A sample's bytes are durable only where losing them would lose
work nobody can detect:
- the staging file is *not* fsynced. A killed process (SIGKILL, OOM, a failed run) loses nothing that
  is in the page cache, and files appear under their final name only by an atomic rename after the
  last byte, so a final-named file is complete. What the page cache does not survive is a reboot (power
  loss, kernel crash); for that the directory holds a boot marker, and files left by an earlier boot
  are deleted and recomputed instead of trusted. Where the boot cannot be identified, the files are
  fsynced as before.
- the store's copy *is* durable before the uploader confirms it (S3 by its own guarantee; a local
  store fsyncs it, see `LocalStore.put_file`), because the confirmation deletes the staging copy and
  the manifest, written last with an fsync, is the partition's commit point.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_assets.storage.layout import FINGERPRINT_NAME

BOOT_MARKER_NAME = "_boot_id"
LOCK_NAME = ".extract.lock"
# Files in a staging directory that are bookkeeping, not samples.
BOOKKEEPING_NAMES = frozenset({FINGERPRINT_NAME, BOOT_MARKER_NAME, LOCK_NAME})
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class PartitionBusy(RuntimeError):
    """Another process on this host is extracting the same range into the same staging directory."""


def current_boot_id() -> str | None:
    """This boot's identity (Linux), or None where the platform does not tell."""
    try:
        return _BOOT_ID_PATH.read_text().strip() or None
    except OSError:
        return None


@contextlib.contextmanager
def staging_lock(staging_dir: Path) -> Iterator[None]:
    """Two processes extracting one range into one staging directory would race on its files.

    On success the staging directory is removed (it is empty by then); after a failure it stays, with
    whatever finished files the next run will upload.
    """
    path = staging_dir / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise PartitionBusy(
                f"{staging_dir} is in use by {holder}: this range is already being extracted on this host; "
                "wait for that run to finish (or stop it) before starting another"
            ) from None
        # A finishing run unlinks the lock file; a lock on the unlinked file would guard nothing.
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield
        for name in (FINGERPRINT_NAME, BOOT_MARKER_NAME):
            (staging_dir / name).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: leave it
            staging_dir.rmdir()
    finally:
        os.close(fd)  # closing drops the flock


class StagingDirectory:
    """The rules for one staging directory; call `reconcile` once, under `staging_lock`, before use."""

    def __init__(self, directory: Path, fingerprint: dict[str, Any]) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.boot_id = current_boot_id()

    @property
    def files_need_fsync(self) -> bool:
        """Without a boot marker, a file that outlived a reboot could not be told apart: fsync them all."""
        return self.boot_id is None

    def reconcile(self, warn: Callable[[str], None]) -> None:
        """Delete every file that cannot be trusted (another producer, or written before a reboot), then
        mark the directory as this producer's, in this boot."""
        reason = self._distrust_reason()
        leftovers = [
            p for p in self.directory.iterdir() if p.is_file() and p.name not in (LOCK_NAME, BOOT_MARKER_NAME)
        ]
        if reason is not None:
            samples = [p for p in leftovers if p.name != FINGERPRINT_NAME]
            if samples:
                warn(
                    f"staging {self.directory} holds {len(samples)} files {reason}, not by "
                    f"{json.dumps(self.fingerprint)}; deleting them"
                )
            for leftover in leftovers:
                leftover.unlink(missing_ok=True)
            _write_replacing(self.directory / FINGERPRINT_NAME, json.dumps(self.fingerprint, indent=1))
        if self.boot_id is not None:
            # Durable, and written before any file that is not: an absent marker then only ever means
            # files from a version that fsynced every file.
            _write_replacing(self.directory / BOOT_MARKER_NAME, self.boot_id + "\n", durable=True)

    def _distrust_reason(self) -> str | None:
        try:
            stored = json.loads((self.directory / FINGERPRINT_NAME).read_text())
        except FileNotFoundError:
            stored = None
        except (OSError, ValueError):
            stored = {"unreadable": True}
        if stored is None:
            return "without a fingerprint"
        if stored != self.fingerprint:
            return f"made by {json.dumps(stored)}"
        try:
            marker = (self.directory / BOOT_MARKER_NAME).read_text().strip()
        except FileNotFoundError:
            return None
        except OSError:
            marker = "unreadable"
        if marker != self.boot_id:
            return "written before the machine restarted (not fsynced, so possibly torn)"
        return None

    def sample_files(self) -> Iterator[Path]:
        for path in sorted(self.directory.iterdir()):
            if path.is_file() and path.name not in BOOKKEEPING_NAMES:
                yield path


def _write_replacing(path: Path, text: str, durable: bool = False) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "w") as handle:
        handle.write(text)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temp, path)
    if durable:
        with contextlib.suppress(OSError):
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
