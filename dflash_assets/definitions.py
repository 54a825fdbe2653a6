"""The one Definitions object of the dflash-assets code location: the product's assets, and your own.

Loading it reads no dataset, no store and no model, and imports no torch: partitions are dynamic
(`partitions.py`), resources open what they need when a run uses them. What shapes the code location is
read when `build_definitions` runs: the five assets are always there, `DFLASH_COMPLETIONS=target`
puts `target_completions` upstream of `tokenized_completions`, `DFLASH_EVAL_SETS` names
`drafter_evaluations`' partitions, `DFLASH_EXECUTOR` chooses the executor, and the GPU steps' pools and
Kubernetes tags follow their settings (a snapshot test holds every combination:
`python scripts/write_asset_graph_snapshot.py` rewrites it). A test varies them in-process by calling
it again. A bad `DFLASH_*` value stops loading with one line naming it.

Your own assets go in `defs/` beside this file, where `dg scaffold defs dagster.asset my_asset.py` writes
them; they load with the product's, in the UI and every command. Every asset shows a link to the
function computing it in the UI, the product's their owners too.
"""
# ruff: noqa: E402 - the settings are checked before any module that reads one is imported

from dflash_assets.orchestration.user_errors import (
    check_settings,
    loaded_by_a_shell_command,
    report_in_one_line,
)

if loaded_by_a_shell_command():  # `dagster asset materialize`, `dg launch`: never a server or a worker
    report_in_one_line()
check_settings()

import importlib
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import (
    AssetsDefinition,
    AssetSpec,
    BetaWarning,
    CodeReferencesMetadataValue,
    ComponentTree,
    Definitions,
    LocalFileCodeReference,
    OpDefinition,
    PreviewWarning,
    UrlCodeReference,
)

import dflash_assets
from dflash_assets import settings
from dflash_assets.orchestration.assets.drafter_checkpoints import drafter_checkpoints_asset
from dflash_assets.orchestration.assets.drafter_evaluations import drafter_evaluations_asset
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

# Who answers for the product's assets (the UI's owner filter and asset pages): change it to your team.
OWNERS = ["team:ml-infra"]
# Your assets' folder: `[tool.dg.project] defs_module` in pyproject.toml names the same (a test holds them
# equal), so `dg scaffold defs` writes where this loads from.
DEFS_MODULE = "dflash_assets.defs"
# What holds the package: the repository root in a checkout, site-packages in an installed one.
_ROOT = Path(dflash_assets.__file__).resolve().parent.parent
CODE_REFERENCES = "dagster/code_references"  # the metadata key the UI's code links are read from


@contextmanager
def _quiet_dagster_previews() -> Iterator[None]:
    """Dagster marks the defs folder's loading, spec mapping and code references preview or beta, and
    would say so above every command; `load_from_defs_folder` silences the same warnings. Also a
    decorator."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        warnings.simplefilter("ignore", BetaWarning)
        yield


def build_definitions(completions: str | None = None) -> Definitions:
    """The code location as the settings say now: the product's assets beside those in `defs/`.
    `completions` overrides `DFLASH_COMPLETIONS`."""
    return Definitions.merge(product_definitions(completions), defs_folder_definitions())


def product_definitions(completions: str | None = None) -> Definitions:
    """The product's assets, checks, sensors, executor and resources: what the asset-graph snapshot
    holds. Each asset shows its owners and a link to its code in the UI."""
    completions = completions or settings.completions_source()
    # Always in the graph: with `dataset` answers it feeds nothing yet (materialise it, then set
    # DFLASH_COMPLETIONS=target to tokenize the target's own answers); with `target`, it is upstream.
    range_assets = _as_shown_in_the_ui(
        [
            target_completions_asset(),
            tokenized_completions_asset(completions),
            hidden_state_partitions_asset(),
        ]
    )
    store = StoreResource()
    return Definitions(
        assets=[
            *range_assets,
            *_as_shown_in_the_ui([drafter_checkpoints_asset(), drafter_evaluations_asset()]),
        ],
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


@_quiet_dagster_previews()
def defs_folder_definitions() -> Definitions:
    """What `defs/` holds, loaded as `dg` and Dagster's `load_from_defs_folder` load a project's folder,
    each asset with a link to its code. Two differences: the folder is found from the package itself (an
    installed package, the image's Celery worker say, has no pyproject.toml beside it), and the tree's
    root, which would import every installed Dagster integration (boto3 with dagster-aws) to list its
    component types, is left out."""
    folder = importlib.import_module(DEFS_MODULE)
    tree = ComponentTree.from_module(defs_module=folder, project_root=_ROOT)
    yours = tree.build_defs(tree.defs_module_path)
    references = {
        key: _code_reference(asset)
        for asset in yours.assets or []
        if isinstance(asset, AssetsDefinition)
        for key in asset.keys
    }
    return yours.map_asset_specs(func=lambda spec: _linked(spec, references.get(spec.key)))


@_quiet_dagster_previews()
def _as_shown_in_the_ui(assets: list[AssetsDefinition]) -> list[AssetsDefinition]:
    """The product's `assets` with their owners and a link to the function computing each."""
    return [_owned_and_linked(asset) for asset in assets]


def _owned_and_linked(asset: AssetsDefinition) -> AssetsDefinition:
    reference = _code_reference(asset)
    return asset.map_asset_specs(lambda spec: _linked(spec.replace_attributes(owners=OWNERS), reference))


def _linked(spec: AssetSpec, reference: LocalFileCodeReference | UrlCodeReference | None) -> AssetSpec:
    """`spec` with a link to its code in the UI, unless it has one already."""
    if reference is None or CODE_REFERENCES in spec.metadata:
        return spec
    value = CodeReferencesMetadataValue(code_references=[reference])
    return spec.replace_attributes(metadata={**spec.metadata, CODE_REFERENCES: value})


def _code_reference(asset: AssetsDefinition) -> LocalFileCodeReference | UrlCodeReference | None:
    """The source file and line of the function computing `asset`; with `DFLASH_GIT_URL`, that file in the
    repository at `DFLASH_GIT_REF`, as Dagster's `link_code_references_to_git` writes it."""
    if not isinstance(asset.node_def, OpDefinition):
        return None
    body = asset.node_def.compute_fn
    body = inspect.unwrap(getattr(body, "decorated_fn", body))  # the function under `@asset` and `@redacted`
    source, line = Path(inspect.getsourcefile(body) or "").resolve(), inspect.getsourcelines(body)[1]
    repository = settings.GIT_URL.get().rstrip("/")
    if not repository or not source.is_relative_to(_ROOT):
        return LocalFileCodeReference(file_path=str(source), line_number=line)
    files = f"{repository}/-/tree" if "gitlab" in repository else f"{repository}/tree"
    return UrlCodeReference(
        url=f"{files}/{settings.GIT_REF.get()}/{source.relative_to(_ROOT).as_posix()}#L{line}"
    )


defs = build_definitions()
