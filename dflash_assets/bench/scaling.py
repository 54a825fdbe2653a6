"""Training scaling: samples/s of data-parallel ranks ÷ one rank, each rank training the same number of
sequences a step, through the product's own path.

A few samples' hidden states are extracted into a temporary local store and committed as one range.
Each measurement is one training run of `drafter_checkpoints`'s core (`train_launch.run_training`):
one rank runs in this process, as the step runs it at world size 1; more ranks are launched with
torch.distributed's launcher running `dflash_assets.training.rank` (gloo on the CPU, each rank with
`OMP_NUM_THREADS=1`; NCCL on CUDA). Evaluation and periodic checkpoints are off. A run trains two
epochs with a log window of one epoch: the first epoch is the warm-up (process start, rendezvous,
first allocations and the cache's first reads fall in it, or before it), the second is timed on rank 0's
clock (the window's figures reach us in the final checkpoint's report). Both world sizes time the same
samples (one whole epoch each), so their rates compare exactly. Rounds alternate which world size runs
first; the median round is reported.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_assets import settings, terminal
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.storage.layout import CHECKPOINTS_PREFIX, DRAFTER_PREFIX, HIDDEN_STATES_PREFIX

SCALING_FIGURE = "training samples/s, {n} ranks / 1 rank (same sequences per rank a step; ideal {n}.0)"
PREFIX = f"{HIDDEN_STATES_PREFIX}/bench-scaling"


@dataclass
class ScalingWorkload:
    """What every measured run trains: a target directory (the drafter shares its embedding and LM head),
    the samples its hidden states are captured from, and the sequences each rank trains a step."""

    model: Any  # the loaded target, for the extraction
    model_dir: Path
    samples: list[TokenizedSample]
    layer_ids: list[int]
    per_rank_batch: int
    num_anchors: int
    max_length: int = 3072
    mask_token_id: int | None = None
    name: str = "bench-scaling"


@dataclass
class ScalingRun:
    """One measured training run: its world (from rank 0's outcome) and its timed epoch."""

    world_size: int
    devices: list[str]
    launched: bool  # ranks launched with torch.distributed.run (else this process alone)
    samples_per_s: float
    tokens_per_s: float  # every rank's tokens
    step_s: float  # rank 0's wall time per step over the timed epoch
    rank_compute_s: list[float]  # each rank's forward + backward per step (mean over the whole run)


@dataclass
class ScalingFigures:
    world_size: int  # of the multi-rank runs
    rounds: list[tuple[ScalingRun, ScalingRun]] = field(default_factory=list)  # (1 rank, N ranks)

    def ratios(self) -> list[float]:
        return [many.samples_per_s / one.samples_per_s for one, many in self.rounds]

    def median_round(self) -> tuple[ScalingRun, ScalingRun]:
        """The round whose ratio is the median (the lower middle one of an even count)."""
        ratios = self.ratios()
        return self.rounds[ratios.index(statistics.median_low(ratios))]

    @property
    def ratio(self) -> float:
        one, many = self.median_round()
        return many.samples_per_s / one.samples_per_s


class _Reports:
    """What the step would show in Dagster (`train_launch.Reports`): kept, the final checkpoint's report
    read for the timed window; progress drawn on the terminal line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.checkpoints: list[dict[str, Any]] = []

    def log(self, message: str) -> None:
        self.lines.append(message)

    def progress(self, snapshot: terminal.ProgressSnapshot) -> None:
        terminal.report(snapshot)

    def checkpoint(self, report: dict[str, Any]) -> None:
        self.checkpoints.append(report)

    def status(self, text: str) -> None:
        pass


def _empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


def _remove_run(store_url: str, directory: Path) -> None:
    """A measured run's checkpoint, export and work files: at a real drafter's size (weights and AdamW
    state of ~1 B parameters, 12 GB a checkpoint) two runs would fill a GPU node's disk."""
    from dflash_assets.storage.open_store import open_store

    store = open_store(store_url)
    for prefix in (CHECKPOINTS_PREFIX, DRAFTER_PREFIX):
        store.delete_prefix(f"{prefix}/scaling-")
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _one_thread_per_rank(devices: Sequence[str]) -> Iterator[None]:
    """On the CPU, each rank computes on one core: this process's intra-op threads (the rank run here)
    and `OMP_NUM_THREADS` for launched ranks (the launcher keeps a value it is given). On CUDA, the
    product's defaults stand."""
    if not devices[0].startswith("cpu"):
        yield
        return
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def store_hidden_states(workload: ScalingWorkload, directory: Path) -> str:
    """The workload's samples extracted into a local store under `directory`, committed as one range;
    returns the store's URL."""
    from dflash_assets.extraction.extract import extract_range
    from dflash_assets.storage.manifest import new_manifest, write_manifest
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.storage.uploader import Uploader

    store_url = str(directory / "store")
    store = open_store(store_url)
    with Uploader(store, staging_budget_bytes=256 * 2**20) as uploader:
        result = extract_range(
            model=workload.model,
            target_model_name=workload.name,
            samples=workload.samples,
            target_layer_ids=workload.layer_ids,
            store=store,
            prefix=PREFIX,
            staging_dir=directory / "staging",
            uploader=uploader,
            device=str(next(workload.model.parameters()).device),
            log=lambda message: None,
        )
    if result.samples != len(workload.samples):
        raise RuntimeError(f"extraction stored {result.samples} of {len(workload.samples)} samples")
    manifest = new_manifest("hidden_state_partitions", "bench", result.objects, hidden_state_dtype="bf16")
    write_manifest(store, PREFIX, manifest)
    return store_url


def measure_run(
    workload: ScalingWorkload, store_url: str, devices: Sequence[str], world_size: int, directory: Path
) -> ScalingRun:
    """Train two epochs at `world_size` ranks (`per_rank_batch` sequences each a step) and time the
    second on rank 0's clock."""
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.orchestration.execution.train_launch import Launch
    from dflash_assets.orchestration.training import run_training
    from dflash_assets.training.job import TrainingJob
    from dflash_assets.training.rank import NodeSpec
    from dflash_assets.training.settings import TrainSettings

    global_batch = workload.per_rank_batch * world_size
    if len(workload.samples) % global_batch:
        raise ValueError(f"{len(workload.samples)} samples do not make whole steps of {global_batch}")
    steps_per_epoch = len(workload.samples) // global_batch
    train_settings = TrainSettings(
        mode="offline",
        max_steps=2 * steps_per_epoch,
        log_every_steps=steps_per_epoch,  # one window per epoch: the second is the timed one
        global_batch_size=global_batch,
        max_length=workload.max_length,
        num_anchors=workload.num_anchors,
        eval_samples=0,
        spec_eval_prompts=0,
        checkpoint_every_steps=None,
        checkpoint_every_minutes=None,
    ).to_dict()
    train_settings.pop("device")
    config = DrafterConfig.from_target(
        workload.model_dir, target_layer_ids=workload.layer_ids, mask_token_id=workload.mask_token_id
    )
    config.extra["target_model_name"] = workload.name
    run = f"scaling-{world_size}-{directory.name}"
    job = TrainingJob(
        run=run,
        mode="offline",
        store_url=store_url,
        hidden_state_partitions=[PREFIX],
        tokenized_partitions=[],
        drafter_config=config.to_json(),
        target_model_name=workload.name,
        settings=train_settings,
    )
    spec = NodeSpec(
        node=settings.node_name(),
        devices=list(devices),
        lock_dir=str(directory / "locks"),  # this benchmark's own leases: nothing else uses them
        target_model_dir=str(workload.model_dir),
        target_model_name=workload.name,
        work_dir=str(directory / run),
        train_cache_dir=str(directory / run / "cache"),
        read_cache_dir=str(directory / run / "read-cache"),
        collective_timeout_s=120.0,
        eval_timeout_s=120.0,
        holder="dflash-assets bench",
    )
    # No restarts: a restarted rank would put a second warm-up inside the timed epoch.
    launch = Launch(
        nproc_per_node=world_size,
        nnodes=1,
        rdzv_host="",  # this host, a free port
        rdzv_port=0,
        rdzv_timeout_s=120.0,
        max_restarts=0,
    )
    reports = _Reports()
    with _one_thread_per_rank(devices):
        outcome = run_training(job, launch, spec, reports, run_id=run)
    _empty_cache(devices[0])  # a rank run here leaves its cached blocks to the launched ranks
    world = outcome["world"]
    if world["world_size"] != world_size:  # a figure for the wrong world size means nothing
        raise RuntimeError(f"asked for {world_size} ranks, rank 0 reports world size {world['world_size']}")
    final = [r for r in reports.checkpoints if r.get("step") == outcome["steps"]]
    window = (final[-1].get("train") or {}) if final else {}
    if window.get("step") != outcome["steps"] or not window.get("sequences_per_second"):
        said = " | ".join(reports.lines[-3:])
        raise RuntimeError(f"run {run} reported no timed window for its last epoch ({final}); last: {said}")
    return ScalingRun(
        world_size=world["world_size"],
        devices=list(world["devices"]),
        launched=not launch.in_process,
        samples_per_s=float(window["sequences_per_second"]),
        tokens_per_s=float(window["tokens_per_second"]),
        step_s=float(window["sequences_per_step"]) / float(window["sequences_per_second"]),
        rank_compute_s=[float(s) for s in outcome["rank_step_seconds"]],
    )


def bench_scaling(
    workload: ScalingWorkload, devices: Sequence[str], rounds: int, print_fn: Callable[[str], None] = print
) -> ScalingFigures:
    """1 rank on `devices[0]` and `len(devices)` ranks on `devices`, in `rounds` alternating rounds."""
    world_size = len(devices)
    worlds = (1, world_size) if world_size > 1 else (1,)
    figures = ScalingFigures(world_size)
    ranks = f"1 rank vs {world_size} ({', '.join(devices)})" if world_size > 1 else f"1 rank ({devices[0]})"
    print_fn(
        f"training scaling: {len(workload.samples)} samples, {workload.per_rank_batch} per rank a step, "
        f"{ranks}, {rounds} round(s), 2 epochs a run (the second timed)"
    )
    progress = terminal.TaskProgress("bench training scaling", 2 * rounds, "trainings")
    with tempfile.TemporaryDirectory(prefix="dflash-bench-scaling-") as tmp:
        store_url = store_hidden_states(workload, Path(tmp))
        workload.model = None  # the target's memory goes back before a drafter trains on its device
        _empty_cache(devices[0])
        for round_index in range(rounds):
            order = worlds if round_index % 2 == 0 else worlds[::-1]
            runs: dict[int, ScalingRun] = {}
            for ranks in order:
                progress.set_status(f"round {round_index + 1}/{rounds}: {ranks} rank(s)")
                directory = Path(tmp) / f"round-{round_index}-{ranks}"
                directory.mkdir()
                runs[ranks] = measure_run(workload, store_url, devices[:ranks], ranks, directory)
                _remove_run(store_url, directory)
                progress.advance()
            figures.rounds.append((runs[1], runs[world_size]))
    progress.finish()
    return figures


def scaling_lines(figures: ScalingFigures) -> list[str]:
    """The notes beside the row: every round's ratio, the median round's runs and where they ran."""
    one, many = figures.median_round()
    ratios = ", ".join(f"{r:.2f}" for r in figures.ratios())
    lines = []
    if many is not one:
        lines.append(f"training scaling, {many.world_size} ranks / 1 rank, samples/s per round: {ratios}")
    for run in (one, many) if many is not one else (one,):
        how = "in this process, as the step runs 1 rank"
        if run.launched:
            how = "launched by torch.distributed.run"
        where = f"world size {run.world_size} on {', '.join(run.devices)} (rank 0's outcome)"
        compute = " / ".join(f"{s:.3f}" for s in run.rank_compute_s)
        per_rank = run.tokens_per_s / run.world_size
        lines.append(
            f"  {run.world_size} rank(s): {run.samples_per_s:.2f} samples/s, "
            f"{run.tokens_per_s:,.0f} tokens/s ({per_rank:,.0f} per rank); {run.step_s:.3f} s a step, "
            f"forward+backward {compute} s per rank (mean of the run); {how}, {where}"
        )
    return lines


# ----------------------------------------------------------------------------------------- workloads


def demo_workload(count: int, per_rank_batch: int, num_anchors: int) -> ScalingWorkload:
    """The demo target and the first `count` bundled conversations."""
    from dflash_assets.bench.workload import demo_layer_ids, demo_samples
    from dflash_assets.target.demo_model import ensure_demo_model
    from dflash_assets.target.model import load_target_model

    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, "cpu")
    return ScalingWorkload(
        model=model,
        model_dir=model_dir,
        samples=demo_samples(model_dir, count),
        layer_ids=demo_layer_ids(model),
        per_rank_batch=per_rank_batch,
        num_anchors=num_anchors,
    )


