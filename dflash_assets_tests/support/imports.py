"""Every import a Python file makes, read from its source: the house tests that say who may import whom."""

from __future__ import annotations

import ast


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import in `tree`: top-level and lazy ones inside functions, and
    `importlib.import_module("...")` / `__import__("...")` with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found
