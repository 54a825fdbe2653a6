"""The capacity plan: what a run will take before it takes it. Bytes in the store per stored dtype,
staging, extraction hours, bandwidths, S3 requests and device memory per stage, with warnings that
name the setting to change.

Byte counts are exact in structure: each object is `object_size.sample_object_nbytes` (the writer's own
header and tensors) of its sample, so where every sample's length is known the total is the store's to
the byte. Where it is not (ranges estimated from a sample of rows) the totals carry the sample's 95 %
interval. Hours come from `bench --gpu`'s saved measurement where there is one, scaled to this target
by model FLOPs per token; otherwise from FLOPs per token at a stated MFU of the device's peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_assets.extraction.object_size import (
    HIDDEN_STATE_DTYPE_SETTING,
    HIDDEN_STATE_DTYPES,
    bytes_per_token,
    estimate_sample_nbytes,
    sample_object_nbytes,
)
from dflash_assets.planning.workload import RangeWorkload, Workload
from dflash_assets.storage.s3_store import S3Settings
from dflash_assets.storage.units import human_bytes
from dflash_assets.target.batching import padding_fraction, plan_batches

# S3 transfers of this size or more go in parts of this size (`S3Settings` defaults); smaller objects
# are one PUT and one GET.
MULTIPART_BYTES = S3Settings().multipart_threshold_bytes
MULTIPART_CHUNK_BYTES = S3Settings().multipart_chunk_bytes
LIST_PAGE = 1000
STATED_MFU = 0.40  # extraction with writes, when nothing measured says otherwise
# The seeds' measured offline training rate on one GPU (BRIEF.md): the default read-bandwidth basis.
SEED_TRAIN_TOKENS_PER_S = 25_100.0
# Data-sheet devices the plan knows by name: dense bf16 peak and memory.
DEVICE_PROFILES = {
    "H200": (989e12, 141 * 10**9),
    "H100": (989e12, 80 * 10**9),
    "H800": (989e12, 80 * 10**9),
    "A100": (312e12, 80 * 10**9),
    "L40S": (362e12, 48 * 10**9),
}
STATED_CPU_PEAK = 0.2e12  # float32, a few cores; DFLASH_PEAK_TFLOPS overrides


@dataclass(frozen=True)
class TargetFacts:
    """What the plan needs of the target, read from its directory (nothing loaded)."""

    model_dir: Path
    name: str  # the identity written into every object (`TargetModelResource.name`)
    layer_ids: list[int]
    hidden_size: int
    model_type: str
    flops_per_token: float  # model FLOPs per real token of a forward through the last layer it needs
    weight_bytes_bf16: int
    final_state: bool = False  # objects hold the final state too: one more layer's bytes, every layer run
    num_layers: int = 0  # the target's decoder layers (0: unknown)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str  # "cuda" or "cpu"
    total_memory_bytes: int
    peak_flops: float | None
    source: str  # where the figures come from, for the report


@dataclass
class PlanSettings:
    hidden_state_dtype: str
    max_tokens_per_batch: int
    staging_max_bytes: int
    staging_dir: Path
    store_url: str
    devices: int
    max_batch_size: int = 64
    mfu: float = STATED_MFU
    train_tokens_per_s: float = SEED_TRAIN_TOKENS_PER_S
    train_tokens_per_s_source: str = "the seeds' measured 25.1 K tokens/s on one GPU (--train-tokens-per-s)"
    epochs: int = 6
    generation_batch: int = 64  # sequences regenerated at once in-process (a server manages its own)


@dataclass
class CapacityPlan:
    """The figures and the warnings; `as_dict` is `plan --json`, `format_table` the printed table."""

    figures: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    training_split: Any = None  # `training_split.TrainingSplit`, set by whoever plans one

    def as_dict(self) -> dict[str, Any]:
        return {**self.figures, "warnings": list(self.warnings)}


# ------------------------------------------------------------------------------------------ bytes


@functools.lru_cache(maxsize=65536)
def _header_bytes(
    index_digits: int,
    num_tokens: int,
    layers: tuple[int, ...],
    hidden: int,
    name: str,
    dtype: str,
    final_state: bool = False,
):
    """Header bytes of an object: they depend on the index only through its digit count."""
    index = 10 ** (index_digits - 1) if index_digits > 1 else 0
    size = sample_object_nbytes(
        sample_index=index,
        num_tokens=num_tokens,
        target_layer_ids=list(layers),
        target_model=name,
        hidden_size=hidden,
        dtype=dtype,
        final_state=final_state,
    )
    return size - num_tokens * bytes_per_token(len(layers), hidden, dtype, final_state)


def target_bytes_per_token(target: TargetFacts, dtype: str) -> int:
    """Stored bytes per token of the target's objects in `dtype`, the final state included when stored."""
    return bytes_per_token(len(target.layer_ids), target.hidden_size, dtype, target.final_state)


