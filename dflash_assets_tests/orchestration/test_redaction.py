"""The redaction layer of the Dagster layer: in a step whose body is `@redacted`, no secret of the
environment reaches its log lines, metadata, observations, check results, run tags, failure or the
run's failure, in a real Dagster instance; without it, each of those would have carried it."""

from __future__ import annotations

import logging

import pytest
from dagster import (
    AssetCheckResult,
    AssetObservation,
    DagsterInstance,
    MetadataValue,
    asset,
    asset_check,
    materialize,
)
from dagster._serdes import serialize_value

from dflash_assets.orchestration.progress import RangeProgressReporter
from dflash_assets.orchestration.redaction import redacted
from dflash_assets_tests.support.secrets import SECRET_ENV, SECRETS, assert_no_secret

SECRET = SECRETS[1]  # the inference API key


def leaking_assets(masked: bool):
    layer = redacted if masked else (lambda body: body)

    @asset(name="leaky")
    @layer
    def leaky(context) -> int:
        context.log.info(f"the key is {SECRET}")
        logging.getLogger("dflash_assets.somewhere").warning("core warning naming %s", SECRET)
        RangeProgressReporter(context, "00000000-00000009", 0.0).set_status(f"waiting with {SECRET}")
        context.log_event(AssetObservation(asset_key=context.asset_key, metadata={"seen": SECRET}))
        context.add_output_metadata(
            {"text": SECRET, "json": MetadataValue.json({"nested": [SECRET]}), "url": f"redis://:{SECRET}@h"}
        )
        return 1

    @asset_check(asset=leaky)
    @layer
    def leaky_check(context) -> AssetCheckResult:
        return AssetCheckResult(passed=False, metadata={"problems": f"object signed with {SECRET}"})

    @asset(name="failing", deps=[leaky])
    @layer
    def failing(context) -> None:
        raise ValueError(f"could not reach http://user:{SECRET}@server/v1")

    return [leaky, failing], [leaky_check]


def _run(masked: bool) -> tuple[DagsterInstance, str]:
    instance = DagsterInstance.ephemeral()
    assets, checks = leaking_assets(masked)
    result = materialize([*assets, *checks], instance=instance, raise_on_error=False)
    assert not result.success  # the second asset fails, as planned
    written = "".join(serialize_value(e) for e in instance.all_logs(result.run_id))
    written += serialize_value(instance.get_run_by_id(result.run_id).tags)
    return instance, written


@pytest.fixture
def secrets_set(monkeypatch):
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)


def test_without_the_layer_every_channel_would_carry_the_secret(secrets_set):
    _, written = _run(masked=False)
    assert written.count(SECRET) >= 6  # log, tag, observation, metadata, check, failure


def test_with_the_layer_no_event_tag_or_failure_carries_the_secret(secrets_set, caplog):
    instance, written = _run(masked=True)
    assert SECRET not in written
    assert written.count("***") >= 6  # masked where it was, not dropped
    assert "could not reach http://user:***@server/v1" in written
    assert SECRET not in caplog.text  # Python log records of the process, the compute logs' source
    with instance:
        assert_no_secret(texts=[written])
