"""The production instance configuration (deploy/dagster-postgres.yaml) on a real PostgreSQL server:
a range materialises through the CLI and its history is shared through the database."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from dagster import AssetKey

from dflash_assets_tests.conftest import REPO, open_instance


def _postgres_available() -> bool:
    try:
        import psycopg2

        psycopg2.connect(
            host="127.0.0.1", port=5432, user="postgres", dbname="test", connect_timeout=3
        ).close()
        return True
    except Exception:
        return False


@pytest.fixture
def postgres_home(tmp_path, dflash_env):
    if not _postgres_available():
        pytest.skip("no PostgreSQL on 127.0.0.1:5432 (the CI machine provides one)")
    import psycopg2

    schema_db = f"dflash_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="test")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {schema_db}")
    home = tmp_path / "pg-home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "deploy" / "dagster-postgres.yaml").read_text())
    env = {
        **dflash_env,
        "DAGSTER_HOME": str(home),
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": "5432",
        "DAGSTER_PG_USER": "postgres",
        "DAGSTER_PG_PASSWORD": "",
        "DAGSTER_PG_DB": schema_db,
    }
    yield env
    admin.cursor().execute(f"DROP DATABASE IF EXISTS {schema_db} WITH (FORCE)")
    admin.close()


def test_a_range_materialises_against_the_postgres_instance_and_its_history_is_in_the_database(
    postgres_home, monkeypatch
):
    dagster = Path(sys.executable).with_name("dagster")
    done = subprocess.run(
        [
            str(dagster),
            "asset",
            "materialize",
            "-m",
            "dflash_assets.definitions",
            "--select",
            "tokenized_completions",
            "--partition",
            "00000100-00000199",
        ],
        env=postgres_home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
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
