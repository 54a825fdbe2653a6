"""Training checkpoints in the store: complete ones only, newest first, exact state on restore."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.storage.layout import CHECKPOINT_MARKER_NAME, TRAINER_STATE_NAME, WEIGHTS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectInfo, ObjectStore
from dflash_assets.training.checkpoints import (
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointManager,
    CheckpointPolicy,
    DataPosition,
    latest,
    restore_latest,
    restore_rng_state,
)

RUN = "run-1"


def small_drafter() -> DFlashDrafter:
    config = DrafterConfig(
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=50,
        mask_token_id=49,
        target_layer_ids=[1, 2],
        target_num_hidden_layers=4,
        num_layers=1,
    )
    return DFlashDrafter(config, torch.randn(50, 32), torch.randn(50, 32))


class Trainee:
    """A drafter with its optimiser and schedule, stepped on a made-up objective."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = small_drafter()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1 / (1 + step))

    def step(self) -> None:
        loss = sum((p**2).sum() for p in self.model.parameters())
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def save(self, manager: CheckpointManager, step: int) -> None:
        manager.save(
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_position=DataPosition(epoch=1, batch_index=step),
            config=self.model.config,
            settings={"lr": 1e-2},
        )


def write_checkpoints(store: ObjectStore, work: Path, steps: list[int]) -> Trainee:
    trainee = Trainee()
    manager = CheckpointManager(store, RUN, work)
    try:
        for step in steps:
            trainee.step()
            trainee.save(manager, step)
    finally:
        manager.close()
    return trainee


def test_a_checkpoint_restores_model_optimizer_schedule_data_position_and_rng(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    trainee = Trainee()
    trainee.step()
    torch.manual_seed(123)
    random.seed(123)
    manager = CheckpointManager(store, RUN, tmp_path / "work")
    trainee.save(manager, 7)
    manager.close()
    expected_draws = (torch.rand(3), random.random())

    restored = restore_latest(store, RUN, tmp_path / "elsewhere")
    assert restored is not None and restored.step == 7
    assert restored.data_position == DataPosition(epoch=1, batch_index=7)
    assert restored.config == trainee.model.config
    fresh = Trainee()
    fresh.model.load_state_dict(restored.model_state)
    fresh.optimizer.load_state_dict(restored.optimizer_state)
    fresh.scheduler.load_state_dict(restored.scheduler_state)
    restore_rng_state(restored.rng_state)
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1]
    # Continuing from the restored state matches continuing the original, bit for bit.
    trainee.step()
    fresh.step()
    copies = fresh.model.state_dict()
    for name, original in trainee.model.state_dict().items():
        assert torch.equal(original, copies[name]), name


class RecordingStore(LocalStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.written: list[str] = []

    def put_file(self, key: str, path: Path) -> ObjectInfo:
        info = super().put_file(key, path)
        self.written.append(key)
        return info

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        info = super().put_bytes(key, data)
        self.written.append(key)
        return info


def test_the_completion_marker_is_written_after_every_file_of_the_checkpoint(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    write_checkpoints(store, tmp_path / "work", [5])
    prefix = f"checkpoints/{RUN}/step_00000005/"
    assert store.written[-1] == prefix + CHECKPOINT_MARKER_NAME
    assert {key.removeprefix(prefix) for key in store.written[:-1]} >= {WEIGHTS_NAME, TRAINER_STATE_NAME}


def test_a_checkpoint_without_its_marker_is_ignored_with_a_warning(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    write_checkpoints(store, tmp_path / "work", [2, 4])
    store.delete(f"checkpoints/{RUN}/step_00000004/{CHECKPOINT_MARKER_NAME}")  # as if killed mid-upload

    with pytest.warns(CheckpointFallbackWarning, match="step_00000004 has no completion marker"):
        found = latest(store, RUN)
    assert found is not None and found.step == 2


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    s3_store_url: str, tmp_path: Path
) -> None:
    store = open_store(s3_store_url)
    write_checkpoints(store, tmp_path / "work", [3, 6])
    key = f"checkpoints/{RUN}/step_00000006/{WEIGHTS_NAME}"
    store.put_bytes(key, b"\0" * len(store.get_bytes(key)))  # right size, garbage content

    with pytest.warns(CheckpointFallbackWarning, match="step_00000006 cannot be loaded"):
        restored = restore_latest(store, RUN, tmp_path / "restore")
    assert restored is not None and restored.step == 3

    store.put_bytes(key, b"truncated")  # wrong size: caught by the marker before any download
    with pytest.warns(CheckpointFallbackWarning, match="does not match its marker"):
        assert latest(store, RUN).step == 3


def test_only_the_newest_checkpoint_is_kept_locally(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    write_checkpoints(store, tmp_path / "work", [1, 2, 3])
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["step_00000003"]
    assert [ref.step for ref in [latest(store, RUN)]] == [3]


def test_checkpoints_are_due_every_n_steps_or_m_minutes_whichever_comes_first(tmp_path: Path) -> None:
    now = [0.0]
    store = open_store(str(tmp_path / "store"))
    manager = CheckpointManager(
        store,
        RUN,
        tmp_path / "work",
        policy=CheckpointPolicy(every_steps=100, every_minutes=30),
        clock=lambda: now[0],
    )
    assert not manager.due(99)
    assert manager.due(100)
    now[0] = 30 * 60
    assert manager.due(5)  # half an hour passed before 100 steps did
    manager.start_from(5)
    assert not manager.due(6)
    manager.close()


class BrokenStore(LocalStore):
    def put_file(self, key: str, path: Path) -> ObjectInfo:
        raise PermissionError(f"access denied writing {key}")


def test_a_failed_upload_surfaces_as_an_error_and_commits_nothing(tmp_path: Path) -> None:
    store = BrokenStore(tmp_path / "store")
    trainee = Trainee()
    manager = CheckpointManager(store, RUN, tmp_path / "work")
    trainee.save(manager, 1)
    with pytest.raises(CheckpointError, match="access denied"):
        manager.close()
    assert latest(store, RUN) is None
