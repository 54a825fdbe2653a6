"""The installed Dagster packages are one release line: every integration pins the core it runs with."""

from importlib.metadata import PackageNotFoundError, requires, version

import pytest
from packaging.requirements import Requirement

INTEGRATIONS = ["dagster-webserver", "dagster-aws", "dagster-postgres", "dagster-k8s", "dagster-celery"]


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_each_dagster_integration_requires_exactly_the_installed_core(integration):
    try:
        pinned = [Requirement(r) for r in requires(integration) or [] if Requirement(r).name == "dagster"]
    except PackageNotFoundError:
        pytest.fail(f"{integration} is not installed; scripts/setup.sh installs it")
    assert pinned, f"{integration} declares no dagster requirement"
    installed = version("dagster")
    assert all(r.specifier.contains(installed) for r in pinned), (
        f"{integration} {version(integration)} wants {[str(r.specifier) for r in pinned]}, "
        f"dagster is {installed}"
    )


def test_the_core_is_the_release_line_the_project_pins():
    assert version("dagster") == "1.13.27"
    assert version("dagster-aws") == "0.29.27"


def test_the_k8s_extra_pins_dagster_k8s_on_the_release_line_and_is_what_is_installed():
    extra = [Requirement(r) for r in requires("dflash-assets") or [] if 'extra == "k8s"' in r]
    assert [str(r.specifier) for r in extra if r.name == "dagster-k8s"] == ["==0.29.27"]
    assert version("dagster-k8s") == "0.29.27"
    import dagster_k8s  # the extra resolves to an importable package on this core

    assert dagster_k8s.k8s_job_executor.name == "k8s"


def test_the_celery_extra_pins_dagster_celery_on_the_release_line_and_is_what_is_installed():
    import tomllib  # the checkout's pyproject: an editable install's metadata may predate it

    from dflash_assets_tests.conftest import REPO

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("celery", "test"):
        pins = [Requirement(r) for r in extras[extra] if Requirement(r).name == "dagster-celery"]
        assert [str(r.specifier) for r in pins] == ["==0.29.27"], extra
    assert version("dagster-celery") == "0.29.27"
    import redis  # noqa: F401  the Redis broker's client comes with the extra
    from dagster_celery import celery_executor

    assert celery_executor.name == "celery"
