"""The sample-range partitions shared by the partitioned assets: dynamic, registered at run time.

Loading the code location touches no dataset and no store: the partitions definition is a name
(`sample_ranges`), and its keys live in the Dagster instance. They are registered
- by `sample_range_sensor` (with the daemon), which counts the dataset's rows and adds the ranges
  that cover them;
- by `dflash-assets ranges` (and the demo), the same thing from a shell;
- on first use: naming a well-formed range of the configured size that holds rows of the dataset
  (`dagster asset materialize --partition 00000000-00009999`, or a run request) registers it, so a
  fresh instance needs no step before the first materialisation. A range past the dataset's end is
  refused, and never registered (its rows are counted once per version of the file).
Keys never change when the dataset grows; a grown dataset only adds keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from dagster import DagsterInstance, DynamicPartitionsDefinition
from dagster._core.definitions.partitions.context import PartitionLoadingContext
from dagster._core.errors import DagsterUnknownPartitionError

from dflash_assets import settings
from dflash_assets.conversations.sample_range import SampleRange, range_containing, sample_ranges

PARTITIONS_NAME = "sample_ranges"


class NotASampleRange(DagsterUnknownPartitionError):
    """A partition key that is not one of this deployment's fixed-size ranges."""


def check_sample_range_key(key: str, samples_per_partition: int | None = None) -> SampleRange:
    """The range `key` names, if it is aligned to the configured partition size; else a clear error."""
    size = samples_per_partition or settings.samples_per_partition()
    try:
        sample_range = SampleRange.parse(key)
    except ValueError as error:
        raise NotASampleRange(str(error)) from None
    expected = range_containing(sample_range.start, size)
    if sample_range != expected:
        raise NotASampleRange(
            f"partition key {key!r} is not a range of {size} samples "
            f"({settings.SAMPLES_PER_PARTITION.name}={size}): the range holding row {sample_range.start} "
            f"is {expected.key}"
        )
    return sample_range


class SampleRangePartitions(DynamicPartitionsDefinition):
    """Dynamic partitions that accept any well-formed range of the configured size, registering it."""

    def validate_partition_key(self, partition_key: str, context: PartitionLoadingContext) -> None:
        store = context.dynamic_partitions_store
        if store is not None and not store.has_dynamic_partition(PARTITIONS_NAME, partition_key):
            check_range_in_dataset(check_sample_range_key(partition_key))
            if isinstance(store, DagsterInstance):
                store.add_dynamic_partitions(PARTITIONS_NAME, [partition_key])
        super().validate_partition_key(partition_key, context)


SAMPLE_RANGES = SampleRangePartitions(name=PARTITIONS_NAME)


def check_range_in_dataset(sample_range: SampleRange) -> SampleRange:
    """`sample_range` if the dataset has rows in it; a range past its end is refused, naming the last."""
    uri = dataset_uri()
    rows = dataset_row_count(uri)
    if sample_range.start >= rows:
        last = range_containing(max(rows - 1, 0), settings.samples_per_partition()).key
        raise NotASampleRange(
            f"sample range {sample_range.key} starts past the end of the dataset ({rows} rows in {uri}; "
            f"its last range is {last}): check the key and {settings.DATASET.name}, or name it once the "
            "dataset has grown"
        )
    return sample_range


def dataset_uri() -> str:
    from dflash_assets.conversations.datasets import dataset_uri

    return dataset_uri(settings.DATASET.get())


def dataset_row_count(uri: str) -> int:
    """Rows in the dataset, cached by its files' identity so a large dataset is counted once.

    An `s3://` dataset is resolved first (a HEAD or a listing; downloaded only when an ETag changed)."""
    from dflash_assets.conversations.datasets import count_rows, resolve_dataset

    files = resolve_dataset(uri, cache_dir=settings.cache_dir())
    cache = settings.cache_dir() / "row-counts.json"
    stamp = files.stamp()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp in known:
        return int(known[stamp])
    rows = count_rows(files)
    known[stamp] = rows
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError:
        pass  # the cache only saves time
    return rows


def dataset_range_keys(uri: str | None = None) -> list[str]:
    """Every range covering the dataset's rows, in order (dataset I/O: never call at import)."""
    uri = uri or dataset_uri()
    rows = dataset_row_count(uri)
    if rows == 0:
        raise ValueError(f"dataset {uri!r} has no rows: check {settings.DATASET.name}")
    return [r.key for r in sample_ranges(rows, settings.samples_per_partition())]


RANGES_SAMPLE_ROWS = 200  # rows `dflash-assets ranges` reads, spread over the dataset, before registering


def check_dataset_rows(uri: str | None = None, sample: int = RANGES_SAMPLE_ROWS) -> list[str]:
    """What a person should know before the dataset's ranges are registered: each file cut short (a JSON
    array's note), and the rows of `sample` spread over the dataset that would be dropped on reading, by
    reason with the first few. Raises `AllRowsDropped` when every one would be: such a dataset, or such a
    `DFLASH_DATASET_FORMAT`, gives no range a sample."""
    from dflash_assets.conversations.datasets import dataset_notes, resolve_dataset
    from dflash_assets.conversations.drops import sample_rows

    uri = uri or dataset_uri()
    files = resolve_dataset(uri, cache_dir=settings.cache_dir())
    warnings = dataset_notes(files)
    rows = dataset_row_count(uri)
    # Rows the target answers itself need no answer of their own (DFLASH_COMPLETIONS=target).
    require_assistant = settings.COMPLETIONS.get() != "target"
    read = sample_rows(
        files, rows, sample, layout=settings.DATASET_FORMAT.get(), require_assistant=require_assistant
    )
    read.check_not_all_dropped(
        f"Nothing was registered: check {settings.DATASET.name} and {settings.DATASET_FORMAT.name}"
    )
    if read.dropped:
        warnings.append(read.line())
    return warnings


def unregistered_ranges(instance: DagsterInstance, keys: Sequence[str]) -> list[str]:
    """The keys among `keys` the instance does not know yet, in their order."""
    known = set(instance.get_dynamic_partitions(PARTITIONS_NAME))
    return [key for key in keys if key not in known]


def register_sample_ranges(instance: DagsterInstance, keys: Sequence[str] | None = None) -> list[str]:
    """Register `keys` (default: the ranges covering the dataset) with the instance; returns the new ones."""
    new = unregistered_ranges(instance, list(keys) if keys is not None else dataset_range_keys())
    if new:
        instance.add_dynamic_partitions(PARTITIONS_NAME, new)
    return new
