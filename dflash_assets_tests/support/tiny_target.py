"""The tiny target the drafter and training tests share, as module-scoped fixtures: a small model of
the real family (gated delta net + attention) built from scratch, a drafter config for it, its capture,
its model, and twelve counting samples. The `drafter/` and `training/` conftests import them; each
test module gets its own instances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
def target(target_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def samples() -> list[TokenizedSample]:
    return counting_samples(12)
