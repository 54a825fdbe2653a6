"""Where `dflash-assets bench --only store` saves what it measured, and how the plan reads it back.

The file is `$DFLASH_CACHE_DIR/bench/store-bench.json` (one per machine: the last run wins), JSON:

    format          "dflash-assets.store-bench/1"
    measured_at     ISO time
    store           the store's URL (the plan uses the figures only for that store)
    endpoint        where it was reached (S3's endpoint URL, or the local directory)
    object_bytes    the size measured at (the configured target's width × the plan's mean length)
    objects         objects written and read
    in_flight       requests the reader ended with in flight (it adapts), the uploader's workers
    write, read     {bytes_per_s, objects_per_s, requests_per_s, seconds}: through the product's own
                    uploader and training reader, from this node

The plan takes `read.bytes_per_s` as the rate the store delivers to offline training, unless
`--store-gbps` gives one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_assets.planning.saved_result import load_result, save_result

STORE_RESULT_FORMAT = "dflash-assets.store-bench/1"
STORE_RESULT_NAME = "store-bench.json"


def store_result_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "bench" / STORE_RESULT_NAME


def save_store_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Write `result` (the fields above, less `format` and `measured_at`) atomically to `path`."""
    return save_result(path, STORE_RESULT_FORMAT, result)


def load_store_result(path: str | Path) -> dict[str, Any] | None:
    """The saved result, or None when there is none (or it is not this format)."""
    return load_result(path, STORE_RESULT_FORMAT)


def store_read_rate(
    store_gbps: float | None, saved: dict[str, Any] | None, store_url: str
) -> tuple[float | None, str, str | None]:
    """(bytes/s the store delivers to offline training or None, where that comes from, a note when a
    saved measurement was set aside): `--store-gbps` first (GB/s: 10^9 bytes a second), then the saved
    measurement of this store."""
    if store_gbps:
        return store_gbps * 1e9, f"--store-gbps {store_gbps:g} (GB/s: 10^9 bytes a second)", None
    if saved is None:
        return None, "", None
    if saved.get("store") != store_url:
        return (
            None,
            "",
            f"the saved store measurement is of {saved.get('store')}, not the configured {store_url}: "
            "set aside (`dflash-assets bench --only store` measures this one)",
        )
    read = saved.get("read") or {}
    rate = read.get("bytes_per_s")
    if not rate:
        return None, "", None
    size = saved.get("object_bytes", 0) / 1e6
    source = (
        f"`dflash-assets bench --only store` from this node ({saved.get('measured_at', '')}): "
        f"{rate / 1e9:,.2f} GB/s reading {size:,.1f} MB objects, one node's figure (give --store-gbps "
        "the store's total when more nodes read)"
    )
    return float(rate), source, None
