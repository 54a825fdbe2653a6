"""The README is a contract: every setting is documented, and CI runs the test command it gives."""


from dflash_assets import settings
from dflash_assets_tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_every_dflash_variable_is_in_the_configuration_table():
    missing = [s.name for s in settings.ALL_SETTINGS if f"| `{s.name}` |" not in README]
    assert not missing, f"README's configuration table lacks {missing}"


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh      # install what the tests need" in README
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
