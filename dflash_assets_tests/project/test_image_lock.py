"""The image installs every package from deploy/requirements.lock, and the lock agrees with pyproject.toml:
each dependency of the project and of the extras the image installs is pinned at a version its
requirement allows, the lock pins nothing else as a direct dependency, and its torch is the release
scripts/setup.sh installs. Read offline (no resolver, no network); `bash scripts/lock.sh` rewrites it."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dflash_assets_tests.conftest import REPO

LOCK = REPO / "deploy" / "requirements.lock"
DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()
LOCK_SCRIPT = (REPO / "scripts" / "lock.sh").read_text()
RELOCK = "run `bash scripts/lock.sh` and commit deploy/requirements.lock"
PROJECT = "dflash-assets (pyproject.toml)"  # how the lock names a requirement of ours
IMAGE_EXTRAS = re.search(r'"\.\[([a-z0-9,]+)\]"', DOCKERFILE).group(1).split(",")
IMAGE_PYTHON = re.search(r"^FROM python:(\d+\.\d+)\.(\d+)", DOCKERFILE, re.M)
# The environment markers of the image: Linux x86-64, CPython of the base image's version.
IMAGE = {
    "python_version": IMAGE_PYTHON.group(1),
    "python_full_version": f"{IMAGE_PYTHON.group(1)}.{IMAGE_PYTHON.group(2)}",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _locked() -> dict[str, tuple[Version, set[str]]]:
    """name -> (pinned version, what the lock says requires it)."""
    pins: dict[str, tuple[Version, set[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, pinned = line.partition("==")
            assert pinned, f"{LOCK.name}: {line!r} is not an exact pin"
            current = canonicalize_name(name)
            pins[current] = (Version(pinned.strip()), set())
        elif current and line.strip().startswith("#"):
            via = line.strip().lstrip("#").strip()
            via = via.removeprefix("via").strip()
            if via:
                pins[current][1].add(via)
    return pins


def _image_requirements() -> list[Requirement]:
    """What pyproject.toml asks of the image: the dependencies and those of its extras, for its platform."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in IMAGE_EXTRAS:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in wanted if r.marker is None or r.marker.evaluate({**IMAGE, "extra": ""})]


def test_every_requirement_of_the_project_and_the_image_extras_is_pinned_at_a_version_it_allows():
    pins = _locked()
    for requirement in _image_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"pyproject.toml requires {requirement}, which the lock lacks: {RELOCK}"
        pinned, via = pins[name]
        assert requirement.specifier.contains(pinned, prereleases=True), (
            f"pyproject.toml requires {requirement}, the lock pins {pinned}: {RELOCK}"
        )
        assert PROJECT in via, f"the lock does not say {PROJECT} requires {name}: {RELOCK}"


def test_the_lock_pins_as_our_own_requirements_exactly_those_of_pyproject_toml():
    ours = {name for name, (_, via) in _locked().items() if PROJECT in via}
    wanted = {canonicalize_name(r.name) for r in _image_requirements()}
    assert ours == wanted, (
        f"the lock's requirements of ours differ from pyproject.toml's by {ours ^ wanted}: {RELOCK}"
    )


def test_an_extra_a_requirement_names_brings_its_packages_into_the_lock():
    """`dagster-celery[redis]` and the like: what the extra adds is pinned too (read from the installed
    package's metadata when it is the pinned version)."""
    pins = _locked()
    checked = 0
    for requirement in _image_requirements():
        name = canonicalize_name(requirement.name)
        if not requirement.extras:
            continue
        try:
            installed = Version(version(requirement.name))
        except PackageNotFoundError:
            continue
        if installed != pins[name][0]:
            continue
        for extra in requirement.extras:
            for dependency in map(Requirement, requires(requirement.name) or []):
                if (
                    dependency.marker
                    and dependency.marker.evaluate({**IMAGE, "extra": extra})
                    and not (dependency.marker.evaluate({**IMAGE, "extra": ""}))
                ):
                    assert canonicalize_name(dependency.name) in pins, (
                        f"{requirement} needs {dependency}: {RELOCK}"
                    )
                    checked += 1
    assert checked, "no requirement with an extra was checked (dagster-celery[redis] should be)"


def test_the_image_installs_the_lock_and_the_lock_is_written_for_the_images_python_and_extras():
    assert LOCK.read_text().splitlines()[1].strip("# ") == "bash scripts/lock.sh"
    assert "--requirement deploy/requirements.lock" in DOCKERFILE
    assert '--no-deps ".[' in DOCKERFILE  # the project alone: its dependencies come from the lock
    assert "--index-url" not in DOCKERFILE  # no package from outside the lock's index
    assert f"--python-version {IMAGE['python_version']}" in LOCK_SCRIPT
    assert "x86_64-manylinux" in LOCK_SCRIPT
    assert " ".join(f"--extra {extra}" for extra in IMAGE_EXTRAS) in LOCK_SCRIPT


def test_the_images_torch_is_the_release_setup_sh_installs_and_the_tests_run_on():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    setup_torch = re.search(r"DFLASH_TORCH_SPEC:-torch==([\d.]+)", setup).group(1)
    constraint = re.search(r"^torch==([\d.]+)$", (REPO / "deploy" / "constraints.txt").read_text(), re.M)
    assert constraint and constraint.group(1) == setup_torch
    pinned, via = _locked()["torch"]
    assert pinned == Version(setup_torch) and "-c deploy/constraints.txt" in via, (pinned, via)
    assert "--constraint deploy/constraints.txt" in LOCK_SCRIPT
