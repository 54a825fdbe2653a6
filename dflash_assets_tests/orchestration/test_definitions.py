"""The code location loads: a broken import fails here in seconds, and loading touches nothing outside.

Loading must not read the dataset or the store, nor import torch: every process (webserver, daemon,
each run worker, each pod) loads it, and an unreachable store must not take the UI down with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance

from dflash_assets.definitions import defs
from dflash_assets.orchestration.partitions import PARTITIONS_NAME, NotASampleRange, check_sample_range_key
from dflash_assets_tests.support.s3_server import free_port


def test_the_definitions_load_with_the_five_assets_the_sensors_and_the_resources():
    repository = defs.get_repository_def()
    keys = {key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()}
    assert keys == {
        "target_completions",
        "tokenized_completions",
        "hidden_state_partitions",
        "drafter_checkpoints",
        "drafter_evaluations",
    }
    # Each prompt set is a partition of its own (`held_out` always), downstream of the trained drafter,
    # with its check beside it.
    evaluations = repository.asset_graph.get(AssetKey("drafter_evaluations"))
    assert evaluations.parent_keys == {AssetKey("drafter_checkpoints")}
    assert evaluations.partitions_def.get_partition_keys() == ["held_out"]
    assert {key.name for key in evaluations.check_keys} == {"tau_at_least_floor"}
    # With the dataset's own answers (the default), tokenized_completions reads no regenerated ones.
    assert repository.asset_graph.get(AssetKey("tokenized_completions")).parent_keys == set()
    assert {s.name for s in repository.sensor_defs} == {"failed_range_sensor", "sample_range_sensor"}
    assert set(defs.resources) >= {"store", "store_io_manager", "dataset", "target_model", "devices"}


def test_the_gpu_bound_assets_share_the_gpu_pool_and_ranges_share_one_dynamic_partitioning():
    graph = defs.get_repository_def().asset_graph
    tokenized = graph.get(AssetKey("tokenized_completions"))
    hidden = graph.get(AssetKey("hidden_state_partitions"))
    assert hidden.partitions_def == tokenized.partitions_def
    assert tokenized.partitions_def.name == PARTITIONS_NAME
    assets = {a.key.to_user_string(): a for a in defs.assets}
    assert assets["hidden_state_partitions"].op.pool == "gpu"
    assert assets["drafter_checkpoints"].op.pool == "gpu"
    assert assets["tokenized_completions"].op.pool is None


def test_resources_read_their_settings_when_a_run_uses_them_not_when_the_code_location_loads(
    monkeypatch, tmp_path
):
    resources = defs.resources
    monkeypatch.setenv("DFLASH_STORE_URL", str(tmp_path / "store"))
    monkeypatch.setenv("DFLASH_STAGING_MAX_BYTES", "12345")
    monkeypatch.setenv("DFLASH_DEVICES", "cpu:0,cpu:1")
    assert resources["store"].store_url() == str(tmp_path / "store")
    assert resources["store"].staging_budget_bytes() == 12345
    assert resources["devices"].candidates() == ["cpu:0", "cpu:1"]
    monkeypatch.setenv("DFLASH_STAGING_MAX_BYTES", "twelve")
    with pytest.raises(ValueError, match="DFLASH_STAGING_MAX_BYTES='twelve' is not an integer"):
        resources["store"].staging_budget_bytes()


def _unreachable_environment(tmp_path: Path) -> dict[str, str]:
    """A store and a dataset on an S3 endpoint nobody listens on."""
    dead = f"http://127.0.0.1:{free_port()}"
    return {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "dagster-home"),
        "DFLASH_HOME": str(tmp_path / "home"),
        "DFLASH_STORE_URL": "s3://unreachable-bucket/dflash",
        "DFLASH_DATASET": "s3://unreachable-bucket/conversations.jsonl",
        "AWS_ENDPOINT_URL_S3": dead,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def test_loading_imports_no_torch_reads_neither_store_nor_dataset_and_warns_of_nothing(tmp_path):
    env = _unreachable_environment(tmp_path)
    probe = (
        "import json, sys\n"
        "import dflash_assets.definitions as d\n"
        "d.defs.get_repository_def()\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'boto3')}))\n"
        "print(sys.excepthook is sys.__excepthook__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    *_, modules, own_hook = done.stdout.strip().splitlines()
    imported = json.loads(modules)
    assert imported == {"torch": False, "transformers": False, "boto3": False}, imported
    assert own_hook == "True"  # the one-line error hook is for shell commands (test_user_errors.py)
    assert not (tmp_path / "home").exists()  # not even a cache directory was created
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # above every command, it reads as breakage


def test_the_code_location_loads_through_dagster_with_the_store_unreachable(tmp_path):
    env = _unreachable_environment(tmp_path)
    (tmp_path / "dagster-home").mkdir()
    dagster = Path(sys.executable).with_name("dagster")
    # The timeout only catches a hang (e.g. retrying a dead endpoint); it is not a speed target.
    done = subprocess.run(
        [str(dagster), "definitions", "validate", "-m", "dflash_assets.definitions"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "unreachable-bucket" not in done.stdout + done.stderr


@pytest.fixture
def instance(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))  # the dataset's row count is cached there
    with DagsterInstance.ephemeral() as instance:
        yield instance


def _validate(instance, key: str) -> None:
    from dagster._core.definitions.partitions.context import partition_loading_context

    selection = [AssetKey("tokenized_completions")]
    job = defs.get_repository_def().get_implicit_job_def_for_assets(selection)
    with partition_loading_context(dynamic_partitions_store=instance) as context:
        job.validate_partition_key(key, selected_asset_keys=selection, context=context)


def test_naming_a_well_formed_range_registers_it_so_a_fresh_instance_needs_no_step_first(
    instance, monkeypatch
):
    monkeypatch.setenv("DFLASH_SAMPLES_PER_PARTITION", "24")
    assert instance.get_dynamic_partitions(PARTITIONS_NAME) == []
    _validate(instance, "00000048-00000071")
    assert instance.get_dynamic_partitions(PARTITIONS_NAME) == ["00000048-00000071"]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("00000010-00000033", "the range holding row 10 is 00000000-00000023"),
        ("00000000-00000099", "not a range of 24 samples"),
        ("0-23", "zero-padded to 8 digits"),
    ],
)
def test_a_key_that_is_not_a_range_of_the_configured_size_is_refused_naming_the_setting(
    instance, monkeypatch, key, message
):
    monkeypatch.setenv("DFLASH_SAMPLES_PER_PARTITION", "24")
    with pytest.raises(NotASampleRange, match=message):
        _validate(instance, key)
    assert instance.get_dynamic_partitions(PARTITIONS_NAME) == []
    if "digits" not in message:
        with pytest.raises(NotASampleRange, match="DFLASH_SAMPLES_PER_PARTITION=24"):
            check_sample_range_key(key)


def test_a_range_past_the_end_of_the_dataset_is_refused_naming_the_last_one_and_is_not_registered(
    instance, monkeypatch
):
    monkeypatch.setenv("DFLASH_SAMPLES_PER_PARTITION", "100")  # the bundled data's 500 rows: 5 ranges
    _validate(instance, "00000400-00000499")
    with pytest.raises(NotASampleRange, match="past the end of the dataset .500 rows.*00000400-00000499"):
        _validate(instance, "00000500-00000599")
    assert instance.get_dynamic_partitions(PARTITIONS_NAME) == ["00000400-00000499"]