def cpu_scaling(quick: bool) -> tuple[dict[str, float], list[str]]:
    """The CPU row: 2 ranks on 2 cores ÷ 1 rank on 1 core, the demo target and bundled data."""
    per_rank = 2 if quick else 4
    count = 8 if quick else 64  # whole steps at both world sizes
    workload = demo_workload(count, per_rank, num_anchors=16 if quick else 64)
    figures = bench_scaling(workload, ["cpu:0", "cpu:1"], rounds=1 if quick else 3)
    one, many = figures.median_round()
    values = {
        SCALING_FIGURE.format(n=2): figures.ratio,
        "training samples/s, 1 rank on 1 core (in this process, 1 thread)": one.samples_per_s,
        "training samples/s, 2 ranks on 2 cores (torch.distributed.run, gloo, OMP_NUM_THREADS=1)": (
            many.samples_per_s
        ),
    }
    return values, scaling_lines(figures)


# ----------------------------------------------------------------------------------- on a GPU node


@dataclass(frozen=True)
class RandomTargets:
    """What `bench.gpu` lends this module: its target shapes, how it builds a random-weight target of
    one and synthetic samples for it (passed in, so the two modules do not import each other)."""

    real_shapes: Sequence[Any]
    tiny_shapes: Sequence[Any]
    build: Callable[[Any, torch.device], Any]
    samples: Callable[[Any, int], list]


