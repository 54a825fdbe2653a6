"""Materialising assets in the test's own process, under the environment a user would set for the CLI.

Settings are read when a run uses them (`dflash_assets/settings.py`), so a test that varies one needs no
new process: `materialize_here` sets the environment for the run, builds the code location as
`definitions.py` does, and runs the selection against the instance `DAGSTER_HOME` names. A test about
processes (kills, orphans, leases between shells, Celery, the newcomer's commands) keeps the CLI.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash_assets_tests.conftest import open_instance


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment is exactly `env` for the block (as a child process started with it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class RunHere:
    success: bool
    output: str  # what the CLI would have printed: log messages, failures, stderr
    metadata: dict[str, Any] = field(default_factory=dict)  # of the last materialisation, as plain values


def materialize_here(
    selection: str,
    partition: str | None,
    env: Mapping[str, str],
    *,
    config: Mapping[str, Mapping[str, Any]] | None = None,
    resource_config: Mapping[str, Mapping[str, Any]] | None = None,
) -> RunHere:
    """`dagster asset materialize --select <selection> --partition <partition>` with the steps in this
    process: `config` is the assets' run config (`{"hidden_state_partitions": {...}}`), `resource_config`
    the resources' (`{"store": {"staging_max_bytes": ...}}`)."""
    from dagster import materialize

    from dflash_assets.definitions import build_definitions
    from dflash_assets.orchestration.io_manager import StoreIOManager

    if env.get("DFLASH_FAULT_POINTS"):
        raise ValueError(
            "DFLASH_FAULT_POINTS kills the process a step runs in: a test that kills runs the `dagster` "
            "command (support/cli.py), not materialize_here, which would kill the test's own process"
        )
    names = [name.strip() for name in selection.split(",")]
    with environment(env), open_instance(env["DAGSTER_HOME"]) as instance:
        defs = build_definitions()
        resources = dict(defs.resources or {})
        for name, values in (resource_config or {}).items():
            resources[name] = type(resources[name])(**values)
        resources["store_io_manager"] = StoreIOManager(store=resources["store"])
        ops = {name: {"config": dict(values)} for name, values in (config or {}).items()}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            result = materialize(
                list(defs.assets or []) + list(defs.asset_checks or []),
                selection=names,
                partition_key=partition,
                resources=resources,
                instance=instance,
                run_config={"ops": ops} if ops else None,
                raise_on_error=False,
            )
        logs = instance.all_logs(result.run_id)
    lines = [record.message for record in logs] + [printed.getvalue()]
    lines += [str(e.event_specific_data.error) for e in result.all_events if e.is_failure]
    materialized = [e for e in result.all_events if e.is_step_materialization]
    metadata = {}
    if materialized:
        entries = materialized[-1].step_materialization_data.materialization.metadata
        metadata = {name: value.value for name, value in entries.items()}
    return RunHere(result.success, "\n".join(lines), metadata)
