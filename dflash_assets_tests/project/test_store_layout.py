"""The store has one map, `dflash_assets/storage/layout.py`: every asset's prefix and every stored object's
name is spelled there and imported everywhere else, so a key's writer and its readers cannot drift apart.
A literal that spells one again (in the product or in `scripts/`) fails here, naming its file and line;
docstrings and comments may name them freely."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_assets.storage import layout
from dflash_assets_tests.conftest import REPO

LAYOUT = Path(layout.__file__).resolve()
PREFIXES = {value for name, value in vars(layout).items() if name.endswith("_PREFIX")}
NAMES = {
    value
    for name, value in vars(layout).items()
    if name.isupper() and isinstance(value, str) and value not in PREFIXES
}
# Values that are also plain words, or the files of every model directory (the target's too, which never
# reaches the store): as a bare string they mean other things (a metadata key, a local folder, the
# target's config), so only a second definition (`X = "checkpoints"`) or a key spelled out counts.
COMMON = {value for value in PREFIXES | NAMES if value.isalpha()} | {
    layout.CONFIG_NAME,
    layout.WEIGHTS_NAME,
    layout.MODEL_CARD_NAME,
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of string statements (docstrings): text about the layout, not a use of it."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _definitions(tree: ast.AST) -> set[int]:
    """The ids of strings assigned whole to a name: how a second copy of a layout constant is written."""
    values = (node.value for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign)))
    return {id(value) for value in values if isinstance(value, ast.Constant)}


def spells_the_layout(text: str, defined: bool) -> bool:
    """Whether a string (or an f-string's literal part) spells a prefix or a stored name of the layout."""
    if not text or any(c.isspace() for c in text):  # prose (an error message, a help text)
        return False
    if text in COMMON:
        return defined
    if text in PREFIXES | NAMES:
        return True
    if any(text.startswith(prefix + "/") for prefix in PREFIXES):  # "checkpoints/", f"drafter/{run}"
        return True
    if any(text.endswith("/" + name) for name in NAMES - COMMON):  # f"{prefix}/evaluation.json"
        return True
    return any(part in (PREFIXES | NAMES) - COMMON for part in text.split("/"))  # "x/hidden-states/y"


def layout_literals(path: Path) -> list[str]:
    """`file:line: 'literal'` for each string in `path` that spells the layout."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings, defined = _docstrings(tree), _definitions(tree)
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and spells_the_layout(node.value, id(node) in defined)
    ]
    return [
        f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for node in sorted(found, key=lambda n: n.lineno)
    ]


def test_no_module_but_the_layout_spells_a_store_prefix_or_a_stored_name():
    sources = sorted([*(REPO / "dflash_assets").rglob("*.py"), *(REPO / "scripts").rglob("*.py")])
    found = [line for path in sources if path.resolve() != LAYOUT for line in layout_literals(path)]
    assert not found, (
        "store prefixes or stored names spelled outside dflash_assets/storage/layout.py (import the "
        "constant, or build the key with it):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("source", "spelled"),
    [
        ('KEY = f"hidden-states/{key}"', True),
        ('PREFIX = "checkpoints"', True),
        ('staged = directory / "evaluation.json"', True),
        ('uri = store.uri(f"{prefix}/_manifest.json")', True),
        ('metadata = {"drafter": name, "checkpoints": 3}', False),
        ('path = model_dir / "config.json"', False),
        ('raise ValueError(f"{prefix} has no _manifest.json: materialise it")', False),
    ],
)
def test_a_key_or_a_second_definition_counts_and_a_metadata_key_or_a_message_does_not(
    tmp_path, monkeypatch, source, spelled
):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    path = tmp_path / "module.py"
    path.write_text(f'"""Reads `evaluations/<run>/<set>/evaluation.json`."""\n{source}\n')
    assert bool(layout_literals(path)) == spelled, layout_literals(path)


def test_every_asset_the_store_keeps_has_its_prefix_in_the_layout_evaluations_included(monkeypatch):
    from dflash_assets import definitions
    from dflash_assets.settings import ALL_SETTINGS

    for setting in ALL_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    assets = definitions.product_definitions().assets
    stored = {
        key.path[-1]
        for asset in assets
        for key in asset.keys
        if asset.get_io_manager_key_for_asset_key(key) == "store_io_manager"
    }
    assert stored == set(layout.ASSET_PREFIXES)
    assert layout.ASSET_PREFIXES["drafter_evaluations"] == layout.EVALUATIONS_PREFIX