def random_target_workload(
    targets: RandomTargets,
    shape: Any,
    device: torch.device,
    directory: Path,
    count: int,
    per_rank_batch: int,
    num_anchors: int,
) -> ScalingWorkload:
    """A random-weight target of `shape` in device memory for the extraction, saved as a model
    directory of its config, embedding and LM head (all an offline drafter reads of its target), and
    `count` synthetic samples of up to the shape's length."""
    from safetensors.torch import save_file

    model = targets.build(shape, device)
    model_dir = directory / "random-target"
    model_dir.mkdir(parents=True)
    model.config.to_json_file(model_dir / "config.json")
    shared = {
        "model.embed_tokens.weight": model.get_input_embeddings().weight,
        "lm_head.weight": model.get_output_embeddings().weight,
    }
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in shared.items()}
    save_file(weights, str(model_dir / "model.safetensors"))
    vocab = shape.config["vocab_size"]
    return ScalingWorkload(
        model=model,
        model_dir=model_dir,
        samples=targets.samples(shape, count * shape.max_length)[:count],  # each is at most max_length
        layer_ids=shape.layer_ids,
        per_rank_batch=per_rank_batch,
        num_anchors=num_anchors,
        max_length=shape.max_length,
        mask_token_id=vocab - 1,  # random weights: any row will do
    )


