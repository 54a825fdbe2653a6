"""The training split's arithmetic on made-up figures: which split of a node's devices between drafter ranks
and target replicas trains fastest, when co-location fits, when the drafter needs FSDP2, and where the
drafter's rate and FLOPs come from."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_assets.bench.drafter_step import TINY, build_drafter, random_batch, step_flops
from dflash_assets.planning.capacity import SEED_TRAIN_TOKENS_PER_S, DeviceProfile
from dflash_assets.planning.training_split import (
    NodeFigures,
    drafter_flops_per_token,
    drafter_rate,
    drafter_step_flops,
    evaluate_split,
    plan_training_split,
    seed_drafter_config,
    seed_flops_per_token,
)
from dflash_assets.training.memory import TrainingMemory

GB = 10**9
H200 = DeviceProfile("NVIDIA H200", "cuda", 141 * GB, 989e12, "test")


def _training(state_gb: float = 30, activations_gb: float = 10) -> TrainingMemory:
    """A drafter's training memory: `state_gb` of weights, gradients, AdamW state and frozen tensors."""
    unit = int(state_gb * GB / 20)
    return TrainingMemory(4 * unit, 4 * unit, 8 * unit, 4 * unit, int(activations_gb * GB))


def _figures(**overrides) -> NodeFigures:
    fields = dict(
        gpus_per_node=8,
        nodes=1,
        target_tokens_per_s=8_000.0,
        drafter_tokens_per_s=24_000.0,  # the drafter side is the bottleneck of 7 + 1: 7 x 8 K > 24 K
        device_memory_bytes=141 * GB,
        target_device_bytes=60 * GB,
        training=_training(),
        tokens_to_train=11e9,
    )
    return NodeFigures(**{**fields, **overrides})


def _shape(split) -> tuple[int, int]:
    return split.drafter_ranks, split.target_devices_per_rank


def test_when_the_drafter_is_the_bottleneck_seven_plus_one_waits_on_it_and_the_plan_finds_twice_that():
    plan = plan_training_split(_figures(), device_name="H200", stated=(1, 7), stated_from="the seeds")
    seven_plus_one = plan.stated
    assert _shape(seven_plus_one) == (1, 7) and seven_plus_one.bottleneck == "drafter"
    assert seven_plus_one.tokens_per_s == 24_000.0  # min(1 x 24 K, 7 x 8 K)
    assert seven_plus_one.days == pytest.approx(11e9 / 24_000 / 86400)
    # Co-located on every device: 8 / (1/8K + 1/24K) = 48 K, as fast as 2 ranks x 3 target devices
    # (min(2 x 24 K, 6 x 8 K)); without overlap the dedicated split would fall to 24 K, so co-location wins.
    best = plan.recommended
    assert _shape(best) == (8, 0) and best.fits and best.tokens_per_s == pytest.approx(48_000)
    two_plus_six = next(s for s in plan.alternatives if _shape(s) == (2, 3))
    assert two_plus_six.tokens_per_s == pytest.approx(48_000) and two_plus_six.gpus_per_node == 8
    assert two_plus_six.no_overlap_tokens_per_s == pytest.approx(24_000)
    assert best.tokens_per_s / seven_plus_one.tokens_per_s == pytest.approx(2.0)
    assert plan.strategy == "DDP" and not plan.warnings
    # Offline every device trains; two nodes train twice as fast.
    assert _shape(plan.offline) == (8, 0) and plan.offline.tokens_per_s == 8 * 24_000
    two_nodes = plan_training_split(_figures(nodes=2), device_name="H200")
    assert two_nodes.recommended.tokens_per_s == pytest.approx(2 * best.tokens_per_s)
    assert two_nodes.recommended.days == pytest.approx(best.days / 2)


