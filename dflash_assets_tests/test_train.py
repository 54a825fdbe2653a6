"""Training the drafter: it learns, both data modes agree, and a killed run resumes exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dflash_assets.core.batching import pad_batch
from dflash_assets.core.capture import HiddenStateCapture
from dflash_assets.core.drafter import DFlashDrafter, DrafterConfig, anchor_generator, sample_anchors
from dflash_assets.core.evaluate import evaluate_drafter
from dflash_assets.core.samples import TokenizedSample
from dflash_assets.core.store import open_store
from dflash_assets.core.train import (
    OfflineData,
    OnlineData,
    TrainSettings,
    collate_tokenized_samples,
    epoch_plan,
    train_drafter,
)
from dflash_assets_tests.drafter_fixtures import (
    build_tiny_target,
    counting_samples,
    load_capture,
    tiny_drafter_config,
    write_hidden_state_partition,
)

PARTITION = "00000000-00000099"


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


def quick_settings(**overrides: object) -> TrainSettings:
    fields = {
        "mode": "online",
        "epochs": 3,
        "lr": 3e-3,
        "warmup_ratio": 0.05,
        "num_anchors": 8,
        "max_tokens_per_batch": 700,  # 3 or 4 samples of ~40 tokens with 8 blocks of 16 each
        "eval_samples": 2,
        "log_every_steps": 1,
        "checkpoint_every_minutes": None,
    }
    return TrainSettings(**{**fields, **overrides})


def logged_losses(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.search(r" loss (\S+) ", line))]


def test_the_drafter_learns_a_repeated_small_dataset(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    settings = quick_settings(epochs=8, log_every_steps=4)
    lines: list[str] = []
    reports: list[dict] = []
    result = train_drafter(
        config,
        settings,
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="learns",
        work_dir=tmp_path / "work",
        log=lines.append,
        on_checkpoint=reports.append,
    )

    held_out = [s for s in samples if s.sample_index in result.eval_sample_indices]
    torch.manual_seed(settings.seed)  # the trainer's initial weights
    untrained = DFlashDrafter.from_target(config)
    batch = collate_tokenized_samples(held_out, settings.max_length, capture, config)
    before = evaluate_drafter(untrained, [batch], num_anchors=settings.num_anchors)
    after = evaluate_drafter(result.model, [batch], num_anchors=settings.num_anchors)
    assert after["loss"] < before["loss"] - 1.0, (before["loss"], after["loss"])
    assert after["acceptance_length_tau"] >= before["acceptance_length_tau"]

    assert result.steps == result.total_steps > 0
    assert result.eval is not None and result.eval["loss"] == pytest.approx(after["loss"], abs=1e-4)
    assert len(result.per_position_accuracy) == config.block_size - 1
    assert reports[-1]["step"] == result.steps and reports[-1]["eval"]["acceptance_length_tau"] >= 1.0
    assert result.checkpoints == [reports[-1]["checkpoint"]]
    assert all(re.search(r"step \d+/\d+ .* lr .* tokens/s .* eta ", line) for line in lines)
    trained = {i for r in result.trained_sample_ranges for i in range(int(r[:8]), int(r[9:]) + 1)}
    assert trained | set(result.eval_sample_indices) == set(range(12))
    assert not trained & set(result.eval_sample_indices)


def test_offline_and_online_training_see_the_same_batches_and_losses(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    target_dir: Path,
    tmp_path: Path,
) -> None:
    store = open_store(str(tmp_path / "store"))
    objects = write_hidden_state_partition(
        store, PARTITION, samples, capture, str(target_dir), tmp_path / "scratch"
    )
    settings = {"max_steps": 3, "eval_samples": 0}
    online_lines: list[str] = []
    online = train_drafter(
        config,
        quick_settings(**settings),
        OnlineData(samples, capture),
        store=store,
        run="online",
        work_dir=tmp_path / "online",
        log=online_lines.append,
    )
    offline_lines: list[str] = []
    offline = train_drafter(
        config,
        quick_settings(mode="offline", **settings),
        OfflineData(store, objects, tmp_path / "cache", num_tokens=[s.num_tokens for s in samples]),
        store=store,
        run="offline",
        work_dir=tmp_path / "offline",
        log=offline_lines.append,
    )

    assert offline.partitions == [PARTITION]
    assert offline.trained_sample_ranges == online.trained_sample_ranges
    # Offline objects were captured one sample at a time, online batches all at once; after rounding
    # to bf16 (the stored precision) the hidden states agree up to the target's batch-size noise.
    assert logged_losses(offline_lines) == pytest.approx(logged_losses(online_lines), rel=1e-4)
    for name, weight in online.model.state_dict().items():
        torch.testing.assert_close(offline.model.state_dict()[name], weight, rtol=1e-3, atol=1e-5)


class Killed(Exception):
    pass


def test_a_killed_run_resumes_from_the_store_and_ends_at_the_same_weights(
    s3_store_url: str,
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    target_dir: Path,
    tmp_path: Path,
) -> None:
    store = open_store(s3_store_url)
    objects = write_hidden_state_partition(
        store, PARTITION, samples, capture, str(target_dir), tmp_path / "scratch"
    )
    settings = quick_settings(mode="offline", checkpoint_every_steps=2)

    def offline(cache: str) -> OfflineData:
        return OfflineData(store, objects, tmp_path / cache, num_tokens=[s.num_tokens for s in samples])

    straight = train_drafter(
        config, settings, offline("cache-a"), store=store, run="straight", work_dir=tmp_path / "a"
    )
    assert straight.steps >= 6

    def kill_at_step_5(line: str) -> None:
        if line.startswith("step 5/"):
            raise Killed(line)

    with pytest.raises(Killed):
        train_drafter(
            config,
            settings,
            offline("cache-b"),
            store=store,
            run="killed",
            work_dir=tmp_path / "b",
            log=kill_at_step_5,
        )
    lines: list[str] = []
    resumed = train_drafter(
        config,
        settings,
        offline("cache-c"),
        store=store,
        run="killed",
        work_dir=tmp_path / "c",
        log=lines.append,
    )

    assert resumed.resumed_from_step == 4 and "resuming run killed" in lines[0]
    assert resumed.steps == straight.steps
    for name, weight in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], weight), name


@pytest.mark.parametrize(("num_anchors", "max_tokens_per_batch"), [(8, 700), (64, 2000)])
def test_a_batch_with_its_block_slots_fits_the_token_budget(
    num_anchors: int, max_tokens_per_batch: int
) -> None:
    # The drafter's work is the padded context plus `blocks * block_size` query slots per sample; with
    # 64 anchors asked for, these ~40-token samples are capped by the anchors they can hold instead.
    samples = counting_samples(40, seed=1)
    settings = quick_settings(num_anchors=num_anchors, max_tokens_per_batch=max_tokens_per_batch)
    sample_ids = list(range(len(samples)))
    for epoch in range(settings.epochs):
        plan = epoch_plan([s.num_tokens for s in samples], sample_ids, settings, epoch)
        assert sorted(i for batch in plan for i in batch) == sample_ids
        assert max(len(batch) for batch in plan) > 1  # the budget is used, not only respected
        for batch_index, batch in enumerate(plan):
            loss_mask, _ = pad_batch([samples[i].loss_mask for i in batch], 0)
            generator = anchor_generator(settings.seed, epoch, batch_index)
            anchors = sample_anchors(loss_mask.bool(), settings.num_anchors, generator)
            batch_size, padded_length = loss_mask.shape
            work = batch_size * (padded_length + anchors.positions.shape[1] * settings.block_size)
            assert work <= settings.max_tokens_per_batch, (epoch, batch)


def test_unknown_train_mode_is_rejected_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="DFLASH_TRAIN_MODE"):
        TrainSettings(mode="hybrid")