def gpu_scaling_lines(
    targets: RandomTargets, tiny: bool, device: torch.device, rounds: int, print_fn: Callable[[str], None]
) -> list[str]:
    """`bench --gpu`'s section: per-GPU tokens/s of 1 rank on the first GPU and of one rank on every
    visible GPU (NCCL), the dense target shape's drafter trained through the step's own path. Without
    CUDA (`--gpu --tiny` on a CPU) the 1-rank run alone, on the CPU."""
    # The dense shape: the Qwen3-8B drafter the drafter-step section times alone (hidden 4096).
    shape = targets.tiny_shapes[0] if tiny else targets.real_shapes[0]
    cuda = device.type == "cuda"
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu:0"]
    per_rank, timed_steps = 2, (2 if tiny else 4)  # real: 64 samples at 8 GPUs, ~4.5 GB stored
    count = len(devices) * per_rank * timed_steps  # whole steps at every world size
    with tempfile.TemporaryDirectory(prefix="dflash-bench-scaling-target-") as tmp:
        anchors = 16 if tiny else 512  # the recipe's
        workload = random_target_workload(
            targets, shape, device, Path(tmp), count, per_rank, num_anchors=anchors
        )
        print_fn(f"\ntraining scaling, {shape.name} target (random weights):")
        figures = bench_scaling(workload, devices, rounds, print_fn)
    lines = scaling_lines(figures)
    one, many = figures.median_round()
    if len(devices) == 1:
        lines.append(f"  one device visible ({devices[0]}): no multi-rank figure")
    else:
        lines.append(
            f"  per-GPU tokens/s, {many.world_size} ranks / 1 rank: "
            f"{many.tokens_per_s / many.world_size / one.tokens_per_s:.2f} (ideal 1.0); samples/s "
            f"{figures.ratio:.2f} (ideal {many.world_size}.0)"
        )
    return lines
