"""Offline training on fp8 hidden-state objects: the stored bytes travel to the training device and are
dequantised there, lengths are estimated from fp8 sizes, and a drafter learns from them as from bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import DrafterBatch, anchor_generator, dflash_loss, sample_anchors
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OfflineData, OfflineSource
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    load_capture,
    tiny_drafter_config,
    write_hidden_state_partition,
)

PARTITION = "00000000-00000099"


def _partition(tmp_path: Path, samples, capture, target_dir: Path, dtype: str):
    store = open_store(str(tmp_path / f"store-{dtype}"))
    objects = write_hidden_state_partition(
        store,
        PARTITION,
        samples,
        capture,
        str(target_dir),
        tmp_path / f"scratch-{dtype}",
        hidden_state_dtype=dtype,
    )
    return store, objects


def _settings(**overrides: object) -> TrainSettings:
    fields = dict(
        mode="offline",
        lr=3e-3,
        warmup_ratio=0.05,
        num_anchors=8,
        global_batch_size=4,
        eval_samples=2,
        spec_eval_prompts=0,
        log_every_steps=1,
        checkpoint_every_minutes=None,
    )
    return TrainSettings(**{**fields, **overrides})


def test_an_fp8_batch_stays_fp8_until_the_device_and_gives_the_loss_of_its_dequantised_states(
    config, capture, samples, target_dir, tmp_path
):
    store, objects = _partition(tmp_path, samples[:4], capture, target_dir, "fp8")
    data = OfflineData(store, objects, tmp_path / "cache")
    source = OfflineSource(data, config, _settings())
    source.setup_streams([])
    batch = source.collate(list(source.iterate(range(4))))
    assert batch.hidden_states.dtype == torch.float8_e4m3fn  # one byte a value crosses to the device
    assert batch.hidden_states_scale is not None and batch.hidden_states_scale.dtype == torch.float32
    states = batch.context_states(torch.device("cpu"))
    expected = batch.hidden_states.float() * batch.hidden_states_scale[..., None]
    assert states.dtype == torch.float32 and torch.equal(states, expected)
    assert bool((states[~batch.loss_mask & (batch.input_ids == 0)] == 0).all())  # padding stays zero

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config)
    anchors = sample_anchors(batch.loss_mask, 8, [anchor_generator(0, 0, i) for i in batch.sample_indices])
    dequantised = DrafterBatch(batch.input_ids, batch.loss_mask, states, batch.lengths, batch.sample_indices)
    with torch.no_grad():
        loss = dflash_loss(drafter, batch, anchors, 7.0).loss
        assert float(loss) == float(dflash_loss(drafter, dequantised, anchors, 7.0).loss)


def test_lengths_are_estimated_from_fp8_object_sizes_when_the_manifest_gives_none(
    config, capture, samples, target_dir, tmp_path
):
    store, objects = _partition(tmp_path, samples, capture, target_dir, "fp8")
    known = OfflineSource(
        OfflineData(store, objects, tmp_path / "c", hidden_state_dtypes=["fp8"] * 12), config, _settings()
    )
    assert known.lengths == pytest.approx([s.num_tokens for s in samples], abs=1)
    # Read as bf16 sizes, the same objects would look about half as long: the dtype matters.
    wrong = OfflineSource(OfflineData(store, objects, tmp_path / "c"), config, _settings())
    assert sum(wrong.lengths) < 0.7 * sum(s.num_tokens for s in samples)


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_a_drafter_trained_on_fp8_objects_learns_as_one_trained_on_bf16_objects_of_the_same_samples(
    config, capture, samples, target_dir, tmp_path
):
    results = {}
    for dtype in ("bf16", "fp8"):
        store, objects = _partition(tmp_path, samples, capture, target_dir, dtype)
        results[dtype] = train_drafter(
            config,
            _settings(epochs=6),
            OfflineData(
                store, objects, tmp_path / f"cache-{dtype}", hidden_state_dtypes=[dtype] * len(objects)
            ),
            store=store,
            run=dtype,
            work_dir=tmp_path / f"work-{dtype}",
        )
    bf16, fp8 = results["bf16"], results["fp8"]
    assert bf16.eval_sample_indices == fp8.eval_sample_indices
    # The plain cross-entropy: the weighted loss's scale moves with the objective's weights (D-PACE's
    # follow the drafter's own confidences), the cross-entropy of the same held-out labels does not.
    fresh = bf16.baseline["teacher_forced"]["ce"]
    assert fp8.eval["ce"] < fresh - 1.0  # it learned
    # fp8 keeps nearly all of bf16's gain over the fresh drafter on the same held-out samples.
    gain_bf16, gain_fp8 = fresh - bf16.eval["ce"], fresh - fp8.eval["ce"]
    print(f"held-out cross-entropy: fresh {fresh:.3f}, bf16 {bf16.eval['ce']:.3f}, fp8 {fp8.eval['ce']:.3f}")
    assert gain_fp8 > 0.9 * gain_bf16, (fresh, bf16.eval["ce"], fp8.eval["ce"])


@pytest.mark.slow  # two drafters trained until tau moves, each decoded with the target
def test_on_the_targets_own_completions_fp8_keeps_nearly_all_of_bf16s_measured_acceptance_gain(
    tmp_path, own_completions
):
    """The check the issue names: drafters trained offline on fp8 and on bf16 objects of the same samples
    (conversations whose assistant turns the target generated), for the same steps, each evaluated by
    speculative decoding with the target (the trainer loads it itself, as offline training does): fp8
    keeps nearly all of bf16's gain in measured tau."""
    target_dir, samples = own_completions
    config = tiny_drafter_config(target_dir)
    capture = load_capture(target_dir)
    settings = _settings(
        epochs=12,
        global_batch_size=8,
        num_anchors=16,
        eval_samples=6,
        spec_eval_prompts=6,
        spec_eval_max_new_tokens=24,
    )
    taus = {}
    for dtype in ("bf16", "fp8"):
        store, objects = _partition(tmp_path, samples, capture, target_dir, dtype)
        result = train_drafter(
            config,
            settings,
            OfflineData(
                store, objects, tmp_path / f"cache-{dtype}", hidden_state_dtypes=[dtype] * len(objects)
            ),
            store=store,
            run=dtype,
            work_dir=tmp_path / f"work-{dtype}",
        )
        assert result.speculative["mismatched"] == []
        taus[dtype] = result.acceptance_length_tau
        taus["fresh"] = result.baseline["speculative"]["tau"]
    print(f"measured tau: fresh {taus['fresh']:.3f}, bf16 {taus['bf16']:.3f}, fp8 {taus['fp8']:.3f}")
    gain_bf16, gain_fp8 = taus["bf16"] - taus["fresh"], taus["fp8"] - taus["fresh"]
    assert gain_bf16 > 0.5, taus  # the drafter learned from bf16 objects at all
    assert gain_fp8 >= 0.9 * gain_bf16, taus
