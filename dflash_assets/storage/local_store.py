"""The store as a local directory: atomic renames, hard links for staged files, fsynced confirmations."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from dflash_assets.storage.store import (
    PARTIAL_SUFFIX,
    STORE_URL_SETTING,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreConfigError,
    TransientStoreError,
    atomic_write,
    check_key,
    check_object_size,
    check_prefix,
    fsync_dir,
    partial_path,
    source_is_deletable,
)

_COPY_CHUNK_BYTES = 8 * 2**20

# Why a hard link cannot be made (another filesystem, no link support): then the bytes are copied.
_NO_LINK_ERRNOS = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES}
)


class LocalStore(ObjectStore):
    """A directory on the local filesystem (or a shared mount) laid out exactly like the bucket."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        # Directories links have gone into; saves a mkdir per object. Sets are safe across threads here
        # (single add/discard/contains calls under the GIL).
        self._known_directories: set[Path] = set()

    @property
    def description(self) -> str:
        return f"local directory {self.root}"

    @property
    def max_parallel_puts(self) -> int:
        # A put is a link (or a copy) plus an fsync: bound by this machine's disk, not by latency.
        return max(2, min(8, os.cpu_count() or 2))

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def uri(self, key: str) -> str:
        # Also accepts a prefix ("hidden-states/p/"), since messages name partitions as well as objects.
        return f"{self.url}/{check_prefix(key)}" if key else self.url

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = partial_path(self.root / "check")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise StoreConfigError(
                f"local store directory {self.root} is not writable ({err.strerror or err}): "
                f"fix {STORE_URL_SETTING} or the directory's permissions"
            ) from err

    def put_file(self, key: str, path: Path) -> ObjectInfo:
        target = self._path(key)
        if source_is_deletable():
            linked = self._link_into_place(target, Path(path))
            if linked is not None:
                return ObjectInfo(key, linked)
        with open(path, "rb") as source:
            size = atomic_write(target, lambda f: shutil.copyfileobj(source, f, _COPY_CHUNK_BYTES))
        return ObjectInfo(key, size)

    def _link_into_place(self, target: Path, source: Path) -> int | None:
        """`atomic_write`'s guarantees without copying: the source's bytes are fsynced (the store's copy is
        the durable one), a second name is linked beside the target and renamed over it. None when this
        filesystem pair cannot link; the caller then copies."""
        fd = os.open(source, os.O_RDONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if target.parent not in self._known_directories:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._known_directories.add(target.parent)
        try:
            # A new name for a complete inode appears atomically: no temporary name is needed...
            os.link(source, target)
        except FileExistsError:
            # ...unless an older object is there, which a rename replaces in one step.
            partial = partial_path(target)
            try:
                os.link(source, partial)
                os.replace(partial, target)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        except FileNotFoundError:
            self._known_directories.discard(target.parent)  # deleted meanwhile (delete_prefix prunes)
            raise TransientStoreError(f"{target.parent} disappeared while linking {source} into it") from None
        except OSError as err:
            if err.errno in _NO_LINK_ERRNOS:
                return None
            raise
        # The directory is not fsynced per object: the bytes are already durable, so a rename lost to a
        # power cut leaves the object absent (recomputed), never torn; `sync` makes the names durable
        # once per range, before its manifest is written.
        return size

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        size = atomic_write(self._path(key), lambda f: f.write(data))
        return ObjectInfo(key, size)

    def get_bytes(self, key: str, size: int | None = None) -> bytes:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"object {key!r} not found in {self.description}") from None
        check_object_size(self, key, size, len(data))
        return data

    def download(self, key: str, path: Path, size: int | None = None) -> Path:
        source = self._path(key)
        path = Path(path)
        try:
            found = source.stat().st_size  # a local stat costs no request: always checked
        except FileNotFoundError:
            raise ObjectNotFound(f"object {key!r} not found in {self.description}") from None
        check_object_size(self, key, size, found)
        if path.is_file() and path.stat().st_size == found:
            return path
        with open(source, "rb") as src:
            atomic_write(path, lambda f: shutil.copyfileobj(src, f, _COPY_CHUNK_BYTES))
        return path

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            stat = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key, stat.st_size) if path.is_file() else None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, then match the rest as a string prefix.
        directory_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*directory_key.split("/")) if directory_key else self.root
        for key, size in self._walk(start, directory_key):
            if key.startswith(prefix):
                yield ObjectInfo(key, size)

    def _walk(self, directory: Path, directory_key: str) -> Iterator[tuple[str, int]]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        # Sorting a directory's entries as "name/" (dirs) or "name" (files) yields keys in global
        # lexicographic order, as S3 lists them, without collecting the whole tree.
        entries.sort(key=lambda e: e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)
        for entry in entries:
            key = f"{directory_key}/{entry.name}" if directory_key else entry.name
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(Path(entry.path), key)
            elif entry.is_file() and not entry.name.endswith(PARTIAL_SUFFIX):
                try:
                    yield key, entry.stat().st_size
                except FileNotFoundError:  # deleted while listing
                    continue

    def checksum(self, info: ObjectInfo) -> str | None:
        """The file's MD5, as S3 reports an object put in one request (the directory is the store, so
        reading it is not a download); None once the file is gone."""
        digest = hashlib.md5(usedforsecurity=False)
        try:
            with open(self._path(info.key), "rb") as handle:
                while chunk := handle.read(_COPY_CHUNK_BYTES):
                    digest.update(chunk)
        except FileNotFoundError:
            return None
        return digest.hexdigest()

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # A folder its last object leaves is removed, as an S3 prefix vanishes with its last key (a
        # range's `chunks/` once they are merged). A put racing into it recreates it (see _link_into_place).
        for folder in path.parents:
            if folder == self.root or self.root not in folder.parents:
                break
            self._known_directories.discard(folder)
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above it are not empty either
                break

    def sync(self, prefix: str) -> None:
        check_prefix(prefix)
        directory = self.root.joinpath(*prefix.strip("/").split("/")) if prefix.strip("/") else self.root
        if directory.is_dir():
            fsync_dir(directory)

    def _delete_listed(self, prefix: str) -> int:
        deleted = 0
        for info in self.list(prefix):
            self.delete(info.key)
            deleted += 1
        # Prune directories the prefix fully covers, so a deleted partition leaves no empty folders.
        if prefix.endswith("/"):
            directory = self.root.joinpath(*prefix.strip("/").split("/"))
            for dirpath, _, _ in sorted(os.walk(directory), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        return deleted
