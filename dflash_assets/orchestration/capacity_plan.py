"""The capacity plan on this deployment's settings and resources: what `dflash-assets plan` prints and
what `tokenized_completions` records on each range (the core is `planning/`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflash_assets import settings
from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.storage.units import human_bytes


def build_plan(
    *,
    store: StoreResource,
    dataset: DatasetResource,
    target_model: TargetModelResource,
    devices: int | None = None,
    device_name: str | None = None,
    device_memory_gib: float | None = None,
    sample_rows: int = 5000,
    train_tokens_per_s: float | None = None,
    mfu: float | None = None,
    gpu_result: str | Path | None = None,
    known: dict[str, Sequence[Any]] | None = None,
    tokenize: bool = True,
    log: Callable[[str], None] = lambda message: None,
):
    """A `CapacityPlan` for the configured dataset, target and settings (see `planning/capacity.py`)."""
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.extraction.object_size import check_hidden_state_dtype
    from dflash_assets.planning.capacity import PlanSettings, plan_capacity
    from dflash_assets.planning.gpu_result import gpu_result_path, load_gpu_result
    from dflash_assets.planning.inputs import device_profile, target_facts
    from dflash_assets.planning.memory import stage_memory
    from dflash_assets.planning.workload import build_workload
    from dflash_assets.storage.store import StoreError

    dtype = check_hidden_state_dtype(settings.HIDDEN_STATE_DTYPE.get())
    try:
        object_store = store.check()
    except StoreError as error:  # the plan still works from the dataset alone
        log(f"the store is unreachable ({error}); planning from the dataset alone")
        object_store = None
    from dflash_assets.orchestration.partitions import dataset_row_count

    workload = build_workload(
        dataset_uri=dataset.uri(),
        rows=dataset_row_count(dataset.uri()),  # counted once per version of the file
        samples_per_partition=settings.samples_per_partition(),
        max_length=settings.MAX_LENGTH.get_int(),
        tokenizer=target_model.load_tokenizer() if tokenize else None,
        store=object_store,
        known=known,
        sample_rows=sample_rows,
        cache_dir=settings.cache_dir(),
        log=log,
    )
    model_dir, layer_ids = target_model.model_dir(), target_model.layer_ids()
    facts = target_facts(model_dir, target_model.name, layer_ids, workload.lengths, settings.cache_dir())
    measured = load_gpu_result(gpu_result or gpu_result_path(settings.cache_dir()))
    configured = settings.devices()
    profile = device_profile(
        device_name=device_name,
        device_memory_bytes=int(device_memory_gib * 2**30) if device_memory_gib else None,
        gpu_result=measured,
        configured_devices=configured,
        stated_peak_flops=settings.peak_flops(),
    )
    count = devices or len(configured) or _cuda_count() or 1
    plan_settings = PlanSettings(
        hidden_state_dtype=dtype,
        max_tokens_per_batch=settings.MAX_TOKENS_PER_BATCH.get_int(),
        staging_max_bytes=store.staging_budget_bytes(),
        staging_dir=store.staging_root(),
        store_url=store.store_url(),
        devices=count,
    )
    if mfu:
        plan_settings.mfu = mfu
    if train_tokens_per_s:
        plan_settings.train_tokens_per_s = train_tokens_per_s
        plan_settings.train_tokens_per_s_source = "given (--train-tokens-per-s)"
    drafter = DrafterConfig.from_target(
        model_dir,
        num_layers=target_model.draft_layers(),
        target_layer_ids=layer_ids,
        shape=settings.DRAFTER_SHAPE.get(),
    )
    stages = stage_memory(
        target=facts,
        device=profile,
        drafter=drafter,
        hidden_state_dtype=dtype,
        max_tokens_per_batch=plan_settings.max_tokens_per_batch,
        # The longest sample decides a micro-batch's, a decode's and a generation's length.
        max_length=min(settings.MAX_LENGTH.get_int(), max(workload.lengths, default=1)),
    )
    return plan_capacity(workload, facts, profile, plan_settings, stages, measured)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _hours(value: float | None) -> str:
    if value is None:
        return "unknown"
    if value < 1 / 60:
        return f"{value * 3600:.1f} s"
    return f"{value * 60:.1f} min" if value < 1 else f"{value:,.1f} h"


def _rate(value: float | None) -> str:
    return "unknown" if value is None else f"{human_bytes(value)}/s"


def format_plan(plan) -> str:
    """The plan as the table `dflash-assets plan` prints."""
    f = plan.figures
    lengths, estimate, hours = f["token_lengths"], f["estimate"], f["extraction_hours"]
    training = f["offline_training"]
    dtype, other = f["hidden_state_dtype"], "fp8" if f["hidden_state_dtype"] == "bf16" else "bf16"
    error = "" if estimate["exact"] else f"  (±{estimate['relative_error_95']:.1%} at 95 %)"
    how = (
        "exact: every range tokenized"
        if estimate["exact"]
        else f"{estimate['estimated_rows']:,} rows extrapolated from a random sample of "
        f"{estimate['sampled_rows']:,}"
        if estimate["sampled_rows"]
        else f"{estimate['estimated_rows']:,} rows extrapolated from the tokenized ranges"
    )
    rows = [
        (
            "dataset",
            f"{f['dataset']}: {f['rows']:,} rows in {f['ranges']} ranges of {f['samples_per_partition']:,}",
        ),
        ("workload", how),
        ("samples", f"{f['samples']:,}{error}"),
        ("tokens", f"{f['tokens']:,}{error}"),
        (
            "tokens per sample",
            f"mean {lengths['mean']:,.0f}, p50 {lengths['p50']:,.0f}, p99 {lengths['p99']:,.0f}, max "
            f"{lengths['max']:,}; {lengths['truncated']:,} truncated at {lengths['max_length']:,}",
        ),
        (
            "target",
            f"{f['target']['name']}: layers {f['target']['layer_ids']}, hidden "
            f"{f['target']['hidden_size']:,}",
        ),
        (
            "bytes per token",
            f"{f['bytes_per_token']:,} in {dtype} ({f['bytes_per_token_by_dtype'][other]:,} in {other})",
        ),
        (
            "hidden states in the store",
            f"{human_bytes(f['hidden_state_bytes'])} in {dtype} "
            f"({human_bytes(f['hidden_state_bytes_by_dtype'][other])} in {other}); {f['objects']:,} objects",
        ),
        (
            "per range",
            f"{f['objects_per_range']['mean']:,.0f} objects, {human_bytes(f['bytes_per_range']['mean'])} on "
            f"average (largest {human_bytes(f['bytes_per_range']['max'])})",
        ),
        (
            "staging",
            f"{human_bytes(f['staging_bytes_needed'])} for one batch of a range; budget "
            f"{human_bytes(f['staging_budget_bytes'])} (DFLASH_STAGING_MAX_BYTES)",
        ),
        (
            "extraction",
            f"{_hours(hours['devices_1'])} on 1 device, {_hours(hours['devices_n'])} on {hours['devices']}; "
            f"{hours['tokens_per_s_per_device'] or 0:,.0f} tokens/s per device, padding "
            f"{f['padding_fraction']:.1%}",
        ),
        ("", f"from {hours['source']}"),
        ("upload to keep up", _rate(f["upload_bytes_per_s_needed"])),
        (
            "offline training reads",
            f"{_rate(f['offline_read_bytes_per_s'])} at {training['tokens_per_s']:,.0f} tokens/s "
            f"({training['source']}); {human_bytes(training['bytes_read'])} over {training['epochs']} epochs",
        ),
        (
            "S3 requests",
            ", ".join(f"{name.replace('_', ' ')} {count:,}" for name, count in f["s3_requests"].items()),
        ),
        (
            "device",
            f"{f['device']['name']}: {human_bytes(f['device']['total_memory_bytes'])} "
            f"({f['device']['source']})",
        ),
    ]
    for stage, memory in f["device_memory"].items():
        rows.append(
            (f"  {stage}", f"{human_bytes(memory['bytes'])}" + ("" if memory["fits"] else "  DOES NOT FIT"))
        )
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"note: {note}" for note in estimate["notes"]]
    lines += [f"WARNING: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def range_plan_metadata(
    samples: Sequence[Any],
    partition: str,
    *,
    store: StoreResource,
    dataset: DatasetResource,
    target_model: TargetModelResource,
    warn: Callable[[str], None],
) -> dict[str, Any]:
    """Metadata for a `tokenized_completions` range: its own hidden-state bytes, and the whole run's
    totals planned from this range and the ranges already in the store (nothing else is tokenized).
    Never fails the asset: a plan that cannot be made is one text entry and a warning."""
    try:
        plan = build_plan(
            store=store,
            dataset=dataset,
            target_model=target_model,
            known={partition: samples},
            tokenize=False,
        )
    except Exception as error:  # the range is the asset's job; the plan is only a report on it
        warn(f"no capacity plan for {partition}: {error}")
        return {"plan": f"unavailable: {error}"}
    f = plan.figures
    here = next(entry for entry in f["per_range"] if entry["partition"] == partition)
    metadata: dict[str, Any] = {
        "plan_hidden_state_dtype": f["hidden_state_dtype"],
        "plan_range_hidden_state_bytes": here["hidden_state_bytes"],
        **{f"plan_range_hidden_state_bytes_{d}": n for d, n in here["hidden_state_bytes_by_dtype"].items()},
        "plan_run_samples": f["samples"],
        "plan_run_tokens": f["tokens"],
        "plan_run_hidden_state_bytes": f["hidden_state_bytes"],
        **{f"plan_run_hidden_state_bytes_{d}": n for d, n in f["hidden_state_bytes_by_dtype"].items()},
        "plan_run_ranges_estimated": sum(entry["source"] == "estimated" for entry in f["per_range"]),
        "plan_staging_bytes_needed": f["staging_bytes_needed"],
        "plan_devices": f["extraction_hours"]["devices"],
        "plan_offline_read_bytes_per_s": float(f["offline_read_bytes_per_s"]),
        "plan_warnings": "\n".join(plan.warnings) or "none",
    }
    hours = f["extraction_hours"]
    optional = {
        "plan_run_extraction_hours_1_device": hours["devices_1"],
        "plan_run_extraction_hours_all_devices": hours["devices_n"],
        "plan_upload_bytes_per_s_needed": f["upload_bytes_per_s_needed"],
    }
    metadata.update({name: float(value) for name, value in optional.items() if value is not None})
    return metadata


def plan_environment_note() -> str:
    """What the plan was made for, in one line (settings that shape it)."""
    return ", ".join(
        f"{s.name}={s.get() or '(default)'}"
        for s in (settings.DATASET, settings.TARGET_MODEL, settings.HIDDEN_STATE_DTYPE, settings.MAX_LENGTH)
    )
