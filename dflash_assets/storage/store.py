"""The object store: one interface over an S3 bucket prefix or a local directory.

Keys are relative to the store's root URL (`s3://bucket/prefix` or a directory) and always use `/`.
Every write is atomic: an object is either absent or complete, never half-written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STORE_URL_SETTING = "DFLASH_STORE_URL"
# In-progress writes carry this suffix; listings skip them and keys may not end with it.
PARTIAL_SUFFIX = ".dflash-partial"
CHECKSUM_MODES = ("when_supported", "when_required")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None


class StoreError(Exception):
    """A store operation failed. Messages name the key, the store and the setting to fix, never secrets."""

    # Whether retrying the same operation later can succeed (throttling, 5xx, dropped connections).
    transient: bool = False


class TransientStoreError(StoreError):
    transient = True


class StoreConfigError(StoreError):
    """The store cannot work as configured: bad URL, missing bucket, rejected credentials, no endpoint."""


class ObjectNotFound(StoreError):
    pass


class ObjectSizeMismatch(StoreError):
    """An object is not the size its manifest recorded: it changed after its range was committed."""


def check_object_size(store: ObjectStore, key: str, expected: int | None, found: int) -> None:
    """Raise `ObjectSizeMismatch` naming the object and both sizes unless `found` is the `expected`."""
    if expected is not None and found != expected:
        raise ObjectSizeMismatch(
            f"object {key!r} in {store.description} is {found} bytes, but {expected} were recorded for it "
            "(its range's manifest): it changed after the range was committed; materialise the range again"
        )


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative object key, else raise ValueError saying why."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    _check_parts(key, key.split("/"), what="object key")
    if key.endswith(PARTIAL_SUFFIX):
        raise ValueError(
            f"object key {key!r} must not end with {PARTIAL_SUFFIX!r} (reserved for partial writes)"
        )
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: "" (everything), or key-like text that may end with "/"."""
    if not isinstance(prefix, str):
        raise ValueError(f"key prefix must be a string, got {prefix!r}")
    if prefix:
        parts = prefix.split("/")
        _check_parts(prefix, parts[:-1] if parts[-1] == "" else parts, what="key prefix")
    return prefix


def _check_parts(text: str, parts: list[str], *, what: str) -> None:
    if text.startswith("/") or "\\" in text or "\x00" in text:
        raise ValueError(f"{what} {text!r} must be relative, use '/' separators and contain no NUL")
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError(f"{what} {text!r} has an empty, '.' or '..' path component")


def join_key(*parts: str) -> str:
    """Join key parts with single slashes: join_key("hidden-states/p/", "x") == "hidden-states/p/x"."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def partial_path(path: Path) -> Path:
    # Same directory as the target so os.replace is an atomic rename on one filesystem.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")


def fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not all platforms can open a directory, so best effort.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# Set around `put_file` by a caller that deletes the file as soon as the store has it and never rewrites
# it in place (the uploader's staged files): a local store may then link the file into place instead of
# copying its bytes. Anyone else gets a copy, so a source file changed later cannot change the object.
_SOURCE_WILL_BE_DELETED: ContextVar[bool] = ContextVar("dflash_source_will_be_deleted", default=False)


@contextlib.contextmanager
def source_will_be_deleted() -> Iterator[None]:
    """Within the block, `put_file`'s source is the caller's to delete and is never modified in place."""
    token = _SOURCE_WILL_BE_DELETED.set(True)
    try:
        yield
    finally:
        _SOURCE_WILL_BE_DELETED.reset(token)


def source_is_deletable() -> bool:
    """Whether the caller of the current `put_file` said (with `source_will_be_deleted`) that the
    source file is theirs to delete and never modified in place."""
    return _SOURCE_WILL_BE_DELETED.get()


def atomic_write(path: Path, write: Any) -> int:
    """Write through `write(file)` into a temp file beside `path`, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


class ObjectStore(ABC):
    """A flat key -> bytes store under one root URL. Implementations are safe to share across threads."""

    url: str

    @property
    def description(self) -> str:
        """Where the store lives, for messages: the URL plus the endpoint for S3."""
        return self.url

    @property
    def max_parallel_puts(self) -> int | None:
        """How many `put_file` calls at once can still help (None: as many as the caller allows)."""
        return None

    @abstractmethod
    def uri(self, key: str) -> str:
        """The full URI of a key (or prefix): s3://bucket/prefix/key or /root/dir/key."""

    @abstractmethod
    def check(self) -> None:
        """Fail fast with StoreConfigError if the store is unusable (unreachable, missing, read-only)."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> ObjectInfo:
        """Store the file at `key`. Returns once the store holds the whole object durably (S3: its
        success answer, after which any read sees it; a local store: the fsynced rename), with its size:
        that return is the confirmation the uploader deletes the local copy on."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo: ...

    @abstractmethod
    def get_bytes(self, key: str, size: int | None = None) -> bytes | bytearray:
        """The object's bytes, in one request (an S3 object of known size past the multipart threshold: in
        ranged parts written into one buffer). With `size` (known from a manifest) an object of another
        size is an error naming both: it changed since its size was recorded."""

    @abstractmethod
    def download(self, key: str, path: Path, size: int | None = None) -> Path:
        """Fetch `key` to `path` atomically; skip when `path` already has the object's size.

        With `size` known (from a manifest) the store is not asked for it first: one GET, no HEAD (an
        object of another size is an error naming both). Without it, one HEAD learns the size."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (plain string match, as in S3), sorted by key.

        Pass a trailing "/" to list one "directory": "hidden-states/p1/" excludes "hidden-states/p10/..."."""

    def checksum(self, info: ObjectInfo) -> str | None:
        """The store's own checksum of a listed object, without downloading it: S3's ETag, which the
        listing carries (the MD5 of an object put in one request). None where the store gives none."""
        return info.etag

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete `key`; deleting a missing key is not an error."""

    def sync(self, prefix: str) -> None:
        """Make the names of objects written under `prefix` (a "directory", ending in "/") durable.

        A no-op for S3, where a confirmed object is durable; a local store fsyncs the directory."""
        return None

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under a non-empty prefix; return how many were deleted."""
        check_prefix(prefix)
        if not prefix:
            raise ValueError("refusing to delete_prefix(''): that would empty the whole store")
        return self._delete_listed(prefix)

    @abstractmethod
    def _delete_listed(self, prefix: str) -> int: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r})"
