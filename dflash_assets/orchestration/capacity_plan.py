"""The capacity plan on this deployment's settings and resources: what `dflash-assets plan` prints and
what `tokenized_completions` records on each range (the core is `planning/`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflash_assets import settings
from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.orchestration.target_span import online_target_span, planned_target_tp
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
    gpus_per_node: int | None = None,
    nodes: int = 1,
    samples: int | None = None,
    mean_tokens: float | None = None,
    online_target_devices: int | None = None,
    num_anchors: int = 512,
    store_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    store_result: str | Path | None = None,
    log: Callable[[str], None] = lambda message: None,
):
    """A `CapacityPlan` for the configured dataset, target and settings (see `planning/capacity.py`), with
    the training split for `gpus_per_node` devices (default: this node's) on `nodes` nodes
    (`planning/training_split.py`). `samples` and `mean_tokens` override the workload's counts (with both,
    the dataset is not read). Offline training reads the store at `store_gbps` (GB/s), else at the rate
    `bench --only store` saved for this store (`store_result`), else at a rate the plan says it needs;
    across nodes each step waits for the gradient all-reduce over `inter_node_gbps`."""
    from dflash_assets.extraction.object_size import check_hidden_state_dtype
    from dflash_assets.planning.capacity import PlanSettings, plan_capacity
    from dflash_assets.planning.gpu_result import gpu_result_path, load_gpu_result
    from dflash_assets.planning.inputs import device_profile, target_facts
    from dflash_assets.planning.memory import stage_memory, target_split
    from dflash_assets.planning.store_result import load_store_result, store_read_rate, store_result_path
    from dflash_assets.planning.training_split import SplitUnknown, StoredHiddenStates, training_split_for
    from dflash_assets.planning.workload import build_workload, given_workload
    from dflash_assets.storage.store import StoreError

    dtype = check_hidden_state_dtype(settings.HIDDEN_STATE_DTYPE.get())
    try:
        object_store = store.check()
    except StoreError as error:  # the plan still works from the dataset alone
        log(f"the store is unreachable ({error}); planning from the dataset alone")
        object_store = None
    max_length = settings.MAX_LENGTH.get_int()
    if samples and mean_tokens:  # a what-if: nothing of the dataset is needed (not even its range size)
        workload = given_workload(
            samples=samples,
            mean_tokens=mean_tokens,
            samples_per_partition=settings.SAMPLES_PER_PARTITION.get_int(),
            max_length=max_length,
            dataset="what-if",
            given=f"given: {samples:,} samples of {mean_tokens:,.0f} tokens (--samples, --mean-tokens)",
        )
    else:
        from dflash_assets.orchestration.partitions import dataset_row_count

        workload = build_workload(
            dataset_uri=dataset.uri(),
            rows=dataset_row_count(dataset.uri()),  # counted once per version of the file
            samples_per_partition=settings.samples_per_partition(),
            max_length=max_length,
            tokenizer=target_model.load_tokenizer() if tokenize else None,
            store=object_store,
            known=known,
            sample_rows=sample_rows,
            cache_dir=settings.cache_dir(),
            layout=dataset.layout(),
            log=log,
        )
        if samples or mean_tokens:
            count = samples or round(workload.samples)
            mean = mean_tokens or workload.tokens / max(workload.samples, 1)
            flag = "--samples" if samples else "--mean-tokens"
            workload = given_workload(
                samples=count,
                mean_tokens=mean,
                samples_per_partition=settings.samples_per_partition(),
                max_length=max_length,
                lengths=workload.lengths,
                dataset=workload.dataset,
                given=f"given: {count:,} samples of {mean:,.0f} tokens ({flag}; the dataset's length "
                "distribution scaled to that mean)",
                warnings=workload.warnings,
            )
    model_dir, layer_ids = target_model.model_dir(), target_model.layer_ids()
    final_state = settings.CAPTURE_FINAL_STATE.get_bool()
    facts = target_facts(
        model_dir, target_model.name, layer_ids, workload.lengths, settings.cache_dir(), final_state
    )
    measured = load_gpu_result(gpu_result or gpu_result_path(settings.cache_dir()))
    configured = settings.devices()
    profile = device_profile(
        device_name=device_name,
        device_memory_bytes=int(device_memory_gib * 2**30) if device_memory_gib else None,
        gpu_result=measured,
        configured_devices=configured,
        stated_peak_flops=settings.peak_flops(),
    )
    node_devices = len(configured) or _cuda_count() or 1
    count = devices or (gpus_per_node * nodes if gpus_per_node else node_devices)
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
    drafter = planned_drafter(target_model)
    # The longest sample decides a micro-batch's, a decode's and a generation's length; a bare what-if
    # knows only the mean, and a run of that mean has samples up to the limit.
    longest = max_length if samples and mean_tokens else min(max_length, max(workload.lengths, default=1))
    split_target = target_split(
        target=facts,
        device=profile,
        hidden_state_dtype=dtype,
        max_tokens_per_batch=plan_settings.max_tokens_per_batch,
        max_length=longest,
        configured_tp=settings.target_tp(),
    )
    stages = stage_memory(
        target=facts,
        device=profile,
        drafter=drafter,
        hidden_state_dtype=dtype,
        max_tokens_per_batch=plan_settings.max_tokens_per_batch,
        max_length=longest,
        num_anchors=num_anchors,
        target_tp=split_target.chosen("extraction"),
    )
    # Each stage's memory on the busiest device of the target split it runs with.
    stages["regeneration"] = split_target.bytes_by_tp["regeneration"].get(
        split_target.chosen("regeneration"), stages["regeneration"]
    )
    plan = plan_capacity(workload, facts, profile, plan_settings, stages, measured)
    plan.figures["target_split"] = split_target.as_dict()
    from dflash_assets.orchestration.training import drafter_summary

    plan.figures["drafter"] = {
        "arch": drafter.arch,
        "layers": drafter.num_layers,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "mask_token": drafter.mask_token,
        "mask_token_source": drafter.extra["mask_token_source"],
        "summary": drafter_summary(drafter),
    }
    plan.warnings.extend(split_target.warnings)
    nproc = settings.train_nproc_per_node()
    stated_from = f"{settings.TRAIN_NPROC_PER_NODE.name}={settings.TRAIN_NPROC_PER_NODE.get()}, " + (
        f"--online-target-devices {online_target_devices}"
        if online_target_devices is not None
        else "the target on each rank's device (run config online_target_devices unset)"
    )
    saved_store = load_store_result(store_result or store_result_path(settings.cache_dir()))
    store_rate, store_source, set_aside = store_read_rate(store_gbps, saved_store, store.store_url())
    if set_aside:
        plan.warnings.append(set_aside)
    f = plan.figures
    stored = [
        StoredHiddenStates(
            dtype=d,
            bytes_per_token=f["hidden_state_bytes_by_dtype"][d] / f["tokens"] if f["tokens"] else 0.0,
            total_bytes=f["hidden_state_bytes_by_dtype"][d],
            extraction_hours=f["extraction_hours"]["devices_n_by_dtype"][d],
        )
        for d in f["hidden_state_bytes_by_dtype"]
    ]
    try:
        split = training_split_for(
            target=facts,
            drafter=drafter,
            device=profile,
            gpu_result=measured,
            lengths=workload.lengths,
            tokens_to_train=workload.tokens * plan_settings.epochs,
            gpus_per_node=gpus_per_node or node_devices,
            nodes=nodes,
            max_length=max_length,
            mfu=plan_settings.mfu,
            given_drafter_tokens_per_s=train_tokens_per_s,
            stated=(nproc, online_target_devices or 0) if nproc else None,
            stated_from=stated_from,
            longest=longest,
            target_span=split_target.chosen("online target"),
            inter_node_gbps=inter_node_gbps,
            store_bytes_per_s=store_rate,
            store_source=store_source,
            stored=stored,
            hidden_state_dtype=dtype,
        )
    except SplitUnknown as error:
        plan.figures["training_split"] = None
        plan.warnings.append(f"no training split: {error}")
    else:
        plan.training_split = split
        plan.figures["training_split"] = split.as_dict()
        plan.warnings.extend(split.warnings)
    return plan


def planned_object_bytes(
    *,
    dataset: DatasetResource,
    target_model: TargetModelResource,
    mean_tokens: float | None = None,
    sample_rows: int = 500,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[int, int, str]:
    """(bytes of one hidden-state object of the configured target at the plan's mean length, that
    length, where it comes from): what `bench --only store` measures at. The mean is `mean_tokens`, else
    the dataset's (`sample_rows` tokenized, as the plan estimates it), else the seeds' 2,017."""
    from dflash_assets.extraction.object_size import check_hidden_state_dtype, sample_object_nbytes
    from dflash_assets.planning.training_split import SEED_MEAN_TOKENS
    from dflash_assets.planning.workload import build_workload
    from dflash_assets.target.memory import target_config
    from dflash_assets.target.model import hidden_size_of

    dtype = check_hidden_state_dtype(settings.HIDDEN_STATE_DTYPE.get())
    layer_ids = target_model.layer_ids()
    hidden = hidden_size_of(target_config(target_model.model_dir()))
    if mean_tokens:
        mean, how = round(mean_tokens), "--mean-tokens"
    else:
        try:
            workload = build_workload(
                dataset_uri=dataset.uri(),
                samples_per_partition=settings.samples_per_partition(),
                max_length=settings.MAX_LENGTH.get_int(),
                tokenizer=target_model.load_tokenizer(),
                sample_rows=sample_rows,
                cache_dir=settings.cache_dir(),
                layout=dataset.layout(),
                log=log,
            )
            mean, how = round(workload.tokens / max(workload.samples, 1)), "the plan's mean length"
        except Exception as error:  # a config-only target has no tokenizer; an absent dataset no rows
            mean = SEED_MEAN_TOKENS
            how = f"the seeds' mean length: the dataset's could not be read ({type(error).__name__})"
    final_state = settings.CAPTURE_FINAL_STATE.get_bool()
    size = sample_object_nbytes(
        sample_index=0,
        num_tokens=mean,
        target_layer_ids=layer_ids,
        target_model=target_model.name,
        hidden_size=hidden,
        dtype=dtype,
        final_state=final_state,
    )
    layers = f"{len(layer_ids)} layers{' and the final state' if final_state else ''}"
    return size, mean, f"{target_model.name}: {layers} × {hidden:,} in {dtype} × {mean:,} tokens ({how})"


def planned_drafter(target_model: TargetModelResource):
    """The drafter the configured target gets (`DFLASH_DRAFTER_SHAPE`, `DFLASH_DRAFTER_ARCH`,
    `DFLASH_BLOCK_SIZE`, `DFLASH_NUM_DRAFT_LAYERS`, `DFLASH_MASK_TOKEN_ID`): the one a run trains, its
    mask token resolved, so a plan refuses a target no drafter can be trained for (`MaskTokenError`)."""
    from dflash_assets.orchestration.training import configured_drafter

    return configured_drafter(target_model)


def recommended_online_split(
    target_model: TargetModelResource,
    node_devices: int,
    target_devices_per_rank: int | None = None,
    *,
    mean_tokens: float | None = None,
    max_length: int | None = None,
    num_anchors: int = 512,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[int, int]:
    """(drafter ranks, target devices per rank) for this node's `node_devices` devices in online training:
    the plan's recommendation for the configured target and drafter on this node's device (its GPU, the
    saved `bench --gpu` result's, or its CPU), from samples of `mean_tokens` (unknown: `max_length`)
    tokens. Nothing is tokenized: the split depends on the lengths, not on how many there are. With
    `target_devices_per_rank` given, only the number of ranks is chosen."""
    from dflash_assets.planning.gpu_result import gpu_result_path, load_gpu_result
    from dflash_assets.planning.inputs import device_profile, target_facts
    from dflash_assets.planning.training_split import SplitUnknown, training_split_for

    max_length = max_length or settings.MAX_LENGTH.get_int()
    mean = min(round(mean_tokens or max_length), max_length)
    layer_ids = target_model.layer_ids()
    facts = target_facts(target_model.model_dir(), target_model.name, layer_ids, [mean], settings.cache_dir())
    measured = load_gpu_result(gpu_result_path(settings.cache_dir()))
    profile = device_profile(
        device_name=None,
        device_memory_bytes=None,
        gpu_result=measured,
        configured_devices=settings.devices(),
        stated_peak_flops=settings.peak_flops(),
    )
    setting = settings.TRAIN_NPROC_PER_NODE.name
    try:
        split = training_split_for(
            target=facts,
            drafter=planned_drafter(target_model),
            device=profile,
            gpu_result=measured,
            lengths=[mean],
            tokens_to_train=0.0,
            gpus_per_node=node_devices,
            max_length=max_length,
            num_anchors=num_anchors,
            target_devices_per_rank=target_devices_per_rank,
            longest=max_length,
            target_span=online_target_span(target_model),
        )
    except SplitUnknown as error:
        raise settings.SettingError(f"{setting}=auto cannot choose a split: {error}") from None
    best = split.recommended
    if best is None:
        raise settings.SettingError(
            f"{setting}=auto: no online split of {node_devices} device(s) with {target_devices_per_rank} "
            "target device(s) per rank: lower online_target_devices or set a number of ranks"
        )
    log(
        f"{setting}=auto: {best.label} on {node_devices} device(s), ~{best.tokens_per_s:,.0f} tokens/s "
        f"expected (`dflash-assets plan` on {profile.name}, samples of ~{mean:,} tokens; target forward "
        f"{split.figures.target_tokens_per_s:,.0f} tokens/s a device, drafter step "
        f"{split.figures.drafter_tokens_per_s:,.0f})"
    )
    for warning in split.warnings + ([] if best.fits else [f"{best.label} does not fit {profile.name}"]):
        log(f"WARNING: {warning}")
    return best.drafter_ranks, best.target_devices_per_rank


def online_split_recommender(
    target_model: TargetModelResource,
    tokenized: Sequence[Any],
    train_settings: Any,
    log: Callable[[str], None],
) -> Callable[[int, int | None], tuple[int, int]]:
    """`recommended_online_split` for a training run: its samples' mean length from the tokenized ranges'
    manifests, its max length and anchors (what `TrainConfig.launch` calls with `nproc_per_node` auto)."""
    samples = sum(len(p.manifest.get("sample_indices") or []) for p in tokenized)
    tokens = sum(int(p.manifest.get("tokens") or 0) for p in tokenized)
    return lambda node_devices, target_devices_per_rank: recommended_online_split(
        target_model,
        node_devices,
        target_devices_per_rank,
        mean_tokens=tokens / samples if samples else None,
        max_length=train_settings.max_length,
        num_anchors=train_settings.num_anchors,
        log=log,
    )


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
        estimate["given"]
        if estimate.get("given")
        else "exact: every range tokenized"
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
        ("drafter", f["drafter"]["summary"]),
        ("final state", _final_state_row(f)),
        (
            "bytes per token",
            f"{f['bytes_per_token']:,} in {dtype} ({f['bytes_per_token_by_dtype'][other]:,} in {other})",
        ),
        (
            "hidden states in the store",
            f"{human_bytes(f['hidden_state_bytes'])} in {dtype} "
            f"({human_bytes(f['hidden_state_bytes_by_dtype'][other])} in {other}); {f['objects']:,} objects"
            + (
                f" of {human_bytes(f['hidden_state_bytes'] / f['objects'])} on average"
                if f["objects"]
                else ""
            ),
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
            f"{_rate(f['offline_read_bytes_per_s'])} a rank at {training['tokens_per_s']:,.0f} tokens/s "
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
    rows += target_split_rows(f.get("target_split"))
    if plan.training_split is not None:
        rows += plan.training_split.table_rows()
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"note: {note}" for note in estimate["notes"]]
    lines += [f"WARNING: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def _final_state_row(figures: dict[str, Any]) -> str:
    """What storing the target's final state costs: bytes a token and layers of forward."""
    final = figures["final_state"]
    if not final["stored"]:
        return (
            f"not stored ({settings.CAPTURE_FINAL_STATE.name}=0): the forward stops after layer "
            f"{final['forward_layers'] - 1}; distillation ({settings.DISTILL_WEIGHT.name}) cannot train "
            "offline"
        )
    added, total = final["bytes_per_token"], figures["bytes_per_token"]
    return (
        f"stored beside the layers: +{added:,} bytes a token (+{added / max(1, total - added):.0%}), and the "
        f"forward runs all {final['forward_layers']} layers instead of {final['forward_layers_without']} "
        f"({settings.CAPTURE_FINAL_STATE.name}=0 leaves it out)"
    )


def target_split_rows(split: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The printed plan's "target split" block: the smallest number of devices the target spans for each
    stage that runs it (`DFLASH_TARGET_TP`), and the configured one."""
    if not split:
        return []
    configured = split["configured"]
    rows = [
        (
            "target split",
            f"{settings.TARGET_TP.name}={configured}; the smallest number of devices the target fits with "
            f"headroom, per stage (its heads allow {', '.join(map(str, split['sizes']))})",
        )
    ]
    for stage, smallest in split["smallest"].items():
        by_k = split["bytes_by_tp"][stage]
        if smallest is None:
            text = f"does not fit on {max(by_k)} devices (~{human_bytes(by_k[max(by_k)])} each)"
        else:
            text = f"{smallest} device{'s' if smallest > 1 else ''} (~{human_bytes(by_k[smallest])} each)"
        if stage == "online target":
            text += "; a replica's layers split over its devices"
        rows.append((f"  {stage}", text))
    return rows


def resolve_target_tp(
    value: str | None, stage: str, target_model: TargetModelResource, log: Callable[[str], None]
) -> int:
    """The devices the target spans for `stage` ("capture" or "regeneration"): the run config's
    `target_tp` (a number, or `auto`), else `DFLASH_TARGET_TP`; `auto` takes the plan's smallest count
    that fits this host's device. Above 1, the family's tensor-parallel plan and its heads are checked
    here, before any device is leased."""
    from dflash_assets.target.tensor_parallel import (
        TensorParallelUnsupported,
        check_tensor_parallel,
        read_config,
    )

    name = "run config `target_tp`" if value is not None else settings.TARGET_TP.name
    tp = settings.target_tp_value(value if value is not None else settings.TARGET_TP.get(), name)
    if tp == 0:
        tp = planned_target_tp(target_model, stage)
        log(f"{name}=auto: the target spans {tp} device(s) for {stage} (`dflash-assets plan`)")
    try:
        check_tensor_parallel(read_config(target_model.model_dir()), tp, stage=stage)
    except TensorParallelUnsupported as error:
        raise settings.SettingError(str(error)) from None
    return tp


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
