"""A script of `scripts/` loaded as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from dflash_assets_tests.conftest import REPO


def load_script(name: str, *, register: bool = False) -> ModuleType:
    """`scripts/<name>.py` as the module `name`; `register` also puts it in `sys.modules` while it loads
    and after (a dataclass in it resolves its annotations through its module)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
