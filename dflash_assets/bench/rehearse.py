"""`dflash-assets rehearse`: the whole pipeline at the configured target's real width, on this host, before
any GPU is rented.

A run at toy shapes passes where a real node fails: ~100 MB objects, a 248 K vocabulary and a 5120-wide
context break what 100 KB and 700 tokens never touch. So the rehearsal builds a target of the configured
target's real width, vocabulary and captured layers (random weights; a directory holding only the
target's `config.json` is enough), cut to the depth those layers need, writes a few conversations at the
plan's mean length, and runs `tokenized_completions`, `hidden_state_partitions` and a few steps of
`drafter_checkpoints` through the `dagster` command a user types, against the configured store (under a
prefix of its own, deleted afterwards). Each stage runs in a process of its own, so its peak memory is
its own. It then prints each figure beside the plan's (`dflash-assets plan` for the same configuration)
and exits non-zero when a figure is worse than the plan's by more than 10 %, naming it.

What a host cannot hold is narrowed, and said: on a host without a GPU that could run the target's full
layers (a 27B target cut to 62 layers is ~50 GB of weights), the layers keep the real width (hidden
size), vocabulary, depth and captured layer ids, with narrow insides (the MLP's intermediate size and
the number of attention heads); the drafter keeps its real width and attention and follows the target's
MLP; training samples fewer anchors per sequence (the LM head over a 248 K vocabulary is most of a
step). Object sizes, the store's rates and the feed depend on the width, the vocabulary and the sample
length, which are real.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.bench.rehearsal_target import (
    build_rehearsal_target,
    real_layers_fit,
    rehearsal_conversations,
)
from dflash_assets.settings import environment

TOLERANCE = 0.10  # a figure worse than the plan's by more than this fails the rehearsal
# Narrow insides for a host that cannot run the real layers: the width, vocabulary and depth stay.
CPU_ANCHORS = 16
RUN_NAME = "rehearsal"
PROGRESS_EVERY_S = 30.0


@dataclass
class Figure:
    """One figure of one stage, beside the plan's. `worse` says which way is worse: "above" (bytes,
    memory) or "below" (rates); None when the plan has no figure to hold it against."""

    stage: str
    name: str
    measured: float | None
    planned: float | None
    unit: str
    worse: str | None = "above"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.planned:
            return None
        return self.measured / self.planned

    @property
    def failed(self) -> bool:
        ratio = self.ratio
        if ratio is None or self.worse is None:
            return False
        return ratio > 1 + TOLERANCE if self.worse == "above" else ratio < 1 - TOLERANCE

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "NOT MEASURED"
        if self.ratio is None or self.worse is None:
            return "-"
        if self.failed:
            return f"WORSE THAN PLAN ({self.ratio:.2f}x)"
        return f"ok ({self.ratio:.2f}x)"


@dataclass
class StageRun:
    name: str
    returncode: int
    seconds: float
    peak_host_bytes: int
    peak_device_bytes: int | None
    output: str


# ------------------------------------------------------------------------------------------ the stages


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        found.append(parent)
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
                todo.append(int(child))
    return found


def _rss(pid: int) -> int:
    """The process's anonymous resident memory: what it needs, not the pages of files it maps (a target
    loaded from safetensors maps its files; those pages are the page cache's, freed under pressure)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _device_bytes(pids: set[int]) -> int | None:
    """Device memory the processes hold now, from nvidia-smi (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = 0
    for line in answer.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            total += int(float(parts[1])) * 2**20
    return total


def run_stage(
    name: str, command: list[str], env: dict[str, str], log_path: Path, log: Callable[[str], None]
) -> StageRun:
    """Run one stage's command; its peak host memory is the largest anonymous resident set any of its
    processes reached (sampled every second), its device memory the most nvidia-smi saw."""
    started = time.monotonic()
    with open(log_path, "a") as output:
        output.write(f"\n=== {name}: {' '.join(command)}\n")
        output.flush()
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    device_peak: list[int | None] = [None]
    sampled_peak = [0]
    stop = threading.Event()

    def watch() -> None:
        said = time.monotonic()
        while not stop.wait(1.0):
            pids = set(_tree(process.pid))
            sampled_peak[0] = max(sampled_peak[0], max((_rss(pid) for pid in pids), default=0))
            held = _device_bytes(pids)
            if held is not None:
                device_peak[0] = max(device_peak[0] or 0, held)
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                log(
                    f"  {name}: {time.monotonic() - started:.0f} s, largest process so far "
                    f"{sampled_peak[0] / 2**30:.2f} GiB (log: {log_path})"
                )

    watcher = threading.Thread(target=watch, name="rehearsal-watch", daemon=True)
    watcher.start()
    try:
        _, status = os.waitpid(process.pid, 0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        stop.set()
        watcher.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    return StageRun(
        name,
        process.returncode,
        time.monotonic() - started,
        sampled_peak[0],
        device_peak[0],
        log_path.read_text(),
    )


# ------------------------------------------------------------------------------------------ the rehearsal


@dataclass
class RehearsalOptions:
    samples: int = 2
    mean_tokens: int = 2017  # the seeds' ~2,017 tokens a sample
    steps: int = 3
    num_anchors: int | None = None  # None: the recipe's 512 on a GPU, 32 on a CPU
    inner: str = "auto"  # "real", "narrow", or "auto": real where the device holds the real layers
    keep: bool = False


def run_rehearsal(options: RehearsalOptions, print_fn: Callable[[str], None] = print) -> int:
    """Rehearse, print the table, return the exit code (1 when a figure is worse than the plan's)."""
    import torch

    from dflash_assets import settings
    from dflash_assets.orchestration.resources import StoreResource, TargetModelResource
    from dflash_assets.storage.units import human_bytes

    def log(message: str) -> None:
        print_fn(message)
        sys.stdout.flush()

    target_resource = TargetModelResource()
    configured_dir, layer_ids = target_resource.model_dir(), target_resource.layer_ids()
    cuda = torch.cuda.is_available()
    fits, why = real_layers_fit(configured_dir, layer_ids, options.mean_tokens)
    narrow = options.inner == "narrow" or (options.inner == "auto" and not fits)
    anchors = options.num_anchors or (512 if cuda else CPU_ANCHORS)
    cache = settings.cache_dir()
    target = build_rehearsal_target(configured_dir, layer_ids, narrow, cache, log)
    devices = settings.devices()
    ranks = 2 if len(devices) >= 2 or (not devices and torch.cuda.device_count() >= 2) else 1

    run_id = uuid.uuid4().hex[:8]
    work = cache / "rehearsal" / f"run-{run_id}"
    (work / "dagster").mkdir(parents=True)
    (work / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target.directory))
    dataset = work / "conversations.jsonl"
    rows = rehearsal_conversations(tokenizer, options.samples, options.mean_tokens)
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    store_url = StoreResource().store_url().rstrip("/") + f"/rehearsal-{run_id}"
    # Long enough that no rehearsal sample is cut, and no longer: the plan counts a training rank's memory
    # at DFLASH_MAX_LENGTH, and twice the mean (what this was) asked a 24 GiB host for 20.8 GiB at 8 K.
    longest = max(
        len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)) for row in rows
    )
    max_length = max(settings.MAX_LENGTH.get_int(), longest)
    env = {
        "DAGSTER_HOME": str(work / "dagster"),
        "DFLASH_TARGET_MODEL": str(target.directory),
        "DFLASH_TARGET_LAYER_IDS": ",".join(str(i) for i in layer_ids),
        "DFLASH_DATASET": str(dataset),
        "DFLASH_SAMPLES_PER_PARTITION": str(options.samples),
        "DFLASH_STORE_URL": store_url,
        "DFLASH_COMPLETIONS": "dataset",
        "DFLASH_MAX_LENGTH": str(max_length),
        "DFLASH_RUN_NAME": RUN_NAME,
        "DFLASH_TRAIN_MODE": "offline",
        "DFLASH_TRAIN_MAX_STEPS": str(options.steps),
        "DFLASH_TRAIN_GLOBAL_BATCH_SIZE": str(ranks),  # a sequence a rank a step
        "DFLASH_TRAIN_NPROC_PER_NODE": str(ranks),
        "DFLASH_CHECKPOINT_EVERY_STEPS": "0",
    }
    stage_env = {**os.environ, **env}
    config = target.config
    log(
        f"rehearsing {target_resource.name} at its real width: hidden {config['hidden_size']:,}, "
        f"vocabulary {config['vocab_size']:,}, layers {layer_ids}, {options.samples} samples of "
        f"~{options.mean_tokens:,} tokens, {options.steps} training steps of {anchors} anchors a sequence "
        f"on {ranks} rank(s)"
    )
    for note in [f"target: {why}", *target.notes, *_kernel_notes(cuda)]:
        log(f"  {note}")
    log(f"  store: {store_url} (deleted afterwards{'' if not options.keep else ': --keep'}); log: {work}/log")

    key = f"{0:08d}-{options.samples - 1:08d}"
    dagster = str(Path(sys.executable).with_name("dagster"))
    materialize = [dagster, "asset", "materialize", "-m", "dflash_assets.definitions"]
    train_config = {
        "num_anchors": anchors,
        "eval_samples": 0,
        "spec_eval_prompts": 0,
        "log_every_steps": 1,
    }
    commands = [
        ("tokenized_completions", [*materialize, "--select", "tokenized_completions", "--partition", key]),
        (
            "hidden_state_partitions",
            [*materialize, "--select", "hidden_state_partitions", "--partition", key],
        ),
        (
            "drafter_checkpoints",
            [
                *materialize,
                "--select",
                "drafter_checkpoints",
                "--config-json",
                json.dumps({"ops": {"drafter_checkpoints": {"config": train_config}}}),
            ],  # fmt: skip
        ),
    ]
    plan = _plan(env, anchors)
    mapped = _mapped_training_bytes(env, plan)
    baseline = 0  # a step's own memory before any model: the first stage's (it loads none)
    runs: dict[str, StageRun] = {}
    failed_stage = None
    try:
        for name, command in commands:
            short = _memory_short(plan, name, baseline, mapped)
            if short:
                log(f"{name} cannot run here: {short}")
                runs[name] = StageRun(name, 1, 0.0, 0, None, short)
                failed_stage = name
                break
            log(f"{name} ...")
            runs[name] = run = run_stage(name, command, stage_env, work / "log", log)
            log(f"  {name}: {'ok' if run.returncode == 0 else 'FAILED'} in {run.seconds:.0f} s")
            baseline = baseline or run.peak_host_bytes
            if run.returncode != 0:
                failed_stage = name
                break
        figures = [] if failed_stage else _figures(runs, env, plan, baseline, mapped, log)
    finally:
        if not options.keep:
            _clean(store_url, env, work if failed_stage is None else None)
    if failed_stage:
        tail = "\n".join(runs[failed_stage].output.splitlines()[-30:])
        log(f"the rehearsal stopped at {failed_stage}; its last lines ({work}/log has all):\n{tail}")
        return 1
    log(format_table(figures, human_bytes))
    worse = [f for f in figures if f.failed]
    for figure in worse:
        log(
            f"WORSE THAN PLAN: {figure.stage} {figure.name}: {figure.measured:,.4g} {figure.unit} against "
            f"the plan's {figure.planned:,.4g} ({figure.ratio:.2f}x, more than {TOLERANCE:.0%} "
            f"{'above' if figure.worse == 'above' else 'below'})"
        )
    return 1 if worse else 0


