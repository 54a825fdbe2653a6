"""What a training run takes when its run config leaves a field out: the bundled data's own step count,
batch and anchors (the demo's, a shell's and the UI's alike), and the recipe's for a dataset of the user's."""

from __future__ import annotations

from dflash_assets.orchestration.training import TrainConfig


def test_the_bundled_data_trains_240_steps_of_4_sequences_at_64_anchors_unless_the_run_config_says(
    monkeypatch,
):
    monkeypatch.delenv("DFLASH_DATASET", raising=False)
    monkeypatch.delenv("DFLASH_TRAIN_MAX_STEPS", raising=False)
    monkeypatch.delenv("DFLASH_TRAIN_GLOBAL_BATCH_SIZE", raising=False)
    bundled = TrainConfig().train_settings()
    assert (bundled.max_steps, bundled.global_batch_size, bundled.num_anchors) == (240, 4, 64)
    assert bundled.tokens_per_anchor == 1.0  # every qualifying position up to 64, as the demo measured
    assert TrainConfig(tokens_per_anchor=6).train_settings().tokens_per_anchor == 6.0
    assert TrainConfig(num_anchors=512).train_settings().num_anchors == 512


def test_a_users_dataset_trains_the_recipes_anchors(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_DATASET", str(tmp_path / "chat.jsonl"))
    monkeypatch.delenv("DFLASH_TRAIN_GLOBAL_BATCH_SIZE", raising=False)
    own = TrainConfig().train_settings()
    assert (own.num_anchors, own.tokens_per_anchor, own.global_batch_size) == (512, 1.0, 32)
    assert TrainConfig(num_anchors=16).train_settings().num_anchors == 16
    assert TrainConfig(tokens_per_anchor=1).train_settings().tokens_per_anchor == 1.0


def test_dflash2_trains_at_block_8_and_dflash_at_16_unless_the_setting_or_the_run_config_says(monkeypatch):
    """Each architecture's recipe block when nothing says: DFlash2's recipes (SpecForge, speculators, z-lab's
    published 27B drafter) use 8, the DFlash paper 16; DFLASH_BLOCK_SIZE, then run config, override it."""
    monkeypatch.delenv("DFLASH_BLOCK_SIZE", raising=False)
    monkeypatch.delenv("DFLASH_DRAFTER_ARCH", raising=False)
    assert TrainConfig().block() == 8 and TrainConfig().train_settings().block_size == 8
    assert TrainConfig(drafter_arch="dflash").block() == 16
    monkeypatch.setenv("DFLASH_DRAFTER_ARCH", "dflash")
    assert TrainConfig().block() == 16
    monkeypatch.setenv("DFLASH_BLOCK_SIZE", "12")
    assert TrainConfig().block() == 12 and TrainConfig(drafter_arch="dflash2").block() == 12
    assert TrainConfig(block_size=4).block() == 4


def test_until_flat_comes_from_the_setting_or_the_run_config_and_leaves_the_cadence_to_the_trainer(
    monkeypatch,
):
    """Until flat, the default checkpoint interval (100 steps) yields to the trainer's twelfth of the cap,
    so a short run still has a curve; an interval the user gives stays theirs."""
    monkeypatch.delenv("DFLASH_TRAIN_UNTIL_FLAT", raising=False)
    monkeypatch.delenv("DFLASH_CHECKPOINT_EVERY_STEPS", raising=False)
    plain = TrainConfig().train_settings()
    assert not plain.until_flat and plain.checkpoint_every_steps == 100
    flat = TrainConfig(until_flat=True).train_settings()
    assert flat.until_flat and flat.checkpoint_every_steps is None
    assert TrainConfig(until_flat=True, checkpoint_every_steps=7).train_settings().checkpoint_every_steps == 7
    monkeypatch.setenv("DFLASH_TRAIN_UNTIL_FLAT", "1")
    assert TrainConfig().train_settings().until_flat
    assert not TrainConfig(until_flat=False).train_settings().until_flat
    monkeypatch.setenv("DFLASH_CHECKPOINT_EVERY_STEPS", "50")
    assert TrainConfig().train_settings().checkpoint_every_steps == 50


def test_train_samples_comes_from_the_run_config_and_is_every_sample_unless_it_says() -> None:
    assert TrainConfig().train_settings().train_samples == 0
    assert TrainConfig(train_samples=250).train_settings().train_samples == 250
