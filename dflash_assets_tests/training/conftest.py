"""The tiny training setup the training tests share: a tiny target of the real family, a drafter config
for it, its capture, and twelve counting samples (each module gets its own; the code is here once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets_tests.support.drafter_fixtures import (
    build_tiny_target,
    counting_samples,
    load_capture,
    tiny_drafter_config,
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def config(target_dir: Path) -> DrafterConfig:
    return tiny_drafter_config(target_dir)


@pytest.fixture(scope="module")
def capture(target_dir: Path) -> HiddenStateCapture:
    return load_capture(target_dir)


@pytest.fixture(scope="module")
def samples() -> list[TokenizedSample]:
    return counting_samples(12)
