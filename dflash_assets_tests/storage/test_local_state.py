"""Local state keyed by the store it belongs to: one namespace per store, whatever the range keys."""

from __future__ import annotations

from pathlib import Path

from dflash_assets.storage.local_state import local_state_dir, store_namespace
from dflash_assets.storage.local_store import LocalStore


def test_two_stores_get_two_namespaces_and_one_store_always_the_same():
    one, other = "s3://bucket/experiment-1", "s3://bucket/experiment-2"
    assert store_namespace(one) != store_namespace(other)
    assert store_namespace(one) == store_namespace(one + "/")  # a trailing slash names the same store
    assert store_namespace(one).startswith("s3-bucket-experiment-1-")  # readable in a listing
    long = "s3://bucket/" + "deep/" * 40 + "prefix"
    assert len(store_namespace(long)) <= 61 and store_namespace(long) != store_namespace(long + "2")


def test_a_local_store_is_known_by_its_resolved_path(tmp_path: Path):
    (tmp_path / "link-target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "link-target")
    direct, through_link = LocalStore(tmp_path / "link-target"), LocalStore(tmp_path / "link")
    staging = tmp_path / "staging"
    assert local_state_dir(staging, direct) == local_state_dir(staging, through_link)
    assert local_state_dir(staging, direct).parent == staging
    assert local_state_dir("~/x", direct).parts[:2] == Path.home().parts[:2]
