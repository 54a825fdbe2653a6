"""Distillation from the target's own distribution: the final state captured and stored beside the layers,
the KL term the objective mixes in, a run that asks for it of objects without it, and two ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import Objective, anchor_generator, dflash_loss, sample_anchors
from dflash_assets.extraction.sample_format import read_sample
from dflash_assets.orchestration.training import check_final_states
from dflash_assets.settings import SettingError
from dflash_assets.storage.manifest import StoredPartition
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OfflineData, collate_hidden_state_samples
from dflash_assets.training.distributed import SingleProcess
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import DrafterTrainer
from dflash_assets_tests.support.drafter_fixtures import (
    load_capture,
    tiny_drafter_config,
    write_hidden_state_partition,
)
from dflash_assets_tests.support.ranks import run_ranks

PARTITION = "00000000-00000099"


@pytest.fixture(scope="module")
def final_capture(target_dir: Path):
    return load_capture(target_dir, final_state=True)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, target_dir, final_capture, samples) -> dict[str, Any]:
    """The twelve samples captured with the final state into a local store."""
    root = tmp_path_factory.mktemp("distill")
    store = open_store(str(root / "store"))
    objects = write_hidden_state_partition(
        store, PARTITION, samples, final_capture, str(target_dir), root / "x"
    )
    return {
        "root": str(root),
        "store": str(root / "store"),
        "objects": objects,
        "target_dir": str(target_dir),
        "num_tokens": [s.num_tokens for s in samples],
    }


def _batch(stored: dict[str, Any], count: int = 4):
    store = open_store(stored["store"])
    samples = [read_sample(store.get_bytes(key)) for key, _ in stored["objects"][:count]]
    return collate_hidden_state_samples(samples, 4096, final_state=True), samples


def test_the_stored_final_state_is_what_the_targets_lm_head_reads(stored, target, samples) -> None:
    batch, read = _batch(stored, 2)
    for row, sample in enumerate(read):
        with torch.no_grad():
            out = target(input_ids=sample.input_ids.long()[None], output_hidden_states=True)
        final = sample.final_dequantized(torch.float32)
        torch.testing.assert_close(final, out.hidden_states[-1][0].bfloat16().float(), atol=1e-3, rtol=2**-7)
        # The head on the stored state gives the target's own next-token choices.
        logits = final @ target.lm_head.weight.float().T
        assert (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.95
        n = sample.num_tokens
        assert torch.equal(batch.hidden_states[row, :n, -1], sample.final_hidden_states)
        assert torch.equal(batch.hidden_states[row, :n, :-1], sample.hidden_states)
    assert batch.final_state and batch.context_states(torch.device("cpu")).shape[2] == len(
        read[0].target_layer_ids
    )


def test_the_distillation_term_is_the_kl_from_the_targets_distribution_mixed_with_the_cross_entropy(
    stored, config
) -> None:
    batch, _ = _batch(stored)
    torch.manual_seed(0)
    model = DFlashDrafter.from_target(config).eval()
    generators = [anchor_generator(0, 0, index) for index in batch.sample_indices]
    anchors = sample_anchors(batch.loss_mask, 6, generators)
    weight = 0.3
    with torch.no_grad():
        plain = dflash_loss(model, batch, anchors, Objective(loss="decay"))
        mixed = dflash_loss(model, batch, anchors, Objective(loss="decay", distill_weight=weight))

    # By hand: every labelled slot's KL(target || drafter), the target's distribution being its head on its
    # final state at the position before the label, under the decay weights and their global sum.
    size = config.block_size
    states = batch.device_states(torch.device("cpu"))
    hidden = model(
        torch.where(
            torch.arange(size) == 0,
            batch.input_ids.gather(1, anchors.positions)[..., None],
            config.mask_token_id,
        ),
        anchors.positions[..., None] + torch.arange(size),
        states[:, :, :-1],
        torch.arange(batch.input_ids.shape[1]).expand(batch.input_ids.shape[0], -1),
        torch.where(anchors.keep, anchors.positions, 0),
    )
    numerator, kl_total, labels = 0.0, 0.0, 0
    for b in range(batch.input_ids.shape[0]):
        for n in range(anchors.positions.shape[1]):
            if not anchors.keep[b, n]:
                continue
            for j in range(1, size):
                position = int(anchors.positions[b, n]) + j
                if position >= int(batch.lengths[b]) or not batch.loss_mask[b, position]:
                    continue
                drafter_log_q = torch.log_softmax(model.logits(hidden[b, n, j]), -1)
                target_log_p = torch.log_softmax(model.logits(states[b, position - 1, -1]), -1)
                kl = float((target_log_p.exp() * (target_log_p - drafter_log_q)).sum())
                ce = float(-drafter_log_q[batch.input_ids[b, position]])
                numerator += torch.exp(torch.tensor(-(j - 1) / 7.0)).item() * (
                    (1 - weight) * ce + weight * kl
                )
                kl_total += kl
                labels += 1
    assert mixed.num_labels == labels > 10
    assert float(mixed.kl_sum) == pytest.approx(kl_total, rel=1e-4)
    assert float(mixed.weight_sum) == pytest.approx(float(plain.weight_sum))  # the normaliser: labels alone
    assert float(mixed.weighted_ce_sum) == pytest.approx(numerator, rel=1e-4)
    assert float(plain.kl_sum) == 0.0 and float(mixed.ce_sum) == pytest.approx(float(plain.ce_sum))


def test_distilling_from_objects_without_the_final_state_is_refused_before_any_step(
    tmp_path, target_dir, capture, samples
) -> None:
    store = open_store(str(tmp_path / "store"))
    write_hidden_state_partition(store, PARTITION, samples[:2], capture, str(target_dir), tmp_path / "x")
    old = StoredPartition(store, f"hidden-states/{PARTITION}", {"hidden_state_dtype": "bf16"})
    with pytest.raises(SettingError) as raised:
        check_final_states([old], 0.5)
    message = str(raised.value)
    assert "\n" not in message and PARTITION in message
    assert "DFLASH_DISTILL_WEIGHT=0.5" in message and "DFLASH_CAPTURE_FINAL_STATE=1" in message
    check_final_states([StoredPartition(store, "p", {"final_hidden_states": True})], 0.5)  # holds it: fine
    plain = [
        read_sample(store.get_bytes(f"hidden-states/{PARTITION}/{name}"))
        for name in ("hs_00000000.safetensors",)
    ]
    with pytest.raises(ValueError, match="DFLASH_CAPTURE_FINAL_STATE=1"):
        collate_hidden_state_samples(plain, 4096, final_state=True)


SETTINGS = {"mode": "offline", "lr": 3e-3, "num_anchors": 8, "global_batch_size": 4, "eval_samples": 2,
            "spec_eval_prompts": 0, "log_every_steps": 1, "checkpoint_every_minutes": None, "max_steps": 3,
            "device": "cpu", "distill_weight": 0.5}  # fmt: skip


def _train(collective: Any, setup: dict[str, Any]) -> dict[str, float]:
    node = Path(setup["root"]) / f"world-{collective.world_size}"
    data = OfflineData(open_store(setup["store"]), setup["objects"], node / f"cache-{collective.rank}",
                       num_tokens=setup["num_tokens"])  # fmt: skip
    world = {"world_size": collective.world_size, "nodes": ["node"] * collective.world_size,
             "devices": [f"cpu:{r}" for r in range(collective.world_size)],
             "target_devices": [[] for _ in range(collective.world_size)]}  # fmt: skip
    trainer = DrafterTrainer(
        tiny_drafter_config(Path(setup["target_dir"])), TrainSettings(**SETTINGS), data,
        store=open_store(str(node / "out")), run="distill", work_dir=node / "work",
        checkpoint_dir=node / "checkpoints", collective=collective, world=world,
    )  # fmt: skip
    result = trainer.train()
    weights = {name: float(t.double().sum()) for name, t in result.model.state_dict().items()}
    return {"weights": weights, "loss": result.final_loss}


@pytest.mark.slow  # ranks in processes of their own
def test_two_ranks_distilling_reach_one_process_s_weights(stored) -> None:
    alone = _train(SingleProcess(), stored)
    ranks = run_ranks(_train, 2, stored)
    assert all(isinstance(rank, dict) for rank in ranks), ranks
    for rank in ranks:
        assert rank["weights"] == pytest.approx(alone["weights"], rel=1e-4, abs=1e-5)
    assert alone["loss"] is not None and math.isfinite(alone["loss"])


def test_online_training_distils_from_the_live_targets_final_state(tmp_path, final_capture, config, samples):
    """Online, the target's replicas give the final state beside the layers: the same objective runs."""
    from dflash_assets.training.data import OnlineData
    from dflash_assets.training.train import train_drafter

    settings = TrainSettings(**{**SETTINGS, "mode": "online", "max_steps": 2})
    result = train_drafter(
        config, settings, OnlineData(samples, final_capture), store=open_store(str(tmp_path / "store")),
        run="online-distill", work_dir=tmp_path / "work",
    )  # fmt: skip
    assert result.steps == 2 and result.objective["distill_weight"] == 0.5
    assert result.final_loss is not None and math.isfinite(result.final_loss)