def _kernel_notes(cuda: bool) -> list[str]:
    """What the host's kernels change: on a CPU without bf16 matrix units the LM head's bf16 products run
    through float32 tiles (`target/bf16_matmul.py`), PyTorch's own kernel there taking minutes a step; the
    weights and their bytes stay bf16."""
    import torch

    from dflash_assets.target.bf16_matmul import runs_through_float32_tiles

    if cuda or not runs_through_float32_tiles(torch.empty(0, dtype=torch.bfloat16)):
        return []
    return ["this CPU has no bf16 matrix units: the LM head's bf16 products run through float32 tiles"]


def _store_rates(
    resource: Any, plan: dict[str, Any], objects: list[tuple[str, int]], log: Callable[[str], None]
) -> tuple[float, float]:
    """(write, read) bytes/s of the store at the rehearsal's objects' size: `bench --only store`'s
    measurement (the product's uploader, then its training reader), 8 objects' worth, not saved."""
    from dflash_assets.bench.store import ObjectShape, bench_store

    mean = sum(size for _, size in objects) / len(objects)
    tokens = round(plan["tokens"] / max(1, plan["samples"]))
    shape = ObjectShape(
        num_tokens=tokens,
        layer_ids=list(plan["target"]["layer_ids"]),
        hidden_size=int(plan["target"]["hidden_size"]),
        dtype=plan["hidden_state_dtype"],
        target_model=plan["target"]["name"],
        how=f"the rehearsal's objects: {tokens:,} tokens",
        final_state=bool((plan.get("final_state") or {}).get("stored")),
    )
    figures = bench_store(
        resource.open(),
        resource.store_url(),
        shape,
        uploader_fields=resource.uploader_fields(),
        total_bytes=round(8 * mean),
        log=log,
    )
    return figures["store: write GB/s"] * 1e9, figures["store: read GB/s (training reader)"] * 1e9


