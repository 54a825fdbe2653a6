"""The partition commit protocol: objects first, a verified manifest last."""

import json

import pytest

from dflash_assets.storage.manifest import (
    MANIFEST_NAME,
    ManifestError,
    StoredPartition,
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
