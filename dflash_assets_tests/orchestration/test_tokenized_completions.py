"""`tokenized_completions` end to end: the CLI a user types, a real Dagster instance, the demo model,
local and S3 stores, and every kind of bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from dflash_assets.conversations.shard import read_shard
from dflash_assets.orchestration.assets.tokenized_completions import tokenized_completions_asset
from dflash_assets.orchestration.io_manager import StoreIOManager
from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import TEST_SECRET_ACCESS_KEY
from dflash_assets_tests.support.in_process import materialize_here

KEY = "00000000-00000099"
PREFIX = f"tokenized-completions/{KEY}"


def _dagster(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    dagster = Path(sys.executable).with_name("dagster")
    return subprocess.run([str(dagster), *args], env=env, capture_output=True, text=True, timeout=300)


def _materialize_cli(env: dict[str, str]) -> subprocess.CompletedProcess:
    return _dagster(
        "asset",
        "materialize",
        "-m",
        "dflash_assets.definitions",
        "--select",
        "tokenized_completions",
        "--partition",
        KEY,
        env=env,
    )


def test_the_cli_materialises_a_partition_on_embedded_defaults_into_the_local_store(dflash_env):
    completed = _materialize_cli(dflash_env)
    assert completed.returncode == 0, completed.stderr[-3000:]

    store = open_store(os.path.join(dflash_env["DFLASH_HOME"], "store"))
    manifest = read_manifest(store, PREFIX)
    assert manifest is not None and manifest["partition"] == KEY
    local = Path(dflash_env["DFLASH_HOME"]) / "shard.parquet"
    store.download(f"{PREFIX}/shard.parquet", local)
    samples = read_shard(local)
    assert len(samples) == len(manifest["sample_indices"]) > 50
    assert all(0 <= s.sample_index <= 99 for s in samples)
    assert all(1 in s.loss_mask and 0 in s.loss_mask for s in samples)
    # the upload deleted the staged copy
    assert not list((Path(dflash_env["DFLASH_HOME"]) / "staging").rglob("shard.parquet"))

    with DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(
            __import__("dagster").AssetKey("tokenized_completions")
        )
    metadata = event.asset_materialization.metadata
    assert metadata["samples"].value == len(samples)
    assert metadata["tokens"].value == sum(s.num_tokens for s in samples)
    assert metadata["uri"].value == store.uri(PREFIX)


def test_the_same_run_writes_to_s3_when_pointed_at_a_bucket_and_the_secret_appears_nowhere(
    dflash_env, s3_store_url
):
    env = {**dflash_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    env["DFLASH_STORE_URL"] = s3_store_url
    run = materialize_here("tokenized_completions", KEY, env)  # the setting, read when the run uses it
    assert run.success, run.output[-3000:]
    store = open_store(s3_store_url)
    assert read_manifest(store, PREFIX)["objects"]["shard.parquet"] > 0
    assert TEST_SECRET_ACCESS_KEY not in run.output

    with DagsterInstance.get() as instance:
        run = instance.get_runs()[0]
        logs = instance.all_logs(run.run_id)
    assert TEST_SECRET_ACCESS_KEY not in json.dumps(run.run_config)
    assert TEST_SECRET_ACCESS_KEY not in "\n".join(str(entry) for entry in logs)


def _run(dataset: str, store_url: str, demo_model_dir: Path, tmp_path: Path, instance=None, **config):
    store = StoreResource(url=store_url, staging_dir=str(tmp_path / "staging"), s3_max_attempts=1)
    return materialize(
        [tokenized_completions_asset("dataset")],
        partition_key=KEY,
        resources={
            "store": store,
            "store_io_manager": StoreIOManager(store=store),
            "dataset": DatasetResource(dataset=dataset),
            "target_model": TargetModelResource(model=str(demo_model_dir)),
        },
        run_config={"ops": {"tokenized_completions": {"config": config}}} if config else None,
        instance=instance or DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def _failure_message(result) -> str:
    return "\n".join(
        str(event.event_specific_data.error) for event in result.all_events if event.is_step_failure
    )


GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}


def _write_jsonl(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_bad_rows_are_dropped_and_counted_by_reason_in_the_metadata(tmp_path, demo_model_dir):
    good = json.dumps(GOOD).encode()
    lines = [good] * 8 + [
        b"{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        json.dumps({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}).encode(),
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
        ).encode(),
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "long " * 400},
                    {"role": "assistant", "content": "ok " * 400},
                ]
            }
        ).encode(),
    ]
    dataset = _write_jsonl(tmp_path / "conversations.jsonl", lines)
    result = _run(dataset, str(tmp_path / "store"), demo_model_dir, tmp_path, overlong="drop", max_length=256)
    assert result.success, _failure_message(result)
    metadata = result.asset_materializations_for_node("tokenized_completions")[0].metadata
    assert metadata["samples"].value == 8
    assert metadata["dropped"].value == 6
    reasons = {k.removeprefix("dropped_"): v.value for k, v in metadata.items() if k.startswith("dropped_")}
    assert sum(reasons.values()) == 6 and len(reasons) >= 5, reasons
    manifest = read_manifest(open_store(str(tmp_path / "store")), PREFIX)
    assert set(manifest["dropped"]) == {"8", "9", "10", "11", "12", "13"}


def test_the_run_log_says_where_the_first_dropped_rows_are_and_what_is_wrong_with_each(
    tmp_path, demo_model_dir
):
    good = json.dumps(GOOD).encode()
    unknown = json.dumps({"messages": [{"role": "wizard", "content": "hi"}, GOOD["messages"][1]]}).encode()
    lines = [good] * 8 + [b"{not json", unknown, b"[]", good, b"{}", b"{oops", b"{again", b"{more"]
    dataset = _write_jsonl(tmp_path / "conversations.jsonl", lines)
    instance = DagsterInstance.ephemeral()
    result = _run(dataset, str(tmp_path / "store"), demo_model_dir, tmp_path, instance, max_bad_fraction=0.9)
    assert result.success, _failure_message(result)
    said = [
        entry.user_message
        for entry in instance.all_logs(result.run_id)
        if "rows were dropped" in entry.user_message
    ]
    assert said == [
        f"{KEY}: 7 of 16 rows were dropped (malformed_json 4, unknown_layout 2, unknown_role 1): "
        "line 9: malformed_json: Expecting property name enclosed in double quotes at column 2; "
        "line 10: unknown_role: message 0 has role 'wizard'; "
        "line 11: unknown_layout: the row is a JSON list, not an object; "
        "line 13: unknown_layout: fields: []; "
        "line 14: malformed_json: Expecting property name enclosed in double quotes at column 2; and 2 more"
    ]


def test_a_mostly_bad_range_fails_naming_the_file_and_the_first_bad_line(tmp_path, demo_model_dir):
    dataset = _write_jsonl(tmp_path / "broken.jsonl", [json.dumps(GOOD).encode(), b"{oops", b"[]", b"nope"])
    result = _run(dataset, str(tmp_path / "store"), demo_model_dir, tmp_path)
    assert not result.success
    message = _failure_message(result)
    assert "broken.jsonl" in message and "line 2" in message
    assert read_manifest(open_store(str(tmp_path / "store")), PREFIX) is None


def test_a_missing_dataset_fails_before_any_work_naming_the_setting(tmp_path, demo_model_dir):
    result = _run(str(tmp_path / "nowhere.jsonl"), str(tmp_path / "store"), demo_model_dir, tmp_path)
    assert not result.success
    message = _failure_message(result)
    assert "nowhere.jsonl" in message and "DFLASH_DATASET" in message


def test_an_unreadable_model_directory_fails_before_any_work_naming_the_setting(tmp_path):
    result = _run("bundled", str(tmp_path / "store"), tmp_path / "no-model", tmp_path)
    assert not result.success
    assert "DFLASH_TARGET_MODEL" in _failure_message(result)
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.parquet"))


def test_a_bucket_that_does_not_exist_fails_before_any_work_naming_the_bucket(
    s3_store_url, tmp_path, demo_model_dir
):
    missing = "s3://no-such-bucket-dflash/prefix"
    result = _run("bundled", missing, demo_model_dir, tmp_path)
    assert not result.success
    message = _failure_message(result)
    assert "no-such-bucket-dflash" in message and "DFLASH_STORE_URL" in message
    assert TEST_SECRET_ACCESS_KEY not in message


def test_an_unreachable_endpoint_fails_before_any_work_naming_the_endpoint(
    tmp_path, demo_model_dir, aws_test_env, monkeypatch
):
    from dflash_assets.storage.moto_server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    result = _run("bundled", "s3://some-bucket/p", demo_model_dir, tmp_path)
    assert not result.success
    message = _failure_message(result)
    assert endpoint in message and "AWS_ENDPOINT_URL_S3" in message


@pytest.mark.parametrize("bad_key", ["0-99", "00000000-00000099x"])
def test_a_malformed_partition_key_is_rejected_by_the_one_parser(bad_key):
    from dflash_assets.conversations.sample_range import SampleRange

    with pytest.raises(ValueError, match="zero-padded to 8 digits"):
        SampleRange.parse(bad_key)
