"""Product code never depends on the test package: every import in `dflash_assets`, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_assets
from dflash_assets_tests.support.imports import imported_modules

TEST_PACKAGE = "dflash_assets_tests"


def test_no_product_module_imports_the_test_package():
    package_dir = Path(dflash_assets.__file__).parent
    sources = sorted(package_dir.rglob("*.py"))
    assert len(sources) > 20, f"expected the whole product package under {package_dir}"
    offenders = [
        f"{path.relative_to(package_dir.parent)}:{line} imports {module}"
        for path in sources
        for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
        if module == TEST_PACKAGE or module.startswith(TEST_PACKAGE + ".")
    ]
    assert offenders == []


def test_the_scan_sees_lazy_imports_inside_functions():
    # The old offence was an import inside a function body; the scan must not miss that shape.
    source = "def f():\n    from dflash_assets_tests.support.s3_server import start_moto_server\n"
    assert (2, "dflash_assets_tests.support.s3_server") in imported_modules(ast.parse(source))
