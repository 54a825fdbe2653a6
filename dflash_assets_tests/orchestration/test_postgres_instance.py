"""The production instance configuration (deploy/dagster-postgres.yaml) on a real PostgreSQL server:
a range materialises against it and its history is shared through the database."""

import os
from pathlib import Path

import pytest
from dagster import AssetKey

from dflash_assets_tests.conftest import open_instance
from dflash_assets_tests.support.in_process import materialize_here
from dflash_assets_tests.support.postgres import postgres_dagster_home


@pytest.fixture
def postgres_home(tmp_path, dflash_env):
    with postgres_dagster_home(tmp_path / "pg-home") as variables:
        yield {**dflash_env, **variables}


def test_a_range_materialises_against_the_postgres_instance_and_its_history_is_in_the_database(
    postgres_home, monkeypatch
):
    # In this process (the storage is what is tested here; the CLI's own path has tests of its own).
    run = materialize_here("tokenized_completions", "00000100-00000199", postgres_home)
    assert run.success, run.output[-3000:]
    for name in (
        "DAGSTER_PG_HOST",
        "DAGSTER_PG_PORT",
        "DAGSTER_PG_USER",
        "DAGSTER_PG_PASSWORD",
        "DAGSTER_PG_DB",
    ):
        monkeypatch.setenv(name, postgres_home[name])
    with open_instance(postgres_home["DAGSTER_HOME"]) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        event = instance.get_latest_materialization_event(AssetKey("tokenized_completions"))
        assert event is not None and event.asset_materialization.partition == "00000100-00000199"
        assert event.asset_materialization.metadata["samples"].value > 0
    assert not os.path.exists(Path(postgres_home["DAGSTER_HOME"]) / "history")  # nothing fell back to SQLite


def test_a_worker_node_creates_the_instance_tables_before_any_run(tmp_path, monkeypatch):
    """Runs launched at once on an empty database would each try to create them, and collide."""
    import psycopg2

    from dflash_assets.orchestration.execution.celery_worker import _create_instance_tables
    from dflash_assets_tests.support.postgres import HOST, PORT, USER

    with postgres_dagster_home(tmp_path / "dagster-home") as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

        def tables() -> set[str]:
            with psycopg2.connect(host=HOST, port=PORT, user=USER, dbname=env["DAGSTER_PG_DB"]) as db:
                cursor = db.cursor()
                cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                names = {row[0] for row in cursor.fetchall()}
            db.close()
            return names

        assert "instance_info" not in tables()
        _create_instance_tables()
        assert {"instance_info", "runs", "event_logs"} <= tables()