def test_when_co_location_does_not_fit_a_device_the_plan_dedicates_target_devices():
    # 60 GB of target beside 90 GB of drafter training is more than 141 GB: no device can hold both.
    plan = plan_training_split(_figures(training=_training(60, 30)), device_name="H200", stated=(8, 0))
    assert all(not s.co_located for s in [plan.recommended, *plan.alternatives])
    assert _shape(plan.recommended) == (2, 3) and plan.recommended.fits
    assert plan.recommended.bytes_per_device == 90 * GB  # the drafter's device holds the most
    co_located = plan.stated  # what the user asked for is still shown, marked
    assert _shape(co_located) == (8, 0) and not co_located.fits
    assert "DOES NOT FIT" in co_located.summary()
    # Among splits as fast, fewer devices win: with k fixed at 1, 4 ranks use all 8 devices.
    fixed = plan_training_split(
        _figures(training=_training(60, 30)), device_name="H200", target_devices_per_rank=1
    )
    assert _shape(fixed.recommended) == (4, 1)
    # A target as fast as the drafter balances one target device per rank: 4 x (1 + 1), not 2 x (1 + 3).
    balanced = _figures(training=_training(60, 30), target_tokens_per_s=24_000.0)
    assert _shape(plan_training_split(balanced, device_name="H200").recommended) == (4, 1)


def test_a_drafter_whose_training_does_not_fit_one_device_needs_fsdp2_and_the_warning_says_what():
    too_big = _figures(training=_training(150, 10))
    plan = plan_training_split(too_big, device_name="H200")
    assert plan.strategy == "FSDP2 needed"
    (warning,) = plan.warnings
    assert "FSDP2" in warning and "float32 weights" in warning and "AdamW state" in warning
    assert "alone" in warning and "DFLASH_MAX_LENGTH" in warning
    activations = plan_training_split(_figures(training=_training(100, 40)), device_name="H200")
    assert activations.strategy == "FSDP2 needed" and "activations" in activations.warnings[0]
    assert evaluate_split(too_big, 1, 7).fits is False


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_drafter_flops_are_the_benchmarks_less_the_input_gradient_the_context_projection_never_gets(arch):
    model = build_drafter(TINY, torch.device("cpu"), arch)
    config = model.config
    batch = random_batch(TINY, 1, torch.device("cpu"))
    length, blocks = TINY.sequence_length, TINY.num_anchors
    labels = blocks * (config.block_size - 1)
    bench = step_flops(model, batch, blocks, labels)
    fc_input_gradient = 2 * length * config.num_context_layers * config.hidden_size * config.hidden_size
    assert drafter_step_flops(config, length, blocks) == pytest.approx(bench - fc_input_gradient, rel=1e-12)
    # Per token, short samples cost more (their 16-slot blocks are a larger share of them).
    assert drafter_flops_per_token(config, [100], 512, 3072) > drafter_flops_per_token(
        config, [3000], 512, 3072
    )
    # The seeds' drafter at their mean length: ~7e10 a token, more than the 27B target's ~4.8e10 forward.
    assert 6.5e10 < seed_flops_per_token() < 7.5e10


def test_the_drafter_rate_comes_from_a_measurement_then_the_seeds_then_a_stated_mfu():
    seed = seed_flops_per_token()
    rate, source = drafter_rate(seed, H200, None)
    assert rate == pytest.approx(SEED_TRAIN_TOKENS_PER_S) and "seeds" in source
    rate, _ = drafter_rate(2 * seed, H200, None)  # a drafter twice as costly a token trains half as fast
    assert rate == pytest.approx(SEED_TRAIN_TOKENS_PER_S / 2)
    measured = {
        "device": "NVIDIA H200",
        "drafter_step": {"shape": "x", "tokens_per_s": 10_000.0, "flops_per_token": 5e10, "mfu": 0.5},
    }
    rate, source = drafter_rate(1e11, H200, measured)
    assert rate == pytest.approx(5_000.0) and "bench --gpu" in source
    a100 = DeviceProfile("NVIDIA A100", "cuda", 80 * GB, 312e12, "test")
    rate, source = drafter_rate(1e11, a100, measured)
    assert rate == pytest.approx(0.5 * 312e12 / 1e11) and "MFU" in source
    cpu = DeviceProfile("CPU", "cpu", 24 * 2**30, 0.2e12, "test")
    rate, source = drafter_rate(1e9, cpu, None, mfu=0.4)
    assert rate == pytest.approx(0.4 * 0.2e12 / 1e9) and "stated 40% MFU" in source
    assert drafter_rate(1e9, cpu, None, given=123.0) == (123.0, "the rate given with --train-tokens-per-s")
    assert seed_drafter_config().layer_types[-1] == "full_attention"


