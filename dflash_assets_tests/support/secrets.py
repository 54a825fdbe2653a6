"""Secrets set the way a user sets them, and the check that none of them shows up anywhere a run writes:
its output, the Dagster instance (events, run tags, run config, compute logs), the store, local state."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dflash_assets.storage.store import ObjectStore
from dflash_assets_tests.conftest import TEST_SECRET_ACCESS_KEY, open_instance

API_KEY = "sk-test-api-key-do-not-print"
BROKER_PASSWORD = "broker-password-do-not-print"
# Beside the AWS variables a test sets (conftest's secret access key): an inference API key and a broker
# URL with a password in it, both of which a user's environment holds while any asset runs.
SECRET_ENV = {
    "DFLASH_GENERATE_API_KEY": API_KEY,
    "DFLASH_CELERY_BROKER_URL": f"redis://default:{BROKER_PASSWORD}@127.0.0.1:6379/15",
}
SECRETS = (TEST_SECRET_ACCESS_KEY, API_KEY, BROKER_PASSWORD)


def _found(data: bytes) -> list[str]:
    return [secret for secret in SECRETS if secret.encode() in data]


def assert_no_secret(
    *,
    texts: Iterable[str] = (),
    dagster_home: str | Path | None = None,
    stores: Iterable[ObjectStore] = (),
    directories: Iterable[str | Path] = (),
) -> int:
    """Fails naming the secret and where it was; returns how many places were looked at (so a test can
    tell that it looked at all)."""
    looked = 0
    for number, text in enumerate(texts):
        looked += 1
        assert not _found(text.encode()), f"{_found(text.encode())} in output {number}"
    if dagster_home is not None:
        from dagster._serdes import serialize_value

        with open_instance(dagster_home) as instance:
            for run in instance.get_runs():
                looked += 1
                written = serialize_value(run.tags) + serialize_value(run.run_config)
                assert not _found(written.encode()), (
                    f"{_found(written.encode())} in run {run.run_id}'s tags or config"
                )
                for entry in instance.all_logs(run.run_id):
                    written = serialize_value(entry)
                    assert not _found(written.encode()), (
                        f"{_found(written.encode())} in an event: {written[:300]}"
                    )
        directories = [*directories, dagster_home]  # its databases and compute logs, byte for byte
    for store in stores:
        for info in store.list(""):
            looked += 1
            assert not _found(store.get_bytes(info.key)), (
                f"{_found(store.get_bytes(info.key))} in {store.uri(info.key)}"
            )
    for directory in directories:
        for path in Path(directory).rglob("*"):
            if path.is_file():
                looked += 1
                assert not _found(path.read_bytes()), f"{_found(path.read_bytes())} in {path}"
    return looked