def range_object_bytes(workload: RangeWorkload, target: TargetFacts, dtype: str) -> float:
    """The range's objects in the store: exact per sample where lengths are known, else its sample count
    times a representative header plus its tokens times the bytes per token."""
    layers, per_token = tuple(target.layer_ids), target_bytes_per_token(target, dtype)
    header = functools.partial(
        _header_bytes,
        layers=layers,
        hidden=target.hidden_size,
        name=target.name,
        dtype=dtype,
        final_state=target.final_state,
    )
    if workload.lengths is not None and workload.sample_indices is not None:
        return sum(
            header(len(str(index)), n) + n * per_token
            for index, n in zip(workload.sample_indices, workload.lengths, strict=True)
        )
    if not workload.samples:
        return 0.0
    start = int(workload.partition[:8])
    mean_tokens = max(1, round(workload.tokens / workload.samples))
    return (
        workload.samples * header(len(str(start + workload.rows // 2)), mean_tokens)
        + workload.tokens * per_token
    )


def staging_bytes_needed(lengths: list[int], target: TargetFacts, settings: PlanSettings) -> int:
    """What the staging budget must hold for one batch of a range: every sample's reservation."""
    if not lengths:
        return 0
    batches = plan_batches(lengths, settings.max_tokens_per_batch, settings.max_batch_size)
    name_bytes = len(target.name.encode())
    shape = (len(target.layer_ids), target.hidden_size)
    dtype = settings.hidden_state_dtype
    reserve = [estimate_sample_nbytes(n, *shape, name_bytes, dtype, target.final_state) for n in lengths]
    return max(sum(reserve[i] for i in batch) for batch in batches)


# ------------------------------------------------------------------------------------------ hours


def extraction_rate(
    target: TargetFacts, device: DeviceProfile, settings: PlanSettings, gpu_result: dict[str, Any] | None
) -> tuple[float | None, str]:
    """(tokens/s of one device extracting with writes, where the figure comes from)."""
    variant = "extraction_fp8" if settings.hidden_state_dtype == "fp8" else "extraction"
    return forward_rate(target, device, gpu_result, variant, settings.mfu)


def forward_rate(
    target: TargetFacts,
    device: DeviceProfile,
    gpu_result: dict[str, Any] | None,
    variant: str,
    mfu: float = STATED_MFU,
) -> tuple[float | None, str]:
    """(tokens/s of one device running the target's `variant` of `bench --gpu`: `extraction` with
    writes, `forward` alone as online training runs it, ...; where the figure comes from): the saved
    measurement scaled to this target by FLOPs per token, or its MFU on another device, else FLOPs per
    token at a stated MFU of the device's peak."""
    entries = list((gpu_result or {}).get("targets") or [])
    entries = [e for e in entries if e.get("model_type") == target.model_type] or entries
    entries = [e for e in entries if (e.get("tokens_per_s") or {}).get(variant)]
    if entries:
        entry = entries[0]
        measured_on = (
            f"`dflash-assets bench --gpu` on {gpu_result['device']} ({gpu_result.get('measured_at', '')})"
        )
        if gpu_result["device"] == device.name:
            measured = entry["tokens_per_s"][variant]
            rate = measured * entry["flops_per_token"][variant] / target.flops_per_token
            return rate, (
                f"{measured_on}: {entry['shape']} at {measured:,.0f} tokens/s ({variant}), scaled to this "
                "target by FLOPs per token"
            )
        measured_mfu = (entry.get("mfu") or {}).get(variant)
        if measured_mfu and device.peak_flops:
            return measured_mfu * device.peak_flops / target.flops_per_token, (
                f"{measured_on}: {entry['shape']} at {measured_mfu:.1%} MFU ({variant}), applied to "
                f"{device.name}'s peak"
            )
    peak = device.peak_flops
    if peak is None:
        return (
            None,
            f"no peak known for {device.name}: set DFLASH_PEAK_TFLOPS or run `dflash-assets bench --gpu`",
        )
    return mfu * peak / target.flops_per_token, (
        f"{target.flops_per_token:.3g} FLOPs per token at a stated {mfu:.0%} MFU of {device.name}'s "
        f"{peak / 1e12:,.1f} TFLOP/s ({device.source}); `dflash-assets bench --gpu` measures it"
    )


# ------------------------------------------------------------------------------------------ the plan


def _quantile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return 0.0
    position = q * (len(sorted_values) - 1)
    low, high = math.floor(position), math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _s3_requests(ranges: list[dict[str, Any]], epochs: int) -> dict[str, int]:
    """Requests a run makes of the store. An upload is confirmed by the PUT's own answer and a download
    knows its size from the manifest, so neither costs a HEAD; offline training reads every object once
    an epoch (less what the node's cache keeps, a small share at this scale)."""
    puts = lists = gets = 0
    for entry in ranges:
        objects = math.ceil(entry["objects"])
        if not objects:
            continue
        mean = entry["hidden_state_bytes"] / objects
        # Multipart: create, the parts, complete.
        per_object = 1 if mean < MULTIPART_BYTES else math.ceil(mean / MULTIPART_CHUNK_BYTES) + 2
        puts += objects * per_object + 2  # + the fingerprint and the manifest
        lists += 3 * math.ceil(objects / LIST_PAGE)  # claim, verify, commit
        gets += objects * (1 if mean < MULTIPART_BYTES else math.ceil(mean / MULTIPART_CHUNK_BYTES))
    return {
        "extraction_put": puts,
        "extraction_list": lists,
        "training_get_per_epoch": gets,
        "training_get": gets * epochs,
    }


def plan_capacity(
    workload: Workload,
    target: TargetFacts,
    device: DeviceProfile,
    settings: PlanSettings,
    memory_stages: dict[str, int],
    gpu_result: dict[str, Any] | None = None,
) -> CapacityPlan:
    """Every figure of the plan (see the module docstring); `memory_stages` from `planning.memory`."""
    dtype = settings.hidden_state_dtype
    layers, hidden = len(target.layer_ids), target.hidden_size
    ranges = []
    for r in workload.ranges:
        by_dtype = {d: range_object_bytes(r, target, d) for d in HIDDEN_STATE_DTYPES}
        ranges.append(
            {
                "partition": r.partition,
                "rows": r.rows,
                "samples": round(r.samples, 1),
                "objects": round(r.samples, 1),
                "tokens": round(r.tokens),
                "hidden_state_bytes": round(by_dtype[dtype]),
                "hidden_state_bytes_by_dtype": {d: round(b) for d, b in by_dtype.items()},
                "source": r.source,
            }
        )
    total_by_dtype = {
        d: sum(entry["hidden_state_bytes_by_dtype"][d] for entry in ranges) for d in HIDDEN_STATE_DTYPES
    }
    samples, tokens = workload.samples, workload.tokens
    relative_error = workload.relative_error_95

    lengths = sorted(workload.lengths)
    # One batch of a range: over each range whose lengths are known, and over the sample's lengths.
    groups = [r.lengths for r in workload.ranges if r.lengths] + [workload.sample_lengths]
    staging = max(staging_bytes_needed(group, target, settings) for group in groups)
    known = workload.lengths
    padding = padding_fraction(
        plan_batches(known, settings.max_tokens_per_batch, settings.max_batch_size), known
    )

    rate, rate_source = extraction_rate(target, device, settings, gpu_result)
    computed_tokens = tokens / (1 - padding) if padding < 1 else tokens
    parallel = max(1, min(settings.devices, len(workload.ranges)))
    hours_one = computed_tokens / rate / 3600 if rate else None
    hours_all = hours_one / parallel if hours_one is not None else None
    hours_by_dtype = {}  # on all the devices, each dtype's own rate (fp8 quantises on the device)
    for other in HIDDEN_STATE_DTYPES:
        other_settings = dataclasses.replace(settings, hidden_state_dtype=other)
        other_rate, _ = extraction_rate(target, device, other_settings, gpu_result)
        hours_by_dtype[other] = computed_tokens / other_rate / 3600 / parallel if other_rate else None
    bytes_now = total_by_dtype[dtype]
    upload = bytes_now / (hours_all * 3600) if hours_all else None
    read = settings.train_tokens_per_s * bytes_now / tokens if tokens else 0.0
    per_range_bytes = [entry["hidden_state_bytes"] for entry in ranges]
    per_range_objects = [entry["objects"] for entry in ranges]

    figures: dict[str, Any] = {
        "dataset": workload.dataset,
        "rows": workload.rows,
        "ranges": len(ranges),
        "samples_per_partition": workload.samples_per_partition,
        "samples": round(samples),
        "tokens": round(tokens),
        "token_lengths": {
            "mean": tokens / samples if samples else 0.0,
            "p50": _quantile(lengths, 0.50),
            "p99": _quantile(lengths, 0.99),
            "max": lengths[-1] if lengths else 0,
            "truncated": round(workload.truncated),
            "max_length": workload.max_length,
            "from_samples": len(lengths),
        },
        "estimate": {
            "exact": workload.exact,
            "sampled_rows": workload.sampled_rows,
            "estimated_rows": workload.estimated_rows,
            "relative_error_95": relative_error,
            "notes": workload.notes,
            "given": workload.given,
        },
        "target": {"name": target.name, "layer_ids": target.layer_ids, "hidden_size": hidden},
        "hidden_state_dtype": dtype,
        "bytes_per_token": target_bytes_per_token(target, dtype),
        "bytes_per_token_by_dtype": {d: target_bytes_per_token(target, d) for d in HIDDEN_STATE_DTYPES},
        "final_state": {
            "stored": target.final_state,
            # What the final state adds: one more layer's bytes a token, and the layers after the last tap.
            "bytes_per_token": target_bytes_per_token(target, dtype) - bytes_per_token(layers, hidden, dtype),
            "forward_layers": target.num_layers if target.final_state else max(target.layer_ids) + 1,
            "forward_layers_without": max(target.layer_ids) + 1,
        },
        "hidden_state_bytes": bytes_now,
        "hidden_state_bytes_by_dtype": total_by_dtype,
        "objects": round(samples),
        "objects_per_range": {"mean": _mean(per_range_objects), "max": max(per_range_objects, default=0)},
        "bytes_per_range": {"mean": _mean(per_range_bytes), "max": max(per_range_bytes, default=0)},
        "staging_bytes_needed": staging,
        "staging_budget_bytes": settings.staging_max_bytes,
        "padding_fraction": padding,
        "extraction_hours": {
            "devices_1": hours_one,
            "devices_n": hours_all,
            "devices": parallel,
            "tokens_per_s_per_device": rate,
            "computed_tokens": round(computed_tokens),
            "source": rate_source,
            "devices_n_by_dtype": hours_by_dtype,
        },
        "upload_bytes_per_s_needed": upload,
        "offline_read_bytes_per_s": read,
        "offline_training": {
            "tokens_per_s": settings.train_tokens_per_s,  # one rank's
            "source": settings.train_tokens_per_s_source,
            "epochs": settings.epochs,
            "bytes_read": bytes_now * settings.epochs,
            "bytes_per_token": bytes_now / tokens if tokens else 0.0,  # as stored, headers included
        },
        "s3_requests": _s3_requests(ranges, settings.epochs),
        "device": {
            "name": device.name,
            "kind": device.kind,
            "total_memory_bytes": device.total_memory_bytes,
            "peak_flops": device.peak_flops,
            "source": device.source,
        },
        "device_memory": {
            stage: {"bytes": nbytes, "fits": nbytes <= device.total_memory_bytes}
            for stage, nbytes in memory_stages.items()
        },
        "per_range": ranges,
    }
    plan = CapacityPlan(figures)
    plan.warnings = [*workload.warnings, *_warnings(figures, settings, target)]
    return plan


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _free_disk(path: Path) -> int | None:
    """Free bytes on the filesystem that holds `path` (its nearest existing parent)."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


MEMORY_ADVICE = {
    "extraction": "lower DFLASH_MAX_TOKENS_PER_BATCH (activations scale with it) or use a larger device",
    "regeneration": "regenerate with fewer sequences at once or through a vLLM/SGLang server",
    "training": "lower DFLASH_MAX_LENGTH or the drafter_checkpoints run config `num_anchors`",
    "evaluation": (
        "the trainer will evaluate on another leased device, or move the optimiser state to the host, or "
        "skip the evaluation: add a device to DFLASH_DEVICES, or set the drafter_checkpoints run config "
        "`spec_eval_prompts: 0`"
    ),
}


def _warnings(figures: dict[str, Any], settings: PlanSettings, target: TargetFacts) -> list[str]:
    warnings = []
    dtype = settings.hidden_state_dtype
    total = figures["hidden_state_bytes"]
    if figures["staging_bytes_needed"] > settings.staging_max_bytes:
        warnings.append(
            f"DFLASH_STAGING_MAX_BYTES={settings.staging_max_bytes} is below one batch's objects "
            f"({human_bytes(figures['staging_bytes_needed'])}): extraction will wait for uploads inside "
            "every batch. Raise it to at least twice that, or lower DFLASH_MAX_TOKENS_PER_BATCH"
        )
    free_staging = _free_disk(settings.staging_dir)
    if free_staging is not None and settings.staging_max_bytes > free_staging:
        warnings.append(
            f"DFLASH_STAGING_MAX_BYTES={settings.staging_max_bytes} "
            f"({human_bytes(settings.staging_max_bytes)}) is more than the {human_bytes(free_staging)} free "
            f"where DFLASH_STAGING_DIR is "
            f"({settings.staging_dir}): lower it or move DFLASH_STAGING_DIR to a larger disk"
        )
    if not settings.store_url.startswith("s3://"):
        free_store = _free_disk(Path(settings.store_url))
        if free_store is not None and total > free_store:
            warnings.append(
                f"the local store (DFLASH_STORE_URL={settings.store_url}) has {human_bytes(free_store)} free "
                f"but the hidden states need {human_bytes(total)}: point DFLASH_STORE_URL at an s3:// bucket "
                "or a larger disk" + (f", or set {HIDDEN_STATE_DTYPE_SETTING}=fp8" if dtype == "bf16" else "")
            )
    if dtype == "bf16":
        fp8 = figures["hidden_state_bytes_by_dtype"]["fp8"]
        warnings.append(
            f"{HIDDEN_STATE_DTYPE_SETTING}=fp8 would store {human_bytes(fp8)} instead of "
            f"{human_bytes(total)} ({fp8 / total:.0%}; e4m3 with a scale per token and layer, fidelity "
            "measured in docs/benchmark.md)"
            if total
            else f"{HIDDEN_STATE_DTYPE_SETTING}=fp8 would halve the bytes"
        )
    for stage, memory in figures["device_memory"].items():
        if not memory["fits"]:
            warnings.append(
                f"{stage} needs ~{human_bytes(memory['bytes'])} of device memory, more than "
                f"{figures['device']['name']}'s {human_bytes(figures['device']['total_memory_bytes'])}: "
                f"{MEMORY_ADVICE[stage]}"
            )
    if figures["estimate"]["relative_error_95"] > 0.05:
        warnings.append(
            f"the totals are extrapolated from {figures['estimate']['sampled_rows']:,} sampled rows, "
            f"±{figures['estimate']['relative_error_95']:.1%} (95 %): `--sample-rows 0` tokenizes every row"
        )
    if figures["extraction_hours"]["devices_1"] is None:
        warnings.append(figures["extraction_hours"]["source"])
    return warnings
