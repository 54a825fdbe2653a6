"""What a training step holds and where it runs: a micro-batch's graph and hidden states go once its
backward has run (a non-finite one's too), and a run trains with its leased device as the current one."""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import DrafterTrainer, train_drafter


def _settings(**overrides: object) -> TrainSettings:
    fields = {
        "mode": "online",
        "num_anchors": 8,
        "global_batch_size": 4,
        "eval_samples": 0,
        "spec_eval_prompts": 0,
        "checkpoint_every_minutes": None,
        "max_steps": 1,
        "micro_batch_bytes": 1,  # one sequence a micro-batch: four a step
    }
    return TrainSettings(**{**fields, **overrides})


def test_a_micro_batch_s_graph_and_hidden_states_are_freed_before_the_next_even_with_a_non_finite_loss(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    def first_is_nan(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = capture(input_ids, attention_mask)
        if not poisoned:
            poisoned.append(True)
            states = states.clone().fill_(float("nan"))  # the step's first micro-batch: its loss is NaN
        return states

    poisoned: list[bool] = []
    trainer = DrafterTrainer(
        config,
        _settings(),
        OnlineData(samples, first_is_nan),
        store=open_store(str(tmp_path / "store")),
        run="lifetimes",
        work_dir=tmp_path / "work",
    )
    trainer.resume()
    keep_alive = {id(t) for t in [*trainer.model.parameters(), *trainer.model.buffers()]}
    micro_batches: list[dict[str, list[weakref.ref]]] = []
    alive_at_next: list[int] = []
    collate = trainer.source.collate

    def collated(batch_samples: Any):
        gc.collect()
        alive_at_next.append(sum(ref() is not None for earlier in micro_batches for ref in earlier["all"]))
        batch = collate(batch_samples)
        micro_batches.append({"all": [weakref.ref(batch.hidden_states)]})
        return batch

    def saved(tensor: torch.Tensor) -> torch.Tensor:
        # Activations; not the weights, nor the scalars the step's figures are (kept, detached, by design).
        if micro_batches and id(tensor) not in keep_alive and tensor.numel() > config.block_size:
            micro_batches[-1]["all"].append(weakref.ref(tensor))
        return tensor

    trainer.source.collate = collated
    plan = trainer.plan(0)
    with torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor):
        stats, _ = trainer.train_step(0, plan[0], list(trainer.source.iterate(plan[0])))
    gc.collect()
    assert stats.nonfinite_ranks == 1 and len(micro_batches) == 4  # the step was skipped, as it must be
    assert all(len(refs["all"]) > 10 for refs in micro_batches)  # states and saved activations, traced
    assert alive_at_next == [0, 0, 0, 0]  # nothing of an earlier micro-batch when the next is collated
    assert all(ref() is None for refs in micro_batches for ref in refs["all"])


def test_a_run_trains_with_its_leased_device_current(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease of cuda:k runs kernels, allocates and saves the random state of cuda:k, not GPU 0 (the
    single-process path set no device; launched ranks set theirs before joining the process group)."""
    import dflash_assets.training.train as train_module

    current: list[str] = []

    @contextlib.contextmanager
    def noted(device: str):
        current.append(device)
        try:
            yield
        finally:
            current.remove(device)

    steps_on: list[list[str]] = []
    train_step = DrafterTrainer.train_step

    def step(self: DrafterTrainer, *args: Any, **kwargs: Any) -> Any:
        steps_on.append(list(current))
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(train_module, "current_device", noted)
    monkeypatch.setattr(DrafterTrainer, "train_step", step)
    result = train_drafter(
        config,
        _settings(max_steps=2, device="cpu:0", micro_batch_bytes=None),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="device",
        work_dir=tmp_path / "work",
    )
    assert result.steps == 2 and steps_on == [["cpu:0"], ["cpu:0"]] and current == []
