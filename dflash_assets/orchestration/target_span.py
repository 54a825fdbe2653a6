"""How many of this host's devices the target spans: `DFLASH_TARGET_TP`, or with `auto` the plan's smallest
count that holds it: what the plan, the target split and online training read."""

from __future__ import annotations

from dflash_assets import settings
from dflash_assets.orchestration.resources import TargetModelResource


def online_target_span(target_model: TargetModelResource) -> int:
    """Devices each online target replica spans: `DFLASH_TARGET_TP`, or with `auto` the plan's smallest
    count that holds one replica on this host's device."""
    return settings.target_tp() or planned_target_tp(target_model, "online target")


def planned_target_tp(target_model: TargetModelResource, stage: str) -> int:
    """The plan's smallest count of this host's devices the target fits for `stage` (1 when none does: the
    stage then fails as it would on one device, and `dflash-assets plan` says why)."""
    from dflash_assets.planning.gpu_result import gpu_result_path, load_gpu_result
    from dflash_assets.planning.inputs import device_profile, target_facts
    from dflash_assets.planning.memory import target_split

    max_length = settings.MAX_LENGTH.get_int()
    facts = target_facts(
        target_model.model_dir(),
        target_model.name,
        target_model.layer_ids(),
        [max_length],
        settings.cache_dir(),
    )
    profile = device_profile(
        device_name=None,
        device_memory_bytes=None,
        gpu_result=load_gpu_result(gpu_result_path(settings.cache_dir())),
        configured_devices=settings.devices(),
        stated_peak_flops=settings.peak_flops(),
    )
    split = target_split(
        target=facts,
        device=profile,
        hidden_state_dtype=settings.HIDDEN_STATE_DTYPE.get(),
        max_tokens_per_batch=settings.MAX_TOKENS_PER_BATCH.get_int(),
        max_length=max_length,
        configured_tp=0,
    )
    return split.chosen({"capture": "extraction"}.get(stage, stage))
