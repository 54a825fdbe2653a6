"""What the plan reads off the target and the device it plans for, without loading either."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_assets.planning.capacity import DEVICE_PROFILES, STATED_CPU_PEAK, DeviceProfile, TargetFacts
from dflash_assets.target.flops import PEAK_SETTING, peak_flops_of, target_forward_shape
from dflash_assets.target.memory import host_total_bytes, parameter_count, target_config
from dflash_assets.target.model import hidden_size_of, num_decoder_layers

FLOPS_LENGTHS = 20_000  # sample lengths the attention term is averaged over


def target_facts(
    model_dir: Path,
    name: str,
    layer_ids: Sequence[int],
    lengths: Sequence[int],
    cache_dir: Path,
    final_state: bool = False,
) -> TargetFacts:
    """FLOPs per token of a forward through the last captured layer (every layer with `final_state`: the
    final state is after the last), counted on the target built on the meta device (exact for any
    architecture transformers builds; kept in `cache_dir`); from its parameter count when it cannot be
    built (2 FLOPs per weight of the layers run)."""
    config = target_config(model_dir)
    parameters = parameter_count(model_dir)
    sample = list(lengths)[:: max(1, len(lengths) // FLOPS_LENGTHS)] or [1]
    last = num_decoder_layers(config) - 1 if final_state else max(layer_ids)
    try:
        shape = target_forward_shape(model_dir, cache_dir)
        flops_per_token = shape.flops(sample, last, lm_head=False) / sum(sample)
    except Exception:  # an architecture transformers cannot build here: the parameter count will do
        share = (last + 1) / num_decoder_layers(config)
        flops_per_token = 2.0 * parameters * share
    return TargetFacts(
        model_dir=Path(model_dir),
        name=name,
        layer_ids=list(layer_ids),
        hidden_size=hidden_size_of(config),
        model_type=str(config.get("model_type", "")),
        flops_per_token=flops_per_token,
        weight_bytes_bf16=2 * parameters,
        final_state=final_state,
        num_layers=num_decoder_layers(config),
    )


def device_profile(
    *,
    device_name: str | None,
    device_memory_bytes: int | None,
    gpu_result: dict[str, Any] | None,
    configured_devices: Sequence[str],
    stated_peak_flops: float | None = None,
) -> DeviceProfile:
    """The device the plan is for, by precedence: `--device NAME`; the local CUDA device; the device of
    `bench --gpu`'s saved result; a CUDA device named in DFLASH_DEVICES (assumed an H200); else this
    machine's CPU. `device_memory_bytes` (`--device-memory-gib`) overrides the memory; `stated_peak_flops`
    (`DFLASH_PEAK_TFLOPS`) the peak."""
    profile = _profile(device_name, gpu_result, configured_devices, stated_peak_flops)
    if device_memory_bytes:
        profile = DeviceProfile(
            profile.name,
            profile.kind,
            device_memory_bytes,
            profile.peak_flops,
            profile.source + ", memory given",
        )
    return profile


def _named(name: str, source: str, stated: float | None) -> DeviceProfile:
    if name.lower() == "cpu":
        peak = stated or STATED_CPU_PEAK
        return DeviceProfile(
            "CPU", "cpu", host_total_bytes(), peak, f"{source}; peak stated (set {PEAK_SETTING})"
        )
    known = next((key for key in DEVICE_PROFILES if key in name.upper()), None)
    if known is None:
        raise ValueError(
            f"unknown device {name!r}: name one of {sorted(DEVICE_PROFILES)} or cpu, or give "
            f"--device-memory-gib and {PEAK_SETTING}"
        )
    peak, memory = DEVICE_PROFILES[known]
    peak = peak_flops_of(name, stated) or peak
    return DeviceProfile(name, "cuda", memory, peak, f"{source}, data-sheet figures")


def _profile(device_name, gpu_result, configured_devices, stated) -> DeviceProfile:
    if device_name:
        return _named(device_name, "--device", stated)
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory
        return DeviceProfile(name, "cuda", memory, peak_flops_of(name, stated), "this machine's cuda:0")
    if gpu_result and gpu_result.get("device") and gpu_result["device"] != "CPU":
        peak = gpu_result.get("peak_flops") or peak_flops_of(gpu_result["device"], stated)
        memory = int(gpu_result.get("total_memory_bytes") or 0)
        return DeviceProfile(gpu_result["device"], "cuda", memory, peak, "the saved `bench --gpu` result")
    if any(d.startswith("cuda") for d in configured_devices):
        return _named("H200", "DFLASH_DEVICES names CUDA devices, none visible here: assumed an H200", stated)
    return _named("cpu", "this machine's CPU (no GPU here; --device H200 plans for one)", stated)
