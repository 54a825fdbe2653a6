"""The object store, against a local directory and a real moto S3 server over HTTP."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

import boto3
import pytest

from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.moto_server import free_port, start_moto_server
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.s3_store import S3Settings, S3Store
from dflash_assets.storage.store import (
    PARTIAL_SUFFIX,
    ObjectInfo,
    ObjectNotFound,
    ObjectSizeMismatch,
    StoreConfigError,
    StoreError,
    TransientStoreError,
    atomic_write,
)
from dflash_assets_tests.conftest import TEST_REGION, TEST_SECRET_ACCESS_KEY, create_bucket


def assert_no_secret(err: BaseException) -> None:
    assert TEST_SECRET_ACCESS_KEY not in str(err)
    assert TEST_SECRET_ACCESS_KEY not in repr(err.args)


# ------------------------------------------------------------------------------------- both backends


def test_bytes_round_trip_and_head_reports_the_stored_size(store_url: str) -> None:
    store = open_store(store_url)
    store.check()

    info = store.put_bytes("tokenized-completions/00000000-00000009/_manifest.json", b'{"a": 1}')

    assert info == ObjectInfo("tokenized-completions/00000000-00000009/_manifest.json", 8, info.etag)
    assert store.get_bytes(info.key) == b'{"a": 1}'
    assert store.head(info.key).size == 8
    partition = "tokenized-completions/00000000-00000009"
    assert store.uri(info.key) == f"{store.url}/{partition}/_manifest.json"
    assert store.uri(f"{partition}/") == f"{store.url}/{partition}/"
    assert store.url in (store_url, str(Path(store_url).resolve()))


def test_file_round_trip_and_download_replaces_a_stale_local_copy(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url)
    source = tmp_path / "hs_00000007.safetensors"
    source.write_bytes(os.urandom(300_000))

    assert store.put_file("hidden-states/p/hs_00000007.safetensors", source).size == 300_000

    target = tmp_path / "downloads" / "nested" / "hs.safetensors"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"stale, shorter")
    assert store.download("hidden-states/p/hs_00000007.safetensors", target) == target
    assert target.read_bytes() == source.read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["hs.safetensors"]  # no partial file left behind


def test_download_skips_when_the_local_file_already_has_the_remote_size(
    store_url: str, tmp_path: Path
) -> None:
    store = open_store(store_url)
    store.put_bytes("checkpoints/run/step-1.pt", b"0123456789")
    local = tmp_path / "step-1.pt"
    local.write_bytes(b"abcdefghij")  # same size, different bytes: the skip is what we observe

    store.download("checkpoints/run/step-1.pt", local)

    assert local.read_bytes() == b"abcdefghij"


def test_listing_is_recursive_sorted_relative_to_the_root_and_a_plain_prefix_match(store_url: str) -> None:
    store = open_store(store_url)
    keys = ["a/p1/x", "a/p1/sub/y", "a/p10/z", "a-b/w", "a/p1-old/v", "b/u"]
    for key in keys:
        store.put_bytes(key, key.encode())

    assert [o.key for o in store.list("")] == sorted(keys)
    assert [o.key for o in store.list("a/p1/")] == ["a/p1/sub/y", "a/p1/x"]
    assert [o.key for o in store.list("a/p1")] == ["a/p1-old/v", "a/p1/sub/y", "a/p1/x", "a/p10/z"]
    assert [(o.key, o.size) for o in store.list("b/")] == [("b/u", 3)]
    assert list(store.list("nothing/here/")) == []


def test_missing_objects_are_reported_by_key(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url)

    assert store.head("hidden-states/p/hs_00000001.safetensors") is None
    with pytest.raises(ObjectNotFound, match="hs_00000001"):
        store.get_bytes("hidden-states/p/hs_00000001.safetensors")
    with pytest.raises(ObjectNotFound, match="hs_00000001"):
        store.download("hidden-states/p/hs_00000001.safetensors", tmp_path / "x")
    store.delete("hidden-states/p/hs_00000001.safetensors")  # deleting a missing key is fine


def test_delete_prefix_removes_exactly_that_prefix_and_refuses_to_empty_the_store(store_url: str) -> None:
    store = open_store(store_url)
    for key in [
        "hidden-states/p1/hs_1",
        "hidden-states/p1/_manifest.json",
        "hidden-states/p10/hs_2",
        "drafter/c",
    ]:
        store.put_bytes(key, b"x")

    assert store.delete_prefix("hidden-states/p1/") == 2

    assert [o.key for o in store.list("")] == ["drafter/c", "hidden-states/p10/hs_2"]
    with pytest.raises(ValueError, match="whole store"):
        store.delete_prefix("")


@pytest.mark.parametrize(
    "key", ["../escape", "a/../../b", "/etc/passwd", "a//b", "a/./b", "", "a\\b", f"x{PARTIAL_SUFFIX}"]
)
def test_keys_that_could_escape_the_root_or_collide_with_partial_files_are_rejected(
    store_url: str, key: str
) -> None:
    store = open_store(store_url)
    with pytest.raises(ValueError, match="key"):
        store.put_bytes(key, b"x")


# ---------------------------------------------------------------------------------------- local only


def test_deleting_the_last_object_of_a_local_folder_removes_the_folder_as_an_s3_prefix_vanishes(
    tmp_path: Path,
) -> None:
    store, root = LocalStore(tmp_path / "store"), tmp_path / "store"
    store.put_bytes("target-completions/r/chunks/chunk-1.jsonl", b"1")
    store.put_bytes("target-completions/r/chunks/chunk-2.jsonl", b"2")
    store.put_bytes("target-completions/r/completions.jsonl", b"12")
    store.delete("target-completions/r/chunks/chunk-1.jsonl")
    assert (root / "target-completions/r/chunks").is_dir()  # chunk-2 is still there
    store.delete("target-completions/r/chunks/chunk-2.jsonl")
    assert [p.name for p in (root / "target-completions/r").iterdir()] == ["completions.jsonl"]
    store.put_bytes("target-completions/r/chunks/chunk-3.jsonl", b"3")  # the folder comes back when used
    assert [i.key for i in store.list("target-completions/r/")] == [
        "target-completions/r/chunks/chunk-3.jsonl",
        "target-completions/r/completions.jsonl",
    ]
    store.delete("target-completions/r/chunks/chunk-3.jsonl")
    store.delete("target-completions/r/completions.jsonl")
    assert list(root.iterdir()) == []  # the root itself stays


def test_local_writes_are_atomic_and_listing_skips_partial_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_bytes("hidden-states/p/hs_1", b"complete")

    def write_half_then_die(f) -> None:
        f.write(b"half")
        raise KeyboardInterrupt  # a killed producer

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "store" / "hidden-states" / "p" / "hs_1", write_half_then_die)
    # An in-progress write from another process that has not finished yet:
    (tmp_path / "store" / "hidden-states" / "p" / f".hs_2.abc{PARTIAL_SUFFIX}").write_bytes(b"par")

    assert store.get_bytes("hidden-states/p/hs_1") == b"complete"
    assert [o.key for o in store.list("hidden-states/")] == ["hidden-states/p/hs_1"]
    assert store.head("hidden-states/p/hs_2") is None


def test_local_check_names_the_directory_and_the_setting_when_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")

    with pytest.raises(StoreConfigError, match="DFLASH_STORE_URL") as err:
        open_store(str(blocker / "store")).check()
    assert str(blocker / "store") in str(err.value)


def test_open_store_picks_the_backend_from_the_url(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").url == str(tmp_path)
    assert isinstance(
        open_store("s3://bucket/prefix", S3Settings(endpoint_url="http://127.0.0.1:1")), S3Store
    )
    for bad in ["gs://bucket/x", "s3:///no-bucket", "", "file://remote-host/x"]:
        with pytest.raises(StoreConfigError, match="URL"):
            open_store(bad)


@pytest.mark.parametrize("typo", ["s3:/nobucket", "s3:nobucket", "S3:/x", "file:relative", "gs://bucket/x"])
def test_a_malformed_or_foreign_store_url_is_refused_before_anything_is_created(
    typo: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreConfigError, match="DFLASH_STORE_URL"):
        open_store(typo).check()
    assert list(tmp_path.iterdir()) == []  # no directory named after the typo


def test_a_relative_store_path_lies_under_DFLASH_HOME_whatever_the_working_directory(
    tmp_path: Path, monkeypatch
) -> None:
    from dflash_assets import settings

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for relative in ("store-b", "./nested/store"):
        monkeypatch.setenv("DFLASH_STORE_URL", relative)
        assert settings.store_url() == str(tmp_path / "home" / relative)
    for kept in (str(tmp_path / "abs"), "s3://bucket/prefix", f"file://{tmp_path}/x", "s3:/typo"):
        monkeypatch.setenv("DFLASH_STORE_URL", kept)
        assert settings.store_url() == kept  # absolute paths and URLs as given (typos refused later)


# ------------------------------------------------------------------------------------------- S3 only


def test_s3_store_takes_the_endpoint_from_AWS_ENDPOINT_URL_S3_and_uses_path_style(s3_store_url: str) -> None:
    store = open_store(s3_store_url)

    assert store.endpoint_url == os.environ["AWS_ENDPOINT_URL_S3"]
    assert store._client.meta.config.s3 == {"addressing_style": "path"}
    store.put_bytes("k", b"v")
    bucket, prefix = s3_store_url[len("s3://") :].split("/", 1)
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == [f"{prefix}/k"]


def test_stores_of_a_process_parse_s3_s_service_model_once_and_each_still_works(
    s3_store_url: str, monkeypatch
) -> None:
    import botocore.loaders

    first = open_store(s3_store_url)
    loader = first._session._session.get_component("data_loader")
    paths = list(loader.search_paths)
    read: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def counted(self, file_path):
        read.append(file_path)
        return load_file(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    others = [open_store(s3_store_url) for _ in range(3)]
    assert not read, read  # the service model, endpoint rules and partitions: parsed by the first store only
    assert all(o._session._session.get_component("data_loader") is loader for o in others)
    assert loader.search_paths == paths  # boto3's own data folder is not added again for each session
    for number, store in enumerate(others):
        store.put_bytes(f"k{number}", b"v")
    assert sorted(info.key for info in first.list("")) == ["k0", "k1", "k2"]


def test_an_explicit_endpoint_wins_over_the_environment(s3_store_url: str, monkeypatch) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL_S3"]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")

    store = open_store(s3_store_url, S3Settings(endpoint_url=endpoint))

    store.check()
    assert store.endpoint_url == endpoint


def test_s3_listing_follows_pagination_across_several_pages(s3_store_url: str, faulty_proxy) -> None:
    proxy = faulty_proxy()
    store = open_store(s3_store_url, S3Settings(endpoint_url=proxy.endpoint_url, list_page_size=7))
    keys = [f"hidden-states/p/hs_{i:08d}.safetensors" for i in range(25)]
    for key in keys:
        store.put_bytes(key, b"x" * 3)
    store.put_bytes("hidden-states/other/hs_00000000.safetensors", b"x")
    proxy.reset_counters()

    listed = list(store.list("hidden-states/p/"))

    assert [o.key for o in listed] == keys
    assert {o.size for o in listed} == {3}
    assert proxy.counters.requests == 4  # ceil(25 / 7) ListObjectsV2 pages


def test_s3_large_files_go_up_in_parts_and_come_back_whole(s3_store_url: str, tmp_path: Path) -> None:
    settings = S3Settings(multipart_threshold_bytes=5 * 2**20, multipart_chunk_bytes=5 * 2**20)
    store = open_store(s3_store_url, settings)
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(11 * 2**20 + 17))

    store.put_file("drafter/run/model.safetensors", source)

    head = store.head("drafter/run/model.safetensors")
    assert head.size == source.stat().st_size
    assert head.etag.endswith("-3")  # three parts: the multipart path was taken
    target = store.download("drafter/run/model.safetensors", tmp_path / "back.safetensors")
    assert target.read_bytes() == source.read_bytes()


def test_s3_a_large_object_of_known_size_is_read_in_ranged_parts_into_one_buffer(
    s3_store_url: str, tmp_path: Path
) -> None:
    settings = S3Settings(multipart_threshold_bytes=5 * 2**20, multipart_chunk_bytes=5 * 2**20)
    store = open_store(s3_store_url, settings)
    data = os.urandom(11 * 2**20 + 17)
    store.put_bytes("hidden-states/p/hs_00000000.safetensors", data)
    counts = store.count_requests()

    got = store.get_bytes("hidden-states/p/hs_00000000.safetensors", len(data))

    assert isinstance(got, bytearray) and got == data
    assert counts == {"GET": 3}  # three ranges of at most 5 MiB, no HEAD
    with pytest.raises(ObjectSizeMismatch, match="11534353 bytes, but 11534354 were recorded"):
        store.get_bytes("hidden-states/p/hs_00000000.safetensors", len(data) + 1)
    # A refused part cancels the parts not yet started, so how many GETs the refusal cost varies.
    before = counts["GET"]
    small = store.get_bytes("hidden-states/p/hs_00000000.safetensors")  # size unknown: one GET
    assert small == data and counts["GET"] == before + 1


@pytest.mark.parametrize("checksum", ["when_required", "when_supported"])
def test_checksum_mode_reaches_botocore_and_uploads_still_verify(s3_store_url: str, checksum: str) -> None:
    store = open_store(s3_store_url, S3Settings(checksum=checksum))

    assert store._client.meta.config.request_checksum_calculation == checksum
    assert store._client.meta.config.response_checksum_validation == checksum
    store.put_bytes("k", b"payload")
    assert store.get_bytes("k") == b"payload"


def test_an_unknown_checksum_mode_is_a_config_error() -> None:
    with pytest.raises(StoreConfigError, match="when_required"):
        S3Settings(checksum="md5")


def test_server_errors_are_retried_by_the_client_up_to_max_attempts(s3_store_url: str, faulty_proxy) -> None:
    proxy = faulty_proxy()
    patient = open_store(s3_store_url, S3Settings(endpoint_url=proxy.endpoint_url, max_attempts=3))
    impatient = open_store(s3_store_url, S3Settings(endpoint_url=proxy.endpoint_url, max_attempts=1))

    proxy.fail_first(2, "500")
    patient.put_bytes("k", b"v")
    proxy.fail_first(1, "drop")
    with pytest.raises(TransientStoreError, match=proxy.endpoint_url) as err:
        impatient.put_bytes("k2", b"v")
    proxy.fail_first(1, "503")
    with pytest.raises(TransientStoreError, match="SlowDown"):
        impatient.put_bytes("k3", b"v")

    assert (proxy.counters.injected_500, proxy.counters.dropped, proxy.counters.injected_503) == (2, 1, 1)
    assert patient.get_bytes("k") == b"v"
    assert_no_secret(err.value)


def test_a_put_whose_answer_was_lost_is_retried_and_lands_once(s3_store_url: str, faulty_proxy) -> None:
    proxy = faulty_proxy()
    store = open_store(s3_store_url, S3Settings(endpoint_url=proxy.endpoint_url, max_attempts=3))
    proxy.fail_first(1, "drop", methods=["PUT"], after_forward=True)  # applied upstream, answer lost

    store.put_bytes("hidden-states/p/_manifest.json", b"{}")

    assert proxy.counters.dropped == 1 and proxy.counters.forwarded == 2
    assert [(o.key, o.size) for o in store.list("")] == [("hidden-states/p/_manifest.json", 2)]


def test_the_fault_proxy_fails_the_same_requests_for_the_same_seed(moto_endpoint: str, faulty_proxy) -> None:
    def faulted_requests(seed: int) -> list[int]:
        proxy = faulty_proxy(moto_endpoint, seed=seed)
        proxy.fail_share(0.3, "500")
        faulted = []
        for i in range(40):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            conn.request("GET", "/moto-api/")
            if conn.getresponse().status == 500:
                faulted.append(i)
            conn.close()
        assert proxy.counters.injected_500 == len(faulted)
        return faulted

    first = faulted_requests(seed=7)
    assert 0 < len(first) < 40
    assert faulted_requests(seed=7) == first
    assert faulted_requests(seed=8) != first


def test_check_names_a_missing_bucket_and_DFLASH_STORE_URL(aws_test_env: str) -> None:
    store = open_store("s3://no-such-bucket-here/prefix")

    with pytest.raises(StoreConfigError) as err:
        store.check()

    message = str(err.value)
    assert (
        "'no-such-bucket-here'" in message and "DFLASH_STORE_URL" in message and "does not exist" in message
    )
    assert_no_secret(err.value)


def test_check_names_an_unreachable_endpoint_and_AWS_ENDPOINT_URL_S3(aws_test_env: str, monkeypatch) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", closed)

    with pytest.raises(StoreConfigError) as err:
        open_store("s3://some-bucket/prefix").check()

    assert closed in str(err.value) and "AWS_ENDPOINT_URL_S3" in str(err.value)
    assert_no_secret(err.value)


def test_check_says_when_no_credentials_are_found(aws_test_env: str, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")

    with pytest.raises(StoreConfigError, match="no AWS credentials found"):
        open_store("s3://some-bucket/prefix").check()


@pytest.fixture(scope="module")
def auth_checking_s3():
    """A second moto_server that validates signatures after its first four requests, which create a
    bucket and an IAM user with an access key allowed to use S3. Yields (endpoint, key id, secret)."""
    server = start_moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        create_bucket(server.endpoint_url, "auth-bucket")
        iam = boto3.client(
            "iam",
            endpoint_url=server.endpoint_url,
            region_name=TEST_REGION,
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="dflash")
        key = iam.create_access_key(UserName="dflash")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="dflash", PolicyName="s3", PolicyDocument=json.dumps(policy))
        yield server.endpoint_url, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        server.stop()


def test_check_says_credentials_were_rejected_and_never_prints_them(auth_checking_s3, monkeypatch) -> None:
    endpoint, key_id, secret = auth_checking_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", TEST_REGION)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    open_store("s3://auth-bucket/prefix").check()  # the right secret passes

    wrong_secret = "wrong-" + secret[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    store = open_store("s3://auth-bucket/prefix")
    with pytest.raises(StoreConfigError) as check_err:
        store.check()
    with pytest.raises(StoreConfigError) as put_err:
        store.put_bytes("k", b"v")

    for err in (check_err.value, put_err.value):
        message = str(err)
        assert "credentials rejected" in message
        assert (
            "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message and "AWS_PROFILE" in message
        )
        assert wrong_secret not in message and secret not in message


def test_store_errors_are_store_errors() -> None:
    # Callers catch one base class; the uploader keys its retry decision off `transient`.
    assert issubclass(StoreConfigError, StoreError) and not StoreConfigError.transient
    assert issubclass(TransientStoreError, StoreError) and TransientStoreError.transient
