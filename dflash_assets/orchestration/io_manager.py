"""The object-store IO manager: upload-then-delete, manifest last, committed partitions in.

Assets hand it a `PartitionOutput`: files still in local staging (uploaded here, deleted once the
store confirms them) and objects a run already streamed to the store. It commits the partition by
writing `_manifest.json` last, with each object's checksum as the store reports it. Downstream assets
receive `StoredPartition` handles, never bytes: readers stream or cache what they need with idempotent
downloads. A partition whose objects changed since their commit (missing, resized or rewritten: one
listing, no download) is never handed to a reader: the step fails naming the object and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import ConfigurableIOManager, InputContext, MetadataValue, OutputContext

from dflash_assets.orchestration.partitions import SampleRangePartitions, dataset_range_keys
from dflash_assets.orchestration.redaction import redacted_fields
from dflash_assets.orchestration.resources import StoreResource
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.manifest import (
    ManifestError,
    StoredPartition,
    changed_since_commit,
    new_manifest,
    partition_prefix,
    read_manifest,
    write_manifest,
)
from dflash_assets.storage.store import StoreError


@dataclass
class PartitionOutput:
    """What an asset returns: the partition's objects and what its manifest should record."""

    staged_files: dict[str, Path] = field(default_factory=dict)  # name -> local file to upload
    stored_objects: dict[str, int] = field(default_factory=dict)  # name -> size, already in the store
    manifest_fields: dict[str, Any] = field(default_factory=dict)
    prefix: str | None = None  # defaults to <asset prefix>/<partition key>


# What differs between two commits of the same objects: when and by which run.
_COMMIT_STAMPS = ("created_at", "run_id")


def _committed(store, prefix: str) -> dict[str, Any] | None:
    try:
        return read_manifest(store, prefix)
    except (ValueError, ManifestError, StoreError):  # unreadable or of another format: written again
        return None


def _same_commit(store, prefix: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The same objects and fields, and no object changed since the old commit (its checksums, which the
    new manifest gets from the store only when written)."""

    def strip(manifest: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in manifest.items() if k not in (*_COMMIT_STAMPS, "checksums")}

    if json.loads(json.dumps(strip(new))) != strip(old):  # as stored: tuples as lists, keys as strings
        return False
    return not changed_since_commit(store, prefix, old)


def _asset_name(context: InputContext | OutputContext) -> str:
    return context.asset_key.path[-1]


class StoreIOManager(ConfigurableIOManager):
    """Keys outputs by asset and partition under the store layout of docs/store-layout.md."""

    store: StoreResource

    def handle_output(self, context: OutputContext, obj: PartitionOutput) -> None:
        if not isinstance(obj, PartitionOutput):
            raise TypeError(
                f"asset {_asset_name(context)} returned {type(obj).__name__}; the store IO manager "
                "expects a PartitionOutput"
            )
        store = self.store.open()
        asset_name = _asset_name(context)
        partition_key = context.partition_key if context.has_partition_key else None
        prefix = obj.prefix or partition_prefix(asset_name, partition_key)

        def commit(staged: dict[str, int]) -> dict[str, int]:  # the manifest, last (upload_then_commit)
            objects = {**obj.stored_objects, **staged}
            fields = redacted_fields(obj.manifest_fields)  # other tools read a manifest: no secret in it
            manifest = new_manifest(asset_name, partition_key or "", objects, run_id=context.run_id, **fields)
            fault_point("before_manifest")
            committed = _committed(store, prefix)
            if committed is not None and _same_commit(store, prefix, committed, manifest):
                # A rerun that changed nothing leaves the commit (and who made it) as it was.
                context.log.info(
                    f"{store.uri(prefix)} is committed with these objects already (by run "
                    f"{committed.get('run_id')}): its manifest is kept"
                )
            else:
                write_manifest(store, prefix, manifest)
            return objects

        with self.store.uploader() as uploader:
            objects = uploader.upload_then_commit(obj.staged_files, prefix, commit)
        context.add_output_metadata(
            {
                "uri": MetadataValue.path(store.uri(prefix)),
                "objects": len(objects),
                "stored_bytes": sum(objects.values()),
            }
        )

    def load_input(self, context: InputContext) -> StoredPartition | list[StoredPartition]:
        store = self.store.open()
        asset_name = _asset_name(context)
        if not context.has_asset_partitions:
            return self._load_one(store, asset_name, None)
        keys = sorted(context.asset_partition_keys)
        if len(keys) == 1 and context.has_partition_key:
            return self._load_one(store, asset_name, keys[0])
        # A whole-asset read (e.g. training over every range): committed partitions only; the
        # consumer decides whether an empty list is an error for what it does. The instance knows
        # the ranges it registered; the dataset's row count adds those materialised through another
        # instance (the store, not the instance, is where a range is committed).
        if isinstance(context.asset_partitions_def, SampleRangePartitions):
            keys = sorted(set(keys) | set(self._dataset_range_keys(context)))
        committed = []
        for key in keys:
            prefix = partition_prefix(asset_name, key)
            manifest = read_manifest(store, prefix)
            if manifest is not None:
                committed.append(_unchanged(StoredPartition(store, prefix, manifest), asset_name))
        context.log.info(f"{asset_name}: {len(committed)} of {len(keys)} ranges are committed in {store.url}")
        return committed

    @staticmethod
    def _dataset_range_keys(context: InputContext) -> list[str]:
        try:
            return dataset_range_keys()
        except (OSError, ValueError, StoreError) as error:  # e.g. an S3 dataset that cannot be reached
            context.log.warning(f"cannot list the dataset's ranges ({error}); using the registered ones")
            return []

    def _load_one(self, store, asset_name: str, partition_key: str | None) -> StoredPartition:
        prefix = partition_prefix(asset_name, partition_key)
        manifest = read_manifest(store, prefix)
        if manifest is None:
            where = f"partition {partition_key}" if partition_key else "it"
            raise FileNotFoundError(
                f"{asset_name} {where} is not materialised: {store.uri(prefix)} has no _manifest.json. "
                f"Materialise {asset_name}"
                + (f" --partition {partition_key}" if partition_key else "")
                + " first."
            )
        return _unchanged(StoredPartition(store, prefix, manifest), asset_name)


class PartitionChanged(StoreError):
    """A committed partition's objects are no longer what its manifest recorded."""


def _unchanged(partition: StoredPartition, asset_name: str) -> StoredPartition:
    changed = changed_since_commit(partition.store, partition.prefix, partition.manifest)
    if changed:
        first = next(iter(changed.values()))
        where = f" --partition {partition.partition}" if partition.partition else ""
        raise PartitionChanged(
            f"{asset_name} {partition.uri} changed since it was committed ({len(changed)} object(s); "
            f"first: {first}). Nothing reads it until it is repaired: materialise {asset_name}{where} "
            "again (what changed is made again)"
        )
    return partition
