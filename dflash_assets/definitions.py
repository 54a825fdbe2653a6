"""The one Definitions object of the dflash-assets code location.

Loading it reads no dataset, no store and no model, and imports no torch: partitions are dynamic
(`partitions.py`), resources open what they need when a run uses them. What shapes the code location is
read when `build_definitions` runs: `DFLASH_COMPLETIONS=target` puts `target_completions` upstream of
`tokenized_completions`, `DFLASH_EXECUTOR` chooses the executor, and the GPU steps' pools and
Kubernetes tags follow their settings. A test varies them in-process by calling it again. A bad
`DFLASH_*` value stops loading with one line naming it.
"""
# ruff: noqa: E402 - the settings are checked before any module that reads one is imported

from dflash_assets.orchestration.user_errors import check_settings, report_in_one_line

report_in_one_line()
check_settings()

from dagster import Definitions

from dflash_assets import settings
from dflash_assets.orchestration.assets.drafter_checkpoints import drafter_checkpoints_asset
from dflash_assets.orchestration.assets.hidden_states import hidden_state_partitions_asset, range_complete
from dflash_assets.orchestration.assets.target_completions import target_completions_asset
from dflash_assets.orchestration.assets.tokenized_completions import tokenized_completions_asset
from dflash_assets.orchestration.execution.executor import code_location_executor
from dflash_assets.orchestration.io_manager import StoreIOManager
from dflash_assets.orchestration.resources import (
    DatasetResource,
    DeviceLeaseResource,
    GenerationResource,
    StoreResource,
    TargetModelResource,
)
from dflash_assets.orchestration.sensors import failed_range_sensor, sample_range_sensor


def build_definitions(completions: str | None = None) -> Definitions:
    """The code location as the settings say now; `completions` overrides `DFLASH_COMPLETIONS`."""
    completions = completions or settings.completions_source()
    regenerated = [target_completions_asset()] if completions == "target" else []
    range_assets = [*regenerated, tokenized_completions_asset(completions), hidden_state_partitions_asset()]
    store = StoreResource()
    return Definitions(
        assets=[*range_assets, drafter_checkpoints_asset()],
        asset_checks=[range_complete],
        sensors=[failed_range_sensor(range_assets), sample_range_sensor],
        executor=code_location_executor(),
        resources={
            "store": store,
            "store_io_manager": StoreIOManager(store=store),
            "dataset": DatasetResource(),
            "target_model": TargetModelResource(),
            "devices": DeviceLeaseResource(),
            "generation": GenerationResource(),
        },
    )


defs = build_definitions()
