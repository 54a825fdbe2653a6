"""Who made a prefix's objects: `_fingerprint.json`, written before any object, so two producers
(another target, other layers, other generation settings) never share a partition."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from dflash_assets.storage.layout import FINGERPRINT_NAME
from dflash_assets.storage.manifest import delete_partition
from dflash_assets.storage.store import ObjectNotFound, ObjectStore


def read_fingerprint(
    store: ObjectStore, base: str, listed: dict[str, int] | None = None
) -> dict[str, Any] | None:
    """The prefix's fingerprint, None where it has none (`listed`: its listing, when already made)."""
    if listed is not None and FINGERPRINT_NAME not in listed:
        return None
    try:
        return json.loads(store.get_bytes(base + FINGERPRINT_NAME))
    except ObjectNotFound:
        return None
    except ValueError:
        return {"unreadable": True}


def claim_prefix(
    store: ObjectStore,
    prefix: str,
    fingerprint: dict[str, Any],
    warn: Callable[[str], None],
    equivalent: Sequence[dict[str, Any]] | Callable[[dict[str, Any]], bool] = (),
) -> dict[str, int]:
    """One listing of `prefix`; returns its objects (name -> size) if they carry `fingerprint`, or one of
    `equivalent` (what an earlier version wrote for the same objects, as a list or a test: the fingerprint
    is then upgraded and the objects kept). Objects made under another fingerprint (or none) are deleted,
    manifest first, and an empty listing returned. The fingerprint is (re)written before the caller writes
    any object."""
    base = prefix.strip("/") + "/"
    listed = {info.key[len(base) :]: info.size for info in store.list(base)}
    stored = read_fingerprint(store, base, listed)
    if stored == fingerprint:
        return listed
    same = equivalent if callable(equivalent) else (lambda value: value in list(equivalent))
    if isinstance(stored, dict) and "unreadable" not in stored and same(stored):
        store.put_bytes(base + FINGERPRINT_NAME, json.dumps(fingerprint, indent=1).encode())
        return listed
    others = [name for name in listed if name != FINGERPRINT_NAME]
    if stored is not None or others:
        warn(
            f"{store.uri(base.rstrip('/'))} holds {len(others)} objects made by "
            f"{json.dumps(stored) if stored else 'an unknown producer (no fingerprint)'}, not by "
            f"{json.dumps(fingerprint)}; deleting them (manifest first) and starting the range from scratch"
        )
        delete_partition(store, base.rstrip("/"))
        listed = {}
    store.put_bytes(base + FINGERPRINT_NAME, json.dumps(fingerprint, indent=1).encode())
    return listed
