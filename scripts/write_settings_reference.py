"""Write the configuration reference (the table in docs/configuration.md) from the settings table.

`dflash_assets/settings.py`'s `ALL_SETTINGS` is the one place a `DFLASH_*` setting is declared: its
name, default and meaning. The docs page holds the same table between two markers, and a test fails
when the two differ. After adding or changing a setting, run from the repository root:

    python scripts/write_settings_reference.py          # rewrite the table in docs/configuration.md
    python scripts/write_settings_reference.py --check  # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
COMMAND = "python scripts/write_settings_reference.py"
BEGIN = f"<!-- BEGIN settings table: written by `{COMMAND}` from dflash_assets/settings.py; edit there -->"
END = "<!-- END settings table -->"


def settings_table(settings: list) -> str:
    """The Markdown table of `settings` (each with `name`, `default` and `meaning`), in their order."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for setting in settings:
        default = f"`{setting.default}`" if setting.default else "empty"
        meaning = " ".join(setting.meaning.split()).replace("|", "\\|")
        rows.append(f"| `{setting.name}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def with_table(page: str, table: str) -> str:
    """`page` with the text between the markers replaced by `table`."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{PAGE.name} lacks the markers {BEGIN!r} and {END!r} around the settings table")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def current_table() -> str:
    from dflash_assets.settings import ALL_SETTINGS

    return settings_table(ALL_SETTINGS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the page differs")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    wanted = with_table(page, current_table())
    if args.check:
        if wanted != page:
            print(f"{PAGE} differs from dflash_assets/settings.py: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if wanted != page:
        PAGE.write_text(wanted)
        print(f"rewrote the settings table in {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