def test_offline_trains_no_faster_than_the_store_carries_and_says_what_its_ranks_need():
    # 8 ranks at 24 K tokens/s of 50 KB tokens need 9.6 GB/s; a 2 GB/s store carries 40 K tokens/s.
    fed = plan_training_split(_figures(bytes_per_token=50_000.0, store_bytes_per_s=2e9), device_name="H200")
    assert fed.offline.tokens_per_s == 40_000 and fed.offline.bottleneck == "store"
    assert fed.offline.read_bytes_per_s_needed == pytest.approx(8 * 24_000 * 50_000)
    assert fed.offline.days == pytest.approx(11e9 / 40_000 / 86400)
    fast = plan_training_split(_figures(bytes_per_token=50_000.0, store_bytes_per_s=20e9), device_name="H200")
    assert fast.offline.tokens_per_s == 8 * 24_000 and fast.offline.bottleneck == "drafter"
    unknown = plan_training_split(_figures(bytes_per_token=50_000.0), device_name="H200").offline
    assert (
        unknown.tokens_per_s == 8 * 24_000
        and "needs 8.9 GiB/s from the store for 8 ranks" in unknown.read_note(1)
    )


def test_across_nodes_every_step_waits_for_the_all_reduce():
    # A step of 64 K tokens computed at 2 × 192 K tokens/s takes 1/6 s; an all-reduce of 1/3 s triples it.
    figures = _figures(nodes=2, step_tokens=64_000.0, allreduce_seconds=1 / 3)
    plan = plan_training_split(figures, device_name="H200")
    assert plan.offline.compute_tokens_per_s == 2 * 8 * 24_000
    assert plan.offline.tokens_per_s == pytest.approx(64_000 / (64_000 / 384_000 + 1 / 3))
    assert plan.recommended.tokens_per_s == pytest.approx(
        64_000 / (64_000 / plan.recommended.compute_tokens_per_s + 1 / 3)
    )


def test_the_choice_takes_the_fewest_days_then_the_fewest_bytes_and_never_an_unmeasured_store():
    from dflash_assets.planning.training_split import ModeOption, choose_mode, offline_split

    online = ModeOption("online", plan_training_split(_figures(), device_name="H200").recommended)
    measured = _figures(bytes_per_token=50_000.0, store_bytes_per_s=20e9)
    bf16 = ModeOption("offline in bf16", offline_split(measured), extraction_hours=10, stored_bytes=80e12)
    fp8 = ModeOption(
        "offline in fp8", offline_split(replace(measured, bytes_per_token=25_000.0)), 10, stored_bytes=40e12
    )
    best, _ = choose_mode([online, bf16, fp8], "bf16")
    assert best is fp8  # compute-bound either way: as fast as bf16, in half the bytes
    slower = ModeOption("offline in fp8", fp8.split, extraction_hours=30, stored_bytes=40e12)
    assert choose_mode([online, bf16, slower], "bf16")[0] is bf16  # 20 h more is not worth the bytes
    near = ModeOption("offline in fp8", fp8.split, extraction_hours=10.5, stored_bytes=40e12)
    best, why = choose_mode([online, bf16, near], "bf16")
    assert best is near and "fewer bytes" in why and "DFLASH_HIDDEN_STATE_DTYPE=fp8" in why  # within 5 %
    blind = ModeOption("offline in bf16", offline_split(replace(measured, store_bytes_per_s=None)), 10, 80e12)
    best, why = choose_mode([online, blind], "bf16")
    assert best is online and "only if the store delivers" in why
