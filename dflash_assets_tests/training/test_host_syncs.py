"""A training micro-batch never makes the host wait for the device, and a step does so once, where its
figures are summed (`support/host_reads.py` counts the reads on a CPU; on CUDA torch's own sync debug
mode checks the same)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import (
    Objective,
    anchor_generator,
    dflash_loss,
    estimate_step_bytes,
    sample_anchors,
)
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData, collate_tokenized_samples
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import DrafterTrainer
from dflash_assets_tests.support.host_reads import HostReads


def _settings(**overrides: object) -> TrainSettings:
    fields = {
        "mode": "online",
        "num_anchors": 8,
        "global_batch_size": 4,
        "eval_samples": 0,
        "spec_eval_prompts": 0,
        "checkpoint_every_minutes": None,
        "max_steps": 2,
    }
    return TrainSettings(**{**fields, **overrides})


@pytest.mark.parametrize(("arch", "loss"), [("dflash", "decay"), ("dflash", "dpace"), ("dflash2", "dpace")])
def test_the_loss_reads_nothing_of_the_device_on_the_host_and_returns_its_figures_as_tensors(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], arch: str, loss: str
) -> None:
    torch.manual_seed(0)
    config = DrafterConfig(**{**config.__dict__, "arch": arch, "selector_rank": 16})
    drafter = DFlashDrafter.from_target(config)
    batch = collate_tokenized_samples(samples[:3], 256, capture, config)
    batch.loss_mask[2, 20:] = False  # a row with fewer labels: dropped blocks, unlabelled slots
    anchors = sample_anchors(batch.loss_mask, 8, [anchor_generator(0, 0, i) for i in batch.sample_indices])
    with HostReads([batch.hidden_states], [drafter]) as reads:
        output = dflash_loss(drafter, batch, anchors, Objective(loss=loss))
        output.weighted_ce.backward()
    assert reads.reads == [], reads.where
    figures = (output.weighted_ce_sum, output.weight_sum, output.accepted_sum, output.correct, output.ce_sum,
               output.expected_accepted_sum, output.selector_ce_sum, output.selector_recall)  # fmt: skip
    for figure in figures:
        assert isinstance(figure, torch.Tensor) and figure.device == drafter.device
    assert output.num_blocks == int(anchors.keep.sum())  # the anchors are the host's own


def test_a_training_step_reads_the_device_once_where_its_figures_are_summed(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    # Two micro-batches of two sequences a step: one that only adds to the gradients, one that reduces them.
    two_sequences = estimate_step_bytes(config, 2, max(s.num_tokens for s in samples), 8)
    trainer = DrafterTrainer(
        config,
        _settings(micro_batch_bytes=two_sequences),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="syncs",
        work_dir=tmp_path / "work",
    )
    trainer.resume()
    plan = trainer.plan(0)
    trainer.train_step(0, plan[0], list(trainer.source.iterate(plan[0])))  # builds the reduction
    with HostReads(modules=[trainer.model]) as reads:
        stats, grad_norm = trainer.train_step(0, plan[1], list(trainer.source.iterate(plan[1])))
    assert reads.reads == ["cpu"], (
        reads.where
    )  # the packed figures with the gradient norm: one copy, one wait
    assert (stats.sequences, stats.micro_batches) == (4, 2)
    assert grad_norm is not None and stats.loss is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's sync debug mode)")
def test_on_cuda_a_micro_batch_s_loss_and_backward_make_no_synchronising_call(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample]
) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config).cuda()
    batch = collate_tokenized_samples(samples[:3], 256, capture, config)
    batch.hidden_states = batch.hidden_states.pin_memory()
    anchors = sample_anchors(batch.loss_mask, 8, [anchor_generator(0, 0, i) for i in batch.sample_indices])
    dflash_loss(drafter, batch, anchors, Objective()).weighted_ce.backward()  # allocations settle first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = dflash_loss(drafter, batch, anchors, Objective())
        output.weighted_ce.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(output.loss)