def _plan(env: dict[str, str], anchors: int) -> dict[str, Any]:
    """`dflash-assets plan`'s figures for the rehearsal's own configuration (its samples are tokenized:
    their lengths, and so the objects' bytes, are exact)."""
    from dflash_assets.orchestration.capacity_plan import build_plan
    from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource

    with environment(env):
        return build_plan(
            store=StoreResource(),
            dataset=DatasetResource(),
            target_model=TargetModelResource(),
            sample_rows=0,
            num_anchors=anchors,
        ).figures


PLANNED_STAGE = {"hidden_state_partitions": "extraction", "drafter_checkpoints": "training"}


def _mapped_training_bytes(env: dict[str, str], plan: dict[str, Any]) -> int:
    """Of the plan's training memory, what a CPU host holds as pages of the target's files rather than
    as the process's own: the frozen embedding and LM head, which the drafter maps from the target's
    safetensors (`load_target_embeddings`; 4.7 GiB at a 248 K vocabulary and width 5,120). The kernel
    drops and re-reads such pages under pressure, never kills for them, and the rehearsal's memory
    figure (anonymous memory) does not count them. On a GPU they are device memory like the rest: 0."""
    if plan["device"]["kind"] == "cuda":
        return 0
    from dflash_assets.orchestration.resources import TargetModelResource
    from dflash_assets.orchestration.training import TrainConfig, configured_drafter
    from dflash_assets.training.memory import drafter_frozen_bytes

    with environment(env):
        return drafter_frozen_bytes(configured_drafter(TargetModelResource(), TrainConfig()))


