"""The partition commit protocol: objects first, a verified manifest last."""

import hashlib
import json

import pytest

from dflash_assets.storage.layout import MANIFEST_NAME
from dflash_assets.storage.manifest import (
    ManifestError,
    StoredPartition,
    changed_since_commit,
    delete_partition,
    new_manifest,
    read_manifest,
    write_manifest,
)
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.support.stores import WatchedStore

PREFIX = "hidden-states/00000000-00000099"


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def test_a_manifest_is_written_only_after_every_object_it_names_is_present(store):
    store.put_bytes(f"{PREFIX}/hs_00000000.safetensors", b"a" * 10)
    manifest = new_manifest(
        "hidden_state_partitions",
        "00000000-00000099",
        {"hs_00000000.safetensors": 10, "hs_00000001.safetensors": 7},
    )
    with pytest.raises(ManifestError, match="1 missing .*hs_00000001"):
        write_manifest(store, PREFIX, manifest)
    assert read_manifest(store, PREFIX) is None

    store.put_bytes(f"{PREFIX}/hs_00000001.safetensors", b"b" * 7)
    write_manifest(store, PREFIX, manifest)
    assert read_manifest(store, PREFIX)["objects"] == {
        "hs_00000000.safetensors": 10,
        "hs_00000001.safetensors": 7,
    }


def test_a_manifest_over_an_object_of_the_wrong_size_is_refused(store):
    store.put_bytes(f"{PREFIX}/hs_00000000.safetensors", b"short")
    manifest = new_manifest("hidden_state_partitions", "p", {"hs_00000000.safetensors": 999})
    with pytest.raises(ManifestError, match="wrong size.*store has 5 bytes, expected 999"):
        write_manifest(store, PREFIX, manifest)


def test_a_foreign_manifest_format_is_an_error_not_a_silent_success(store):
    store.put_bytes(f"{PREFIX}/{MANIFEST_NAME}", json.dumps({"format": "other/9"}).encode())
    with pytest.raises(ManifestError, match="other/9"):
        read_manifest(store, PREFIX)


def test_deleting_a_partition_removes_the_manifest_first_then_every_object(tmp_path):
    store = WatchedStore(tmp_path / "store")
    for i in range(3):
        store.put_bytes(f"{PREFIX}/hs_0000000{i}.safetensors", b"x")
    write_manifest(store, PREFIX, new_manifest("a", "p", {f"hs_0000000{i}.safetensors": 1 for i in range(3)}))
    assert delete_partition(store, PREFIX) == 4
    assert list(store.list(PREFIX + "/")) == []
    # A crash part-way must never leave a manifest naming objects that are gone.
    assert store.deletions and store.objects_deleted_under_a_manifest() == []


def test_stored_partition_lists_full_keys_with_sizes(store):
    partition = StoredPartition(store, PREFIX, new_manifest("a", "00000000-00000099", {"b": 2, "a": 1}))
    assert partition.object_keys() == [(f"{PREFIX}/a", 1), (f"{PREFIX}/b", 2)]
    assert partition.partition == "00000000-00000099"


def test_the_manifest_records_the_stores_checksums_and_tells_what_changed_since_without_downloading(
    store_url,
):
    store = open_store(store_url)  # S3's ETag of a single PUT and a local store's MD5 agree
    prefix = "hidden-states/00000000-00000009"
    store.put_bytes(f"{prefix}/a", b"first object")
    store.put_bytes(f"{prefix}/b", b"second object")
    write_manifest(store, prefix, new_manifest("hidden_state_partitions", "p", {"a": 12, "b": 13}))
    manifest = read_manifest(store, prefix)
    assert manifest["checksums"] == {"a": hashlib.md5(b"first object").hexdigest(),
                                     "b": hashlib.md5(b"second object").hexdigest()}  # fmt: skip
    assert changed_since_commit(store, prefix, manifest) == {}

    store.put_bytes(f"{prefix}/a", b"FIRST object")  # same size, other bytes
    store.delete(f"{prefix}/b")
    changed = changed_since_commit(store, prefix, manifest)
    assert sorted(changed) == ["a", "b"]
    assert "checksum" in changed["a"] and "not in the store" in changed["b"]


def test_a_local_copy_is_fetched_again_once_the_partition_is_committed_with_other_bytes(store, tmp_path):
    prefix = "tokenized-completions/00000000-00000009"
    store.put_bytes(f"{prefix}/shard.parquet", b"version 1")
    write_manifest(store, prefix, new_manifest("tokenized_completions", "p", {"shard.parquet": 9}))
    committed = StoredPartition(store, prefix, read_manifest(store, prefix))
    first = committed.local_copy("shard.parquet", tmp_path)
    assert first.read_bytes() == b"version 1"
    store.put_bytes(f"{prefix}/shard.parquet", b"version 2")  # the same size
    write_manifest(store, prefix, new_manifest("tokenized_completions", "p", {"shard.parquet": 9}))
    committed = StoredPartition(store, prefix, read_manifest(store, prefix))
    second = committed.local_copy("shard.parquet", tmp_path)
    assert second.read_bytes() == b"version 2" and not first.exists()
