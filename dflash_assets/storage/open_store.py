"""Opening the store a URL names: `s3://bucket/prefix` or a local directory."""

from __future__ import annotations

from urllib.parse import urlparse

from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.s3_store import S3Settings, S3Store
from dflash_assets.storage.store import STORE_URL_SETTING, ObjectStore, StoreConfigError


def open_store(url: str, s3: S3Settings | None = None) -> ObjectStore:
    """Open the store at `url`: "s3://bucket/prefix" -> S3Store; a path or file:// URL -> LocalStore."""
    if not url or not url.strip():
        raise StoreConfigError(
            f"store URL is empty: set {STORE_URL_SETTING} to s3://<bucket>/<prefix> or a path"
        )
    url = url.strip()
    if url.startswith("s3://"):
        return S3Store(url, s3)
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise StoreConfigError(f"store URL {url!r}: file:// URLs must be local (file:///abs/path)")
        return LocalStore(parsed.path)
    if "://" in url:
        raise StoreConfigError(
            f"store URL {url!r} has an unsupported scheme: "
            f"{STORE_URL_SETTING} must be s3://<bucket>/<prefix> or a local path"
        )
    return LocalStore(url)
