"""A Dagster engineer's habits work here: `dg scaffold defs` writes into the defs folder the code location
loads beside the product's assets (not into definitions.py), and every product asset shows its owners
and a link to the function that computes it in the UI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, LocalFileCodeReference, UrlCodeReference

from dflash_assets import definitions
from dflash_assets.settings import ALL_SETTINGS
from dflash_assets_tests.conftest import REPO

PRODUCT = [
    "drafter_checkpoints",
    "drafter_evaluations",
    "hidden_state_partitions",
    "target_completions",
    "tokenized_completions",
]


def test_dg_takes_the_folder_the_definitions_load_as_the_defs_folder_not_definitions_py():
    import tomllib
    from dagster_dg_core.config import normalize_cli_config
    from dagster_dg_core.context import DgContext

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["dg"]["project"]
    assert project["defs_module"] == definitions.DEFS_MODULE
    context = DgContext.for_project_environment(REPO, normalize_cli_config({}, None))
    assert context.defs_path == REPO / "dflash_assets" / "defs"
    assert context.code_location_target_module_name == "dflash_assets.definitions"


def _fresh_copy(destination: Path) -> Path:
    """What a fresh clone of this working tree holds: its tracked files and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.mark.slow  # three dg processes in a fresh copy
def test_in_a_fresh_clone_dg_checks_scaffolds_and_lists_an_asset_beside_the_products_five(tmp_path):
    """The held-out check's commands, as a newcomer runs them: no DAGSTER_HOME (dg then makes a
    temporary instance from the repository's dagster.yaml), no setting but the one that puts all five
    product assets in the graph."""
    clone = _fresh_copy(tmp_path / "clone")
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("DFLASH_") and name != "DAGSTER_HOME"
    }
    env.update(
        DFLASH_HOME=str(tmp_path / "dflash-home"), DFLASH_COMPLETIONS="target"
    )  # README: scripts set it
    dg = str(Path(sys.executable).with_name("dg"))

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([dg, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done

    run("check", "defs")
    run("scaffold", "defs", "dagster.asset", "scaffolded_asset.py")
    assert (clone / "dflash_assets" / "defs" / "scaffolded_asset.py").is_file()
    listed = json.loads(run("list", "defs", "--json").stdout)
    assert sorted(asset["asset_key"] for asset in listed["assets"]) == sorted([*PRODUCT, "scaffolded_asset"])
    assert not (REPO / "dflash_assets" / "defs" / "scaffolded_asset.py").exists()  # the clone's, not ours
    assert not (tmp_path / "dflash-home").exists()  # nothing read a dataset or built a model


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for setting in ALL_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    return monkeypatch


def _asset_pages(completions: str = "target") -> dict[str, tuple[list[str], object]]:
    """Each product asset's owners and code reference, as the UI reads them from the repository."""
    graph = definitions.build_definitions(completions).get_repository_def().asset_graph
    pages = {}
    for name in PRODUCT:
        node = graph.get(AssetKey(name))
        references = node.metadata[definitions.CODE_REFERENCES].code_references
        assert len(references) == 1, references
        pages[name] = (list(node.owners), references[0])
    return pages


def test_every_product_asset_shows_its_owners_and_the_source_line_of_the_function_computing_it(no_settings):
    for name, (owners, reference) in _asset_pages().items():
        assert owners == definitions.OWNERS, name
        assert isinstance(reference, LocalFileCodeReference), reference
        source = Path(reference.file_path)
        assert source.parent == REPO / "dflash_assets" / "orchestration" / "assets", reference
        # The line opens the asset's own definition (its `@asset(`), in its own module: not the wrapper
        # that masks secrets, which Dagster's `with_source_code_references` would name.
        lines = source.read_text().splitlines()[reference.line_number - 1 :]
        assert lines[0].strip().startswith("@asset("), (name, reference)
        definition = "\n".join(lines[:60])
        assert f"def {name}(" in definition or f'name="{name}"' in definition, (name, reference)


def test_with_a_repository_url_the_code_links_open_the_same_line_there_at_the_ref(no_settings):
    local = {name: reference for name, (_, reference) in _asset_pages().items()}
    no_settings.setenv("DFLASH_GIT_REF", "v0.1.0")
    for repository, files in [
        ("https://github.com/acme/dflash-assets/", "https://github.com/acme/dflash-assets/tree/v0.1.0"),
        (
            "https://gitlab.example.com/ml/dflash-assets",
            "https://gitlab.example.com/ml/dflash-assets/-/tree/v0.1.0",
        ),
    ]:
        no_settings.setenv("DFLASH_GIT_URL", repository)
        for name, (_, reference) in _asset_pages().items():
            path = Path(local[name].file_path).relative_to(REPO).as_posix()
            assert isinstance(reference, UrlCodeReference), reference
            assert reference.url == f"{files}/{path}#L{local[name].line_number}"
