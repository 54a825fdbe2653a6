"""The sample-range partitions definition shared by the partitioned assets.

Keys are fixed-size ranges covering the dataset (see `core/sample_range.py`, the one parser). The
row count is read when the code location loads; it is cached by file size and mtime so a large
JSONL is counted once, not on every run-worker start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dagster import StaticPartitionsDefinition

from dflash_assets import settings
from dflash_assets.core.sample_range import sample_ranges


def _dataset_uri() -> str:
    from dflash_assets.core.datasets import bundled_dataset_path

    value = settings.DATASET.get()
    return str(bundled_dataset_path()) if value == "bundled" else value


def dataset_row_count(uri: str) -> int:
    from dflash_assets.core.datasets import count_rows

    if uri.startswith("s3://"):
        return count_rows(uri)
    path = Path(uri).expanduser()
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset {uri!r} does not exist: set DFLASH_DATASET to a JSONL or Parquet file of chat "
            "conversations (or `bundled` for the shipped samples)"
        ) from None
    cache = settings.cache_dir() / "row-counts.json"
    stamp = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp in known:
        return int(known[stamp])
    rows = count_rows(str(path))
    known[stamp] = rows
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError:
        pass  # the cache only saves time
    return rows


def sample_range_partitions() -> StaticPartitionsDefinition:
    rows = dataset_row_count(_dataset_uri())
    size = settings.samples_per_partition()
    keys = [r.key for r in sample_ranges(rows, size)]
    if not keys:
        raise ValueError(f"dataset {_dataset_uri()!r} has no rows: check DFLASH_DATASET")
    return StaticPartitionsDefinition(keys)
