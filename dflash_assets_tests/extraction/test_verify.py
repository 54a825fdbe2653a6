"""The `range_complete` asset check's verifier: it passes a sound range and fails every kind of broken one,
naming the object."""

from __future__ import annotations

import json

import pytest

from dflash_assets.extraction.sample_format import sample_object_name
from dflash_assets.extraction.verify import verify_hidden_state_partition
from dflash_assets.storage.layout import MANIFEST_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.manifest import new_manifest, read_manifest, write_manifest
from dflash_assets_tests.support.extraction import DEFAULT_LAYERS, PREFIX, Extraction, make_samples


@pytest.fixture
def committed(target, tmp_path):
    """A range extracted and committed as the asset commits it: objects, then the manifest."""
    store = LocalStore(tmp_path / "store")
    samples = make_samples(6)
    result = Extraction(store, tmp_path / "staging").run(target, samples)
    write_manifest(store, PREFIX, new_manifest("hidden_state_partitions", "p", result.objects))
    return store, [s.sample_index for s in samples]


def verify(store, indices, **options):
    options = {"decode_samples": 100, "target_layer_ids": list(DEFAULT_LAYERS), **options}
    return verify_hidden_state_partition(store, PREFIX, expected_indices=indices, **options)


def test_a_sound_range_passes_with_every_object_present_and_decoded(committed):
    store, indices = committed
    report = verify(store, indices)
    assert report.passed, report.problems
    assert report.samples_listed == report.objects_present == report.objects_decoded == len(indices)


def test_an_object_missing_from_the_store_fails_the_check_naming_it(committed):
    store, indices = committed
    store.delete(f"{PREFIX}/{sample_object_name(indices[2])}")
    report = verify(store, indices)
    assert not report.passed
    assert f"{sample_object_name(indices[2])} is in the manifest but not in the store" in report.problems


def test_an_object_rewritten_after_the_commit_fails_the_check_by_its_checksum_alone(committed):
    """Bytes flipped inside the tensor data, size and header unchanged: no sample is decoded, and the
    object is still named, from one listing."""
    store, indices = committed
    name = sample_object_name(indices[3])
    data = bytearray(store.get_bytes(f"{PREFIX}/{name}"))
    data[-8:] = bytes(255 - b for b in data[-8:])
    store.put_bytes(f"{PREFIX}/{name}", bytes(data))
    report = verify(store, indices, decode_samples=0)
    assert not report.passed and report.objects_decoded == 0
    assert [p for p in report.problems if p.startswith(f"{name} has checksum")]
    assert report.objects_present == len(indices) - 1


def test_an_object_that_does_not_decode_when_committed_fails_the_check(committed):
    store, indices = committed
    key = f"{PREFIX}/{sample_object_name(indices[0])}"
    store.put_bytes(key, b"\x00" * len(store.get_bytes(key)))
    manifest = read_manifest(store, PREFIX)
    write_manifest(store, PREFIX, {k: v for k, v in manifest.items() if k != "checksums"})  # as it is now
    report = verify(store, indices)
    assert not report.passed and any("does not decode" in p for p in report.problems)


def test_objects_of_other_layers_or_a_manifest_missing_a_sample_fail_the_check(committed, target, tmp_path):
    store, indices = committed
    report = verify(store, indices, target_layer_ids=[0, 9])
    assert not report.passed and any(
        "hidden_states shape" in p or "target_layer_ids" in p for p in report.problems
    )

    manifest = read_manifest(store, PREFIX)
    del manifest["objects"][sample_object_name(indices[-1])]
    store.put_bytes(f"{PREFIX}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    report = verify(store, indices)
    assert not report.passed and report.problems[0].startswith("manifest omits 1 sample(s)")
    assert not verify(LocalStore(tmp_path / "empty"), indices).passed  # no manifest at all
