"""Running the product's assets in this process, against the user's Dagster instance: what `dflash-assets
demo` and `ranges` do, and what a benchmark script (`scripts/yardstick.py`) drives. One asset (one
partition) a run, its line printed, a failure told as the CLI tells it; the runs are in the UI after.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dagster import DagsterInstance, Definitions, ExecuteInProcessResult

# The steps log to the instance; the terminal gets the caller's lines and the product's status line.
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
# The checkout's instance configuration, copied into a DAGSTER_HOME that has none.
PACKAGED_INSTANCE_CONFIG = Path(__file__).resolve().parents[3] / "dagster.yaml"


def open_instance() -> DagsterInstance:
    """The Dagster instance `DAGSTER_HOME` names (created, with the checkout's `dagster.yaml`, if new), or
    a temporary one when it is not set, said on stderr."""
    from dagster import DagsterInstance

    if os.environ.get("DAGSTER_HOME"):
        home = Path(os.environ["DAGSTER_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        config = home / "dagster.yaml"
        if not config.exists() and PACKAGED_INSTANCE_CONFIG.exists():
            config.write_text(PACKAGED_INSTANCE_CONFIG.read_text())
        return DagsterInstance.get()
    print("DAGSTER_HOME is not set: runs go to a temporary instance the UI will not show", file=sys.stderr)
    return DagsterInstance.ephemeral()


@dataclass(frozen=True)
class RegisteredRanges:
    keys: list[str]  # every range covering the dataset, in order
    new: list[str]  # those this call registered


def register_ranges(instance: DagsterInstance | None = None, *, check_rows: bool = True) -> RegisteredRanges:
    """The sample ranges covering DFLASH_DATASET, registered with `instance` (default: `open_instance()`,
    opened once the rows are checked). With `check_rows`, a sample of the rows is read first: each warning
    (a file cut short, rows that would be dropped) goes to stderr, and a dataset whose every row would be
    dropped raises before anything is registered."""
    from dflash_assets.orchestration.partitions import (
        check_dataset_rows,
        dataset_range_keys,
        register_sample_ranges,
    )

    if check_rows:
        for warning in check_dataset_rows():
            print(f"WARNING: {warning}", file=sys.stderr)
    keys = dataset_range_keys()
    instance = instance if instance is not None else open_instance()
    return RegisteredRanges(keys, register_sample_ranges(instance, keys))


class InProcessRunner:
    """The code location's assets and resources (`definitions.build_definitions()` on the current settings
    unless given), materialised one asset at a time in this process against the user's instance. This
    process is the runs' worker: they carry its tag, for the reaper to check on."""

    def __init__(
        self,
        definitions: Definitions | None = None,
        *,
        instance: DagsterInstance | None = None,
        quiet: bool = True,
    ) -> None:
        from dflash_assets.definitions import build_definitions
        from dflash_assets.orchestration.execution.recovery import RUN_WORKER_TAG, RunWorker

        definitions = definitions if definitions is not None else build_definitions()
        self.assets = list(definitions.assets or [])
        self.resources: dict[str, Any] = dict(definitions.resources or {})
        self.names = {key.to_user_string() for asset in self.assets for key in asset.keys}
        self.instance = instance if instance is not None else open_instance()
        self.tags = {RUN_WORKER_TAG: RunWorker.current().tag}
        self.run_config: dict[str, Any] = QUIET_CONSOLE if quiet else {}

    def materialise(
        self, name: str, *, partition: str | None = None, config: dict | None = None, label: str = ""
    ) -> ExecuteInProcessResult:
        """One asset (one partition of it) with `config` as its run config; its line printed (status,
        seconds, run id) and, if it failed, each failed step's cause."""
        from dagster import materialize

        started = time.monotonic()
        result = materialize(
            self.assets,
            selection=[name],
            partition_key=partition,
            resources=self.resources,
            instance=self.instance,
            raise_on_error=False,
            # Only the asset's own config: the ranges' settings are everyone's, so a shell or the UI
            # continues what ran here.
            run_config={**self.run_config, **({"ops": {name: {"config": config}}} if config else {})},
            tags=self.tags,
        )
        status = "ok" if result.success else "FAILED"
        seconds = time.monotonic() - started
        print(
            f"  {name:26s} {label or partition or '':17s} {status}  {seconds:6.1f}s  run {result.run_id}",
            flush=True,
        )
        if not result.success:
            print_failure(result)
        return result


def materialisation_metadata(result: ExecuteInProcessResult, name: str) -> dict[str, Any]:
    """The plain values of asset `name`'s materialisation metadata in `result` ({} when it has none)."""
    for event in result.asset_materializations_for_node(name):
        return {key: value.value for key, value in event.metadata.items()}
    return {}


def print_failure(result: ExecuteInProcessResult) -> None:
    """Each failed step of `result` on stderr, in one line: a user's mistake as its own message, anything
    else as the error's (its traceback stays in the run's logs)."""
    for event in result.all_events:
        if event.is_step_failure:
            error = event.event_specific_data.error
            print(
                f"    {event.step_key} failed: {_user_mistake(error) or error.message.strip()}",
                file=sys.stderr,
            )


def _user_mistake(error: Any) -> str | None:
    """The one line of a user's mistake (a setting, a dataset, the store, a mask token) inside a step's
    serialised error, whose outer layers are Dagster's wrappers; None for anything else (a bug keeps its
    message and the run's traceback)."""
    from dflash_assets.orchestration.user_errors import user_error_types

    names = {kind.__name__ for kind in user_error_types()}
    seen = 0
    while error is not None and seen < 16:
        if error.cls_name in names:
            return " ".join(error.message.split(":", 1)[-1].split())
        error, seen = error.cause or error.context, seen + 1
    return None
