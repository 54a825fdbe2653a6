"""The scripts are the product's users, not the tests': no script imports the test package, and nothing
reaches into the command line's private names (`dflash_assets.cli._x`); what they share lives in the
product (`orchestration.execution.in_process`, `bench.zlab`)."""

from __future__ import annotations

import ast
from pathlib import Path

from dflash_assets_tests.conftest import REPO
from dflash_assets_tests.support.imports import imported_modules

TEST_PACKAGE = "dflash_assets_tests"
CLI = "dflash_assets.cli"


def _test_package_imports(tree: ast.AST) -> list[tuple[int, str]]:
    return [(line, module) for line, module in imported_modules(tree) if module.split(".")[0] == TEST_PACKAGE]


def _private_cli_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each private name of `dflash_assets.cli` used from outside it: imported
    (`from dflash_assets.cli import _x`) or read off the module (`cli._x`, `dflash_assets.cli._x`)."""
    aliases = set()  # names bound to the module itself in this file
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if node.module == CLI and alias.name.startswith("_"):
                    found.append((node.lineno, alias.name))
                elif node.module == "dflash_assets" and alias.name == "cli":
                    aliases.add(alias.asname or "cli")
        elif isinstance(node, ast.Import):
            aliases |= {alias.asname for alias in node.names if alias.name == CLI and alias.asname}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in aliases) or ast.unparse(owner) == CLI:
            found.append((node.lineno, f"{ast.unparse(owner)}.{node.attr}"))
    return sorted(found)


def _sources(folder: str) -> list[Path]:
    sources = sorted((REPO / folder).rglob("*.py"))
    assert sources, f"no Python files under {REPO / folder}"
    return sources


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def test_no_script_imports_the_test_package():
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in _sources("scripts")
        for line, module in _test_package_imports(_parse(path))
    ]
    assert offenders == [], "move what the script needs into the product (e.g. dflash_assets/bench/)"


def test_nothing_uses_a_private_name_of_the_command_line():
    offenders = [
        f"{path.relative_to(REPO)}:{line} uses {name}"
        for folder in ("scripts", "dflash_assets", TEST_PACKAGE)
        for path in _sources(folder)
        for line, name in _private_cli_names(_parse(path))
    ]
    assert offenders == [], "make it public where it belongs (running assets: orchestration.execution)"


def test_the_scans_see_every_shape_of_the_offence():
    source = (
        "import sys\n"
        "import dflash_assets_tests.support.cli\n"
        "def f():\n"
        "    from dflash_assets_tests.conftest import REPO\n"
        "    from dflash_assets.cli import UsageError, _instance\n"
        "    from dflash_assets import cli\n"
        "    import dflash_assets.cli as command_line\n"
        "    import dflash_assets.cli\n"
        "    return cli._print_failure, command_line._run, dflash_assets.cli._parser, cli.main, cli.__doc__\n"
    )
    tree = ast.parse(source)
    assert _test_package_imports(tree) == [
        (2, "dflash_assets_tests.support.cli"),
        (4, "dflash_assets_tests.conftest"),
    ]
    assert _private_cli_names(tree) == [
        (5, "_instance"),
        (9, "cli._print_failure"),
        (9, "command_line._run"),
        (9, "dflash_assets.cli._parser"),
    ]
