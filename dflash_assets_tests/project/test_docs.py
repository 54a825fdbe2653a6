"""The manual's configuration reference is the settings table: written from `settings.ALL_SETTINGS` by
`scripts/write_settings_reference.py`, and checked equal here, so a setting added or changed without
rewriting the page fails with the command to run."""

from dflash_assets.settings import Setting
from dflash_assets_tests.conftest import REPO
from dflash_assets_tests.support.scripts import load_script

reference = load_script("write_settings_reference")


def test_the_configuration_page_holds_the_settings_table_as_written_from_settings_py():
    page = reference.PAGE.read_text()
    assert reference.with_table(page, reference.current_table()) == page, (
        f"{reference.PAGE.relative_to(REPO)}'s settings table differs from dflash_assets/settings.py: "
        f"run `{reference.COMMAND}` and commit the page"
    )


def test_the_table_has_a_row_per_setting_with_its_default_and_meaning():
    table = reference.settings_table(
        [
            Setting("DFLASH_A", "8", "Most of them.\n  A | B, on two lines."),
            Setting("DFLASH_B", "", "Empty: the rule."),
        ]
    )
    assert table.splitlines()[2:] == [
        "| `DFLASH_A` | `8` | Most of them. A \\| B, on two lines. |",
        "| `DFLASH_B` | empty | Empty: the rule. |",
    ]


def test_a_page_whose_table_is_stale_is_rewritten_between_the_markers_only():
    def page(table: str) -> str:
        return f"# Configuration\n\nprose\n\n{reference.BEGIN}\n{table}{reference.END}\n\nmore prose\n"

    assert reference.with_table(page("| old |\n"), "| new |\n") == page("| new |\n")


def test_every_drop_reason_is_explained_in_the_troubleshooting_page():
    from dflash_assets.conversations.layouts import DROP_REASONS

    page = (REPO / "docs" / "troubleshooting.md").read_text()
    section = page.split("## Dropped rows", 1)[1].split("\n## ", 1)[0]
    missing = [reason for reason in DROP_REASONS if f"`{reason}`" not in section]
    assert not missing, f"docs/troubleshooting.md's 'Dropped rows' table lacks {missing}"
