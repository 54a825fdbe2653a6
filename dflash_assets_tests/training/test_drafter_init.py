"""Starting from a drafter that exists (`DFLASH_DRAFTER_INIT`): checked against the run's configuration
field by field, in one line naming both values, and trained on from its weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import export_drafter, load_drafter
from dflash_assets.drafter.published import DrafterInitError, check_initial_drafter
from dflash_assets.orchestration.user_errors import user_error_message
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.train import DrafterTrainer
from dflash_assets_tests.drafter.test_export_remote_code import trained_like
from dflash_assets_tests.training.test_train import quick_settings


def _with(config: DrafterConfig, **changes: object) -> DrafterConfig:
    return DrafterConfig(**{**config.__dict__, **changes})


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"arch": "dflash2"}, "arch 'dflash'"),
        ({"target_layer_ids": [1, 2, 3, 4, 6]}, "DFLASH_TARGET_LAYER_IDS"),
        ({"mask_token_id": 298}, "DFLASH_MASK_TOKEN_ID"),
        ({"block_size": 8}, "DFLASH_BLOCK_SIZE"),
        ({"intermediate_size": 96}, "DFLASH_DRAFTER_SHAPE"),
    ],
)
def test_a_drafter_made_for_another_configuration_is_refused_in_one_line_naming_both_values(
    config: DrafterConfig, tmp_path: Path, changes: dict, named: str
):
    export_drafter(trained_like(config, seed=1), tmp_path)
    run = _with(config, **changes)
    with pytest.raises(DrafterInitError) as raised:
        check_initial_drafter(run, tmp_path)
    message = user_error_message(raised.value)  # what the command line prints: one line, no traceback
    assert message is not None and "\n" not in message and named in message
    field = next(iter(changes))
    assert (
        f"has {field} {getattr(config, field)!r} where this run's drafter has {changes[field]!r}" in message
    )


def test_a_directory_that_holds_no_drafter_is_named(config: DrafterConfig, tmp_path: Path):
    with pytest.raises(DrafterInitError, match="DFLASH_DRAFTER_INIT=.*no config.json"):
        check_initial_drafter(config, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DrafterInitError, match="not a DFlash drafter config"):
        check_initial_drafter(config, tmp_path)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_training_starts_from_the_published_weights_and_trains_on_from_them(
    config: DrafterConfig, capture, samples, target_dir: Path, tmp_path: Path, arch: str
):
    config = _with(config, arch=arch, selector_rank=16)
    export_drafter(trained_like(config, seed=5), tmp_path / "published")
    published = load_drafter(tmp_path / "published", target_model=target_dir)
    settings = quick_settings(max_steps=2, eval_samples=0, drafter_init=str(tmp_path / "published"))
    lines: list[str] = []
    trainer = DrafterTrainer(
        config, settings, OnlineData(samples, capture), store=open_store(str(tmp_path / "store")),
        run="from-published", work_dir=tmp_path / "work", log=lines.append,
    )  # fmt: skip
    for name, weight in published.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], weight, rtol=0, atol=0)
    assert any(line.startswith(f"initial weights from {tmp_path / 'published'}") for line in lines)
    result = trainer.train()
    assert result.steps == 2
    moved = [
        name
        for name, weight in published.state_dict().items()
        if not torch.equal(result.model.state_dict()[name], weight)
    ]
    assert moved  # it trained on from there


def test_weights_that_do_not_match_their_own_config_are_refused(config: DrafterConfig, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    export_drafter(trained_like(config, seed=2), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors.pop("fc.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    drafter = trained_like(config, seed=3)
    from dflash_assets.drafter.published import load_initial_weights

    with pytest.raises(DrafterInitError, match=r"missing \['fc.weight'\]"):
        load_initial_weights(drafter, tmp_path)
