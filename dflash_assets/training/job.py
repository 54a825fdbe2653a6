"""One training run as every rank runs it: the job (what to train, on what, with which settings, the same
on every node and free of secrets), the node's own resources (its devices, directories and target
directory), and `run_job`, which sets up the data, trains, and on rank 0 exports the drafter.

The Dagster step builds the job (`orchestration/assets/drafter_checkpoints.py`) and either calls
`run_job` itself (one rank) or launches the ranks with torch.distributed's launcher
(`orchestration/execution/train_launch.py`), each of which calls it. What rank 0 reports (log lines,
progress, committed checkpoints, the outcome) goes through `JobEvents`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from dflash_assets import terminal
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.storage.layout import CONFIG_NAME, DRAFTER_PREFIX
from dflash_assets.storage.manifest import StoredPartition, read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.s3_store import S3Settings
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.training.settings import TrainSettings


@dataclass
class TrainingJob:
    """What every rank of one run needs to know, whichever node it runs on (JSON, no credentials: each
    node's boto3 reads its own)."""

    run: str
    mode: str  # "offline" or "online"
    store_url: str
    hidden_state_partitions: list[str]  # store prefixes of committed ranges (offline)
    tokenized_partitions: list[str]  # store prefixes of committed ranges (online; the data source)
    drafter_config: str  # DrafterConfig JSON; its target_model is replaced by each node's own directory
    target_model_name: str  # the target's identity: every node's target directory must match it
    settings: dict[str, Any]  # TrainSettings less the device, which each rank leases
    data_source: dict[str, Any] = field(default_factory=dict)  # whose answers (the model card says)
    online_target_devices: int = 0  # online: devices per rank that run target replicas (0: share)
    target_span: int = 1  # online: devices one target replica spans (DFLASH_TARGET_TP), its layers split
    cache_budget_bytes: int = 16 * 2**30  # offline: per node, shared by its ranks
    s3: dict[str, Any] = field(default_factory=dict)  # S3Settings fields
    upload: dict[str, Any] = field(default_factory=dict)  # Uploader keywords

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainingJob:
        return cls(**json.loads(text))

    def open_store(self) -> ObjectStore:
        return open_store(self.store_url, S3Settings(**self.s3) if self.s3 else None)

    def train_settings(self, device: str) -> TrainSettings:
        values = dict(self.settings)
        values["betas"] = tuple(values.get("betas", (0.9, 0.999)))
        return TrainSettings(**{**values, "device": device})

    @property
    def export_prefix(self) -> str:
        return f"{DRAFTER_PREFIX}/{self.run}"


@dataclass
class NodeResources:
    """What one rank has on its own node."""

    node: str  # the node's name (DFLASH_NODE or the host name)
    device: str  # the leased device the drafter trains on (`cuda:1`, `cpu:0`)
    target_model_dir: Path  # this node's copy of the target (its identity is checked)
    target_model_name: str
    work_dir: Path  # rank 0's curves and export on their way to the store (other ranks write nothing)
    train_cache_dir: Path  # offline: the streamed hidden states' cache (this rank's own)
    read_cache_dir: Path  # local copies of tokenized shards
    target_devices: list[str] = field(default_factory=list)  # online: leased for target replicas
    spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None = None
    # The node's local checkpoint copies, shared by its ranks (rank 0's on their way to the store; a
    # resume's one download per node). None: `<work_dir>/checkpoints`.
    checkpoint_dir: Path | None = None


class JobEvents(Protocol):
    """Where rank 0's reports go: the Dagster step, in this process or across the launcher."""

    def log(self, message: str) -> None: ...

    def progress(self, snapshot: terminal.ProgressSnapshot) -> None: ...

    def checkpoint(self, report: dict[str, Any]) -> None: ...


def offline_data(job: TrainingJob, store: ObjectStore, cache_dir: Path, local_world_size: int):
    """The committed hidden-state objects of the job's ranges (sizes from their manifests), read through
    the node's cache: its ranks share the folder and the whole budget (`training/sample_stream.py`), so
    each object is fetched once a node however the shares move between epochs."""
    from dflash_assets.extraction.sample_format import parse_sample_object_name  # imports torch
    from dflash_assets.training.data import OfflineData

    if not job.hidden_state_partitions:
        raise ValueError(
            "No hidden-state ranges are materialised, so offline training has nothing to read: "
            "materialise hidden_state_partitions for some ranges first, or set DFLASH_TRAIN_MODE=online "
            "(run config `mode: online`) to run the target beside the trainer."
        )
    objects, dtypes = [], []
    for partition in committed(store, job.hidden_state_partitions):
        for key, size in partition.object_keys():
            if parse_sample_object_name(key.rsplit("/", 1)[-1]) is not None:
                objects.append((key, size))
                dtypes.append(partition.manifest.get("hidden_state_dtype", "bf16"))  # bf16 before fp8 existed
    # A launched rank's folder is `rank-<n>` in the node's (training/rank.py): the node's is shared.
    node_dir = cache_dir.parent if cache_dir.name.startswith("rank-") else cache_dir
    return OfflineData(
        store=store,
        objects=objects,
        cache_dir=node_dir,
        cache_budget_bytes=job.cache_budget_bytes,
        hidden_state_dtypes=dtypes,
    )


def committed(store: ObjectStore, prefixes: Sequence[str]) -> list[StoredPartition]:
    """The partitions at `prefixes`, each by its manifest (a range un-committed since the job was made is
    an error naming it, not a silent gap)."""
    partitions = []
    for prefix in prefixes:
        manifest = read_manifest(store, prefix)
        if manifest is None:
            raise ValueError(
                f"{store.uri(prefix)} is no longer committed (no manifest): materialise it again"
            )
        partitions.append(StoredPartition(store, prefix, manifest))
    return partitions


def tokenized_samples(store: ObjectStore, prefixes: Sequence[str], cache_dir: Path) -> list:
    """Every sample of the committed tokenized ranges (token ids and loss masks: small)."""
    from dflash_assets.conversations.shard import load_shard

    return [sample for partition in committed(store, prefixes) for sample in load_shard(partition, cache_dir)]


def run_job(job: TrainingJob, node: NodeResources, *, collective: Any, events: JobEvents) -> dict[str, Any]:
    """Train this rank's part of `job`; rank 0 then exports the drafter to `drafter/<run>/` (config.json
    last) and returns the outcome (`outcome()`), the other ranks an empty dict."""
    from dflash_assets.drafter.speculative import TargetVerifier
    from dflash_assets.target.devices import torch_device
    from dflash_assets.training.sample_stream import remove_node_cache
    from dflash_assets.training.train import train_drafter

    store = job.open_store()
    config = DrafterConfig.from_json(job.drafter_config)
    config = replace(config, target_model=str(node.target_model_dir), extra=dict(config.extra))
    if node.target_model_name != job.target_model_name:
        raise ValueError(
            f"node {node.node}'s target model {node.target_model_name!r} ({node.target_model_dir}) is not "
            f"the job's {job.target_model_name!r}: set DFLASH_TARGET_MODEL on that node to the same model"
        )
    settings = job.train_settings(str(torch_device(node.device)))
    world = world_of(collective, node)
    verifier = None
    if job.mode == "offline":
        data = offline_data(job, store, node.train_cache_dir, collective.local_world_size)
    else:
        events.log(
            f"target replicas on {', '.join(node.target_devices or [node.device])}; drafter on {node.device}"
        )
        data, captures = online_data(job, store, node, settings.device, config, events.log)
        verifier = lambda: TargetVerifier(captures[0].model, config.target_layer_ids)  # noqa: E731
    uploader = Uploader(store, **job.upload) if collective.is_rank0 else None
    with uploader if uploader is not None else contextlib.nullcontext():
        result = train_drafter(
            config,
            settings,
            data,
            store=store,
            run=job.run,
            work_dir=node.work_dir,
            log=events.log,
            on_checkpoint=events.checkpoint,
            on_progress=events.progress,
            uploader=uploader,
            target_verifier=verifier,
            spare_device=node.spare_device,
            collective=collective,
            world=world,
            checkpoint_dir=node.checkpoint_dir,
        )
        if job.mode == "offline" and collective.local_rank == 0:
            # Trained: the node's cache is spent (a failed run keeps it, for its resumption to read).
            remove_node_cache(data.node_cache_dir)
        if not collective.is_rank0:
            return {}
        metrics = export_and_upload(job, result, config, node.work_dir / "export", uploader)
    return outcome(job, result, metrics, store)


def world_of(collective: Any, node: NodeResources) -> dict[str, Any]:
    """Every rank's node and device, in rank order."""
    places = collective.all_gather_object((node.node, node.device, list(node.target_devices)))
    return {
        "world_size": collective.world_size,
        "nodes": [place[0] for place in places],
        "devices": [place[1] for place in places],
        "target_devices": [place[2] for place in places],
    }


def online_data(
    job: TrainingJob, store: ObjectStore, node: NodeResources, device: str, config, log: Callable[[str], None]
):
    """Tokenized samples and this rank's target replicas: on its own leased devices, `job.target_span` of
    them each, or beside the drafter when it has none."""
    from dflash_assets.extraction.capture import ReplicatedCapture
    from dflash_assets.target.kernels import report_kernel_paths
    from dflash_assets.training.data import OnlineData

    if not job.tokenized_partitions:
        raise ValueError("No tokenized_completions ranges are materialised: materialise some first.")
    samples = tokenized_samples(store, job.tokenized_partitions, node.read_cache_dir)
    replicas = replica_devices(node.target_devices or [node.device], job.target_span)
    layers = config.target_layer_ids
    # Distilling reads the target's final state: the live target gives it beside the layers.
    final_state = float(job.settings.get("distill_weight") or 0.0) > 0
    captures = replica_captures(node.target_model_dir, replicas, layers, final_state=final_state)
    for capture, spans in zip(captures, replicas, strict=True):
        report_kernel_paths(capture.model, spans[0], log=log, warn=lambda m: log(f"WARNING: {m}"))
    if job.target_span > 1:
        log(f"{len(replicas)} target replica(s), each over {job.target_span} devices: {replicas}")
    data = OnlineData(
        samples=samples,
        target_hidden_states=ReplicatedCapture(captures, device),
        partitions=[prefix.rsplit("/", 1)[-1] for prefix in job.tokenized_partitions],
        overlap=bool(node.target_devices),  # devices of its own: its forward runs during the drafter's
    )
    return data, captures


def replica_captures(
    model_dir: Path, replicas: list[list[str]], layer_ids: list[int], *, final_state: bool = False
) -> list[Any]:
    """A capture per replica (with `final_state`, the target's final hidden state as a last slot). Only
    the first loads the target's LM head: the speculative evaluation's verifier reads it (online, from the
    first replica); the others only capture, which never reads logits, and at a 248 K vocabulary a head is
    2.5 GB of a device in bf16."""
    from dflash_assets.extraction.capture import HiddenStateCapture
    from dflash_assets.target.model import load_target_model

    return [
        HiddenStateCapture(
            load_target_model(model_dir, spans, lm_head=index == 0), layer_ids, final_state=final_state
        )
        for index, spans in enumerate(replicas)
    ]


def replica_devices(devices: list[str], span: int) -> list[list[str]]:
    """A rank's target devices in replicas of `span` devices each (a replica's layers split over them)."""
    if span < 1 or len(devices) % span:
        raise ValueError(
            f"{len(devices)} target device(s) per rank cannot make replicas of {span} devices each "
            "(DFLASH_TARGET_TP): set the run config `online_target_devices` to a multiple of it"
        )
    return [devices[i : i + span] for i in range(0, len(devices), span)]


def export_and_upload(job: TrainingJob, result, config: DrafterConfig, directory: Path, uploader: Uploader):
    """The drafter exported (`drafter/<run>/`), `config.json` uploaded last: readers take a directory
    with a config as complete. Returns the metrics its card shows."""
    from dflash_assets.training.export import export_trained_drafter

    export_dir, metrics = export_trained_drafter(
        result,
        config,
        directory,
        run=job.run,
        target_model_name=job.target_model_name,
        data_source=job.data_source,
    )
    files = {path.name: path for path in export_dir.iterdir() if path.name != CONFIG_NAME}

    def commit(sizes: dict[str, int]) -> None:
        uploader.submit(export_dir / CONFIG_NAME, f"{job.export_prefix}/{CONFIG_NAME}")
        uploader.flush()

    uploader.upload_then_commit(files, job.export_prefix, commit)
    return metrics


def outcome(job: TrainingJob, result, metrics: dict[str, Any], store: ObjectStore) -> dict[str, Any]:
    """What the step reports: every figure of the run, JSON."""
    config_metrics = {k: v for k, v in metrics.items() if k != "per_position_accuracy"}
    return {
        "steps": result.steps,
        "total_steps": result.total_steps,
        "steps_per_epoch": result.steps_per_epoch,
        "resumed_from_step": result.resumed_from_step,
        "final_loss": result.final_loss,
        "eval": result.eval,
        "speculative": result.speculative,
        "baseline": result.baseline,
        "acceptance_length_tau": result.acceptance_length_tau,
        "teacher_forced_tau": result.teacher_forced_tau,
        "per_position_accuracy": result.per_position_accuracy,
        "metrics": config_metrics,
        "tokens_per_second": result.tokens_per_second,
        "rank_step_seconds": result.rank_step_seconds,
        "evaluation_seconds": result.evaluation_seconds,
        # The curve: each held-out evaluation of the run, in order (`train.evaluation_point`).
        "evaluations": result.evaluations,
        "stop_reason": result.stop_reason,  # why training ended: the flat curve, or the cap
        "exported_step": result.exported_step,  # the step whose weights were exported (until flat: the best)
        "world": result.world,
        "world_sizes": result.world_sizes,
        "checkpoints": result.checkpoints,
        "trained_sample_ranges": result.trained_sample_ranges,
        "eval_sample_indices": result.eval_sample_indices,
        "partitions": result.partitions,
        "skipped_nonfinite_steps": result.skipped_nonfinite_steps,
        "drafter_uri": store.uri(job.export_prefix),
    }
