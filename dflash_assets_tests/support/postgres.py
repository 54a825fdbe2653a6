"""A fresh PostgreSQL database per test on the server at 127.0.0.1:5432 (trust auth), and the
DAGSTER_HOME that points deploy/dagster-postgres.yaml at it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_assets_tests.conftest import REPO

HOST, PORT, USER, ADMIN_DB = "127.0.0.1", 5432, "postgres", "test"


def postgres_available() -> bool:
    try:
        import psycopg2

        psycopg2.connect(host=HOST, port=PORT, user=USER, dbname=ADMIN_DB, connect_timeout=3).close()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def postgres_dagster_home(home: Path) -> Iterator[dict[str, str]]:
    """A new database, dropped afterwards; yields DAGSTER_HOME and the DAGSTER_PG_* variables of the
    production instance file (skips the test when no server is reachable)."""
    if not postgres_available():
        pytest.skip(f"no PostgreSQL on {HOST}:{PORT} (the CI machine provides one)")
    import psycopg2

    name = f"dflash_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(host=HOST, port=PORT, user=USER, dbname=ADMIN_DB)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text((REPO / "deploy" / "dagster-postgres.yaml").read_text())
    try:
        yield {
            "DAGSTER_HOME": str(home),
            "DAGSTER_PG_HOST": HOST,
            "DAGSTER_PG_PORT": str(PORT),
            "DAGSTER_PG_USER": USER,
            "DAGSTER_PG_PASSWORD": "",
            "DAGSTER_PG_DB": name,
        }
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
