"""The partition commit protocol: objects first, `_manifest.json` last.

A partition whose prefix has no manifest is not done, whatever objects it holds. The manifest is
only written after one listing proves every object it names is in the store at its recorded size, and
it records each object's checksum as the store reports it then (S3's ETag, a local store's MD5). From
then on `changed_since_commit` tells, with one listing and no download, whether any object is missing,
resized or rewritten: readers refuse such a partition, and rematerialising it redoes what changed.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_assets.storage.layout import ASSET_PREFIXES, MANIFEST_NAME
from dflash_assets.storage.store import ObjectInfo, ObjectNotFound, ObjectStore

MANIFEST_FORMAT = "dflash-assets.manifest/1"


class ManifestError(RuntimeError):
    """A partition's objects and its manifest disagree."""


def partition_prefix(asset_name: str, partition_key: str | None) -> str:
    """`<asset prefix>/<partition key>`, or the asset prefix alone for an unpartitioned asset."""
    try:
        top = ASSET_PREFIXES[asset_name]
    except KeyError:
        raise ValueError(f"no store prefix is defined for asset {asset_name!r}") from None
    return f"{top}/{partition_key}" if partition_key else top


def manifest_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/{MANIFEST_NAME}"


def new_manifest(asset: str, partition: str, objects: dict[str, int], **fields: Any) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "asset": asset,
        "partition": partition,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "objects": dict(sorted(objects.items())),
        **fields,
    }


def _listed(store: ObjectStore, prefix: str) -> dict[str, ObjectInfo]:
    base = prefix.rstrip("/") + "/"
    return {
        info.key[len(base) :]: info
        for info in store.list(base)
        if info.key[len(base) :] and info.key[len(base) :] != MANIFEST_NAME
    }


def write_manifest(store: ObjectStore, prefix: str, manifest: dict[str, Any]) -> ObjectInfo:
    """Commit a partition: verify its objects with one listing, record their checksums, then write the
    manifest last."""
    expected: dict[str, int] = manifest.get("objects", {})
    listed = _listed(store, prefix) if expected else {}
    present = {name: info.size for name, info in listed.items()}
    missing = sorted(name for name in expected if name not in present)
    wrong_size = sorted(name for name, size in expected.items() if name in present and present[name] != size)
    if missing or wrong_size:
        detail = []
        if missing:
            detail.append(f"{len(missing)} missing (first: {missing[0]})")
        if wrong_size:
            name = wrong_size[0]
            detail.append(
                f"{len(wrong_size)} with the wrong size (first: {name}, "
                f"store has {present[name]} bytes, expected {expected[name]})"
            )
        raise ManifestError(
            f"refusing to commit {store.uri(prefix)}: {', '.join(detail)}. "
            "Rerun the partition; finished samples are kept and only the gaps are redone."
        )
    checksums = {name: store.checksum(listed[name]) for name in sorted(expected)}
    if expected and all(checksums.values()):
        manifest = {**manifest, "checksums": checksums}
    body = json.dumps(manifest, indent=1, sort_keys=False).encode()
    return store.put_bytes(manifest_key(prefix), body)


def changed_since_commit(store: ObjectStore, prefix: str, manifest: dict[str, Any]) -> dict[str, str]:
    """Objects of a committed partition that are no longer what its manifest recorded (name -> what
    changed), from one listing and the store's checksums: nothing is downloaded. Manifests written
    before checksums were recorded are checked by presence and size."""
    listed = _listed(store, prefix)
    recorded = manifest.get("checksums") or {}
    changed: dict[str, str] = {}
    for name, size in sorted(manifest.get("objects", {}).items()):
        info = listed.get(name)
        if info is None:
            changed[name] = f"{name} is in the manifest but not in the store"
        elif info.size != size:
            changed[name] = f"{name} is {info.size} bytes in the store, manifest says {size}"
        elif name in recorded and (found := store.checksum(info)) != recorded[name]:
            changed[name] = (
                f"{name} has checksum {found} in the store, manifest says {recorded[name]}: its bytes "
                "changed after the range was committed"
            )
    return changed


def read_manifest(store: ObjectStore, prefix: str) -> dict[str, Any] | None:
    """The partition's manifest, or None where it is not committed (one GET: no HEAD before it)."""
    key = manifest_key(prefix)
    try:
        raw = store.get_bytes(key)
    except ObjectNotFound:
        return None
    manifest = json.loads(raw)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(
            f"{store.uri(key)} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}"
        )
    return manifest


def delete_partition(store: ObjectStore, prefix: str) -> int:
    """Un-commit first (manifest), then remove the objects, so a crash in between never leaves a
    manifest pointing at missing objects."""
    key = manifest_key(prefix)
    deleted = 0
    if store.head(key) is not None:
        store.delete(key)
        deleted += 1
    return deleted + store.delete_prefix(prefix.rstrip("/") + "/")


@dataclass(frozen=True)
class StoredPartition:
    """A committed partition as downstream assets receive it: where it lives and what it holds."""

    store: ObjectStore
    prefix: str
    manifest: dict[str, Any] = field(repr=False)

    @property
    def partition(self) -> str:
        return self.manifest["partition"]

    @property
    def uri(self) -> str:
        return self.store.uri(self.prefix)

    def object_keys(self) -> list[tuple[str, int]]:
        return [(f"{self.prefix}/{name}", size) for name, size in sorted(self.manifest["objects"].items())]

    def local_copy(self, name: str, cache_dir: Path) -> Path:
        """The object `name` as a local file under `cache_dir` (this store's read cache), downloaded once
        per content: the copy's folder is named after the manifest's checksum of the object (its size
        where the manifest predates checksums), so a partition committed again is fetched again, and
        older copies of it are removed."""
        tag = (self.manifest.get("checksums") or {}).get(name) or f"size-{self.manifest['objects'][name]}"
        folder = Path(cache_dir) / self.prefix
        version = _VERSION_CHARACTERS.sub("-", str(tag))[:40]
        local = folder / version / name
        keep_only_version(folder, version)
        local.parent.mkdir(parents=True, exist_ok=True)
        # The manifest has the size: one GET, no HEAD.
        self.store.download(f"{self.prefix}/{name}", local, size=self.manifest["objects"][name])
        return local


_VERSION_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]+")


def keep_only_version(folder: Path, version: str) -> None:
    """Remove everything in `folder` but its `version` entry: the local copies of an object's (or an
    export's) earlier contents, which a reader never takes again."""
    if not folder.is_dir():
        return
    for stale in folder.iterdir():
        if stale.name == version:
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