def _memory_short(plan: dict[str, Any], stage: str, baseline: int, mapped: int = 0) -> str | None:
    """Why `stage` would not fit this host's free memory by the plan's figure (on a CPU, where the host is
    the device), before it runs: a stage killed by the kernel midway says nothing a user can act on.
    The training stage is held to its own memory, less what it maps from the target's files (`mapped`)."""
    from dflash_assets.storage.units import human_bytes
    from dflash_assets.target.memory import host_available_bytes

    planned = PLANNED_STAGE.get(stage)
    if planned is None or plan["device"]["kind"] == "cuda":
        return None
    mapped = mapped if planned == "training" else 0
    own = plan["device_memory"][planned]["bytes"] - mapped
    needed = own + baseline
    available = host_available_bytes()
    if needed <= available:
        return None
    besides = f", less {human_bytes(mapped)} mapped from the target's files" if mapped else ""
    return (
        f"the plan's {planned} memory ({human_bytes(own)}{besides}; and {human_bytes(baseline)} of a "
        f"step's own) is more than this host has free now ({human_bytes(available)}); free memory, or "
        "rehearse with fewer --anchors or a shorter --mean-tokens"
    )


def _figures(
    runs: dict[str, StageRun],
    env: dict[str, str],
    plan: dict[str, Any],
    baseline: int,
    mapped: int,
    log: Callable[[str], None],
) -> list[Figure]:
    """Every measured figure beside the plan's for the same configuration."""
    from dagster import AssetKey, DagsterInstance

    from dflash_assets.orchestration.resources import StoreResource
    from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
    from dflash_assets.storage.manifest import StoredPartition, read_manifest
    from dflash_assets.storage.units import human_bytes

    with environment(env):
        store = StoreResource().open()
        with DagsterInstance.get() as instance:
            event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
            trained = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        prefix = f"{HIDDEN_STATES_PREFIX}/{plan['per_range'][0]['partition']}"
        objects = [
            (key, size)
            for key, size in StoredPartition(store, prefix, read_manifest(store, prefix)).object_keys()
            if key.rsplit("/", 1)[-1].startswith("hs_")
        ]
        write_rate, read_rate = _store_rates(StoreResource(), plan, objects, log)

    memory = plan["device_memory"]
    on_device = plan["device"]["kind"] == "cuda"
    per_object = plan["bytes_per_range"]["mean"] / max(1, plan["objects_per_range"]["mean"])
    split = plan.get("training_split") or {}
    ranks = int(trained.get("world_size", 1))
    drafter_rate = split.get("drafter_tokens_per_s_per_device")
    drafter_source = (split.get("sources") or {}).get("drafter", "")
    measured_basis = drafter_rate and ("measured" in drafter_source or "given" in drafter_source)
    tokens_per_step = plan["tokens"] / max(1, plan["samples"]) * ranks  # a sequence a rank a step
    steps_per_s = float(trained["tokens_per_s"]) / tokens_per_step if tokens_per_step else None
    host = "device" if on_device else "host"

    def memory_figure(stage: str, suffix: str, planned: float) -> Figure:
        run = runs[stage]
        peak = run.peak_device_bytes if on_device else run.peak_host_bytes - baseline
        return Figure(stage, f"peak {host} memory above a step's own{suffix}", peak, planned, "B")

    figures = [
        Figure(
            "hidden_state_partitions",
            "object bytes (mean)",
            sum(size for _, size in objects) / len(objects),
            per_object,
            "B",
        ),
        memory_figure("hidden_state_partitions", "", memory["extraction"]["bytes"]),
        memory_figure(
            "drafter_checkpoints",
            " (a rank)" if not mapped else f" (a rank; plan less {human_bytes(mapped)} mapped from files)",
            memory["training"]["bytes"] - mapped,
        ),
        Figure(
            "store",
            "write bytes/s (uploader, objects of this size)",
            write_rate,
            plan.get("upload_bytes_per_s_needed"),
            "B/s",
            worse="below",
            note="the plan's: to keep up with extraction on this host's devices",
        ),
        Figure(
            "store",
            "read bytes/s (objects of this size)",
            read_rate,
            (split.get("offline") or {}).get("read_bytes_per_s_needed")
            or (drafter_rate * ranks * plan["bytes_per_token"] if drafter_rate else None),
            "B/s",
            worse="below",
            note="the plan's: what its drafter rate on these ranks consumes",
        ),
        Figure(
            "drafter_checkpoints",
            "steps/s",
            steps_per_s,
            drafter_rate * ranks / tokens_per_step if drafter_rate and tokens_per_step else None,
            "1/s",
            worse="below" if measured_basis else None,
            note="" if measured_basis else f"not held: the plan's rate is an estimate ({drafter_source})",
        ),
    ]
    if on_device:
        for stage in ("hidden_state_partitions", "drafter_checkpoints"):
            figures.append(
                Figure(stage, "peak host memory", runs[stage].peak_host_bytes, None, "B", worse=None)
            )
    tokenized = runs["tokenized_completions"].peak_host_bytes
    figures.append(Figure("tokenized_completions", "peak host memory", tokenized, None, "B", worse=None))
    return figures


def format_table(figures: list[Figure], human_bytes: Callable[[float], str]) -> str:
    def show(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        if unit == "B":
            return human_bytes(value)
        if unit == "B/s":
            return f"{value / 1e9:.3f} GB/s"
        return f"{value:.4g} {unit}"

    rows = [("stage", "figure", "measured", "plan", "verdict")]
    for f in figures:
        verdict = f.verdict + (f"  {f.note}" if f.note else "")
        rows.append((f.stage, f.name, show(f.measured, f.unit), show(f.planned, f.unit), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    )


def _clean(store_url: str, env: dict[str, str], work: Path | None) -> None:
    """Delete what the rehearsal put in the store and in this host's local state for that store; the work
    folder too when the rehearsal got through (a failed one keeps its log)."""
    from dflash_assets import settings
    from dflash_assets.orchestration.resources import StoreResource

    with environment(env), contextlib.suppress(Exception):
        resource = StoreResource()
        store = resource.open()
        roots = [
            resource.staging_root(),
            settings.cache_dir() / "train-cache",
            settings.cache_dir() / "read-cache",
        ]
        for root in roots:
            shutil.rmtree(resource.local_dir(root), ignore_errors=True)
        for info in list(store.list("")):
            store.delete(info.key)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
