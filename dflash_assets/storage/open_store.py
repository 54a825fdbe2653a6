"""Opening the store a URL names: `s3://bucket/prefix`, `file:///path` or a local directory."""

from __future__ import annotations

import re
from urllib.parse import urlparse

from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.s3_store import S3Settings, S3Store, parse_s3_url
from dflash_assets.storage.store import STORE_URL_SETTING, ObjectStore, StoreConfigError

# A URL scheme: two characters or more (`C:` is a Windows drive, part of a path).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def check_store_url(url: str) -> tuple[str, str]:
    """`("s3", url)` or `("local", path)` for a store URL, read without touching the store; anything else
    (another scheme, `s3:/bucket` with one slash, an empty bucket) is refused naming the setting, so a typo
    never becomes a directory named after it."""
    text = (url or "").strip()
    if not text:
        raise StoreConfigError(
            f"store URL is empty: set {STORE_URL_SETTING} to s3://<bucket>/<prefix> or a path"
        )
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else None
    if scheme is None:
        return "local", text
    if scheme == "s3" and text.startswith("s3://"):
        parse_s3_url(text)
        return "s3", text
    if scheme == "file" and text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise StoreConfigError(
                f"{STORE_URL_SETTING}={text!r}: a file:// URL must name a local absolute path "
                "(file:///abs/path)"
            )
        return "local", parsed.path
    if scheme in ("s3", "file"):
        raise StoreConfigError(
            f"{STORE_URL_SETTING}={text!r} is not a well-formed {scheme}:// URL: write "
            + ("s3://<bucket>/<prefix>" if scheme == "s3" else "file:///abs/path")
        )
    raise StoreConfigError(
        f"{STORE_URL_SETTING}={text!r} has the unsupported scheme {scheme}://: use s3://<bucket>/<prefix>, "
        "file:///abs/path or a local path"
    )


def open_store(url: str, s3: S3Settings | None = None) -> ObjectStore:
    """Open the store at `url`: "s3://bucket/prefix" -> S3Store; a path or file:// URL -> LocalStore."""
    kind, location = check_store_url(url)
    return S3Store(location, s3) if kind == "s3" else LocalStore(location)
