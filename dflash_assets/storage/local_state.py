"""Where a store's local state lives on this host: one directory per store under each local root.

Staging, read caches and training work directories all hold files that belong to one store. Two
pipelines on one host (two targets, two experiments, two prefixes of one bucket) use the same range keys
and the same default run name, so a path keyed by asset and range alone would let one pipeline upload,
recover or delete the other's files. Every local root therefore starts with the store's namespace:

    <root>/<namespace>/<asset prefix>/<range>/…      e.g. staging/s3-bucket-exp1-4f0c2a9e1b7d/hidden-states/…

The namespace is the store's normalised URL (`s3://bucket/prefix` without trailing slashes, or the
resolved absolute path of a local store), made readable and unique: a short slug plus a digest of the
URL. The endpoint is not part of it, so the same bucket reached through a proxy or another address of
the same server keeps its staged work.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from dflash_assets.storage.store import ObjectStore

_SLUG_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]+")
_SLUG_LENGTH = 48


def store_namespace(store_url: str) -> str:
    """`<slug>-<digest>` for a normalised store URL (an `ObjectStore.url`)."""
    url = store_url.rstrip("/") or store_url
    if url.startswith("s3://"):
        readable = "s3-" + url[len("s3://") :]
    else:
        readable = "local-" + "-".join(Path(url).parts[-2:])
    slug = _SLUG_CHARACTERS.sub("-", readable).strip("-.")[:_SLUG_LENGTH].rstrip("-.")
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return f"{slug}-{digest}"


def local_state_dir(root: str | Path, store: ObjectStore) -> Path:
    """`root/<namespace of store>`: the directory under `root` whose files belong to `store` alone."""
    return Path(root).expanduser() / store_namespace(store.url)
