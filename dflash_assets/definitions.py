"""The one Definitions object of the dflash-assets code location.

Loading it reads no dataset, no store and no model, and imports no torch: partitions are dynamic
(`partitions.py`), resources open what they need when a run uses them. `DFLASH_COMPLETIONS=target`
puts `target_completions` upstream of `tokenized_completions` (see that asset). A bad `DFLASH_*` value
stops loading with one line naming it, before anything reads one.
"""
# ruff: noqa: E402 - the settings are checked before any module that reads one is imported

from dflash_assets.orchestration.user_errors import check_settings, report_in_one_line

report_in_one_line()
check_settings()

from dagster import Definitions

from dflash_assets.orchestration.assets.drafter_checkpoints import drafter_checkpoints
from dflash_assets.orchestration.assets.hidden_states import hidden_state_partitions
from dflash_assets.orchestration.assets.target_completions import target_completions
from dflash_assets.orchestration.assets.tokenized_completions import COMPLETIONS_SOURCE, tokenized_completions
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

store = StoreResource()
regenerated = [target_completions] if COMPLETIONS_SOURCE == "target" else []

defs = Definitions(
    assets=[*regenerated, tokenized_completions, hidden_state_partitions, drafter_checkpoints],
    sensors=[failed_range_sensor, sample_range_sensor],
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
