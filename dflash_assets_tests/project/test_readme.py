"""The README is the front door: CI runs the test command it gives, it stays a few screens long, and
every page it points to exists."""

import re

from dflash_assets_tests.conftest import REPO

README = (REPO / "README.md").read_text()
MAX_README_BYTES = 16 * 1024


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh      # install what the tests need" in README
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_the_readme_stays_a_few_screens_long():
    size = len(README.encode())
    assert size <= MAX_README_BYTES, (
        f"README.md is {size:,} bytes, over {MAX_README_BYTES:,}: move the detail to a page under docs/ "
        "and link it from the README's index"
    )


def test_every_file_the_readme_links_to_exists():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [target for target in targets if "://" not in target]
    assert "docs/configuration.md" in local  # the pattern sees the README's links
    missing = [target for target in local if not (REPO / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
