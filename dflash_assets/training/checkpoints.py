"""Training checkpoints: everything a run needs to continue exactly where it stopped, kept in the store.

A checkpoint is written to a local directory atomically (temp name, then rename), uploaded under
`checkpoints/<run>/step_<step:08d>/`, and committed by a small `_complete.json` marker written LAST.
A step directory without a valid marker (an upload cut short) is never resumed from.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.weights_file import save_weights
from dflash_assets.storage.layout import (
    CHECKPOINT_FILES,
    CHECKPOINT_MARKER_NAME,
    CHECKPOINTS_PREFIX,
    CONFIG_NAME,
    OPTIMIZER_NAME,
    TRAIN_SETTINGS_NAME,
    TRAINER_STATE_NAME,
    WEIGHTS_NAME,
)
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader

CHECKPOINT_FORMAT = "dflash-assets.checkpoint/2"  # 2: reference weight names and config

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, uploaded or loaded."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint in the store was incomplete or corrupt; an older one is used instead."""


@dataclass(frozen=True)
class DataPosition:
    """The next batch to train on: batch `batch_index` of epoch `epoch`'s batch order."""

    epoch: int = 0
    batch_index: int = 0


@dataclass(frozen=True)
class CheckpointRef:
    run: str
    step: int
    prefix: str  # store key prefix, e.g. "checkpoints/run-1/step_00000100"
    files: dict[str, int] = field(default_factory=dict, compare=False)  # name -> size in bytes

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"


@dataclass
class Checkpoint:
    """A checkpoint's contents, loaded onto the CPU."""

    ref: CheckpointRef
    step: int
    data_position: DataPosition
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    rng_state: dict[str, Any]
    config: DrafterConfig
    settings: dict[str, Any]
    extra: dict[str, Any]


def check_run_name(run: str) -> str:
    if not _RUN_NAME.match(run or ""):
        raise ValueError(
            f"run name {run!r} is not usable in a store key: use letters, digits, '.', '_' and '-' "
            "(set DFLASH_RUN_NAME)"
        )
    return run


def run_prefix(run: str) -> str:
    return f"{CHECKPOINTS_PREFIX}/{check_run_name(run)}"


def checkpoint_prefix(run: str, step: int) -> str:
    return f"{run_prefix(run)}/step_{step:08d}"


# --------------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The host generators, and the CUDA generator of this process's own device (one rank trains on one
    device): not every visible device's, which a resume where fewer devices are visible could not set."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], cuda: Any = None) -> None:
    """Set the generators a checkpoint saved. A CUDA state goes to this process's current device. Older
    checkpoints saved a list, one state per device visible then: the entry of the current device's index
    is used when the list has one, else the first, so a run resumed on a node with fewer visible devices
    (a lost node, a smaller pod) continues instead of failing on an index. `cuda` is `torch.cuda` (a test
    passes a stand-in to cover the GPU path on a CPU)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = torch.cuda if cuda is None else cuda
    saved = state.get("cuda")
    if saved is None or not cuda.is_available() or cuda.device_count() == 0:
        return
    if isinstance(saved, list | tuple):
        if not saved:
            return
        index = cuda.current_device()
        saved = saved[index] if index < len(saved) else saved[0]
    cuda.set_rng_state(saved)


# --------------------------------------------------------------------------------------------------
# Finding and loading checkpoints in the store
# --------------------------------------------------------------------------------------------------


def _listed_steps(store: ObjectStore, run: str) -> dict[int, dict[str, int]]:
    """step -> {file name: size} for everything under `checkpoints/<run>/`."""
    base = run_prefix(run) + "/"
    steps: dict[int, dict[str, int]] = {}
    for info in store.list(base):
        parts = info.key[len(base) :].split("/")
        match = _STEP_DIR.match(parts[0])
        if match and len(parts) == 2:
            steps.setdefault(int(match.group(1)), {})[parts[1]] = info.size
    return steps


def _fallback(message: str) -> None:
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=3)


def complete_checkpoints(store: ObjectStore, run: str) -> Iterator[CheckpointRef]:
    """Committed checkpoints of `run`, newest first. Newer step directories that are incomplete or do
    not match their marker are skipped with a CheckpointFallbackWarning naming what is wrong."""
    for step, listed in sorted(_listed_steps(store, run).items(), reverse=True):
        prefix = checkpoint_prefix(run, step)
        where = f"checkpoint {store.uri(prefix)}"
        if CHECKPOINT_MARKER_NAME not in listed:
            _fallback(f"{where} has no completion marker (upload interrupted?); using an older checkpoint")
            continue
        try:
            marker = json.loads(store.get_bytes(f"{prefix}/{CHECKPOINT_MARKER_NAME}"))
            files = {str(name): int(size) for name, size in marker["files"].items()}
        except Exception as error:  # any unreadable marker means "not committed"
            _fallback(f"{where} has an unreadable completion marker ({error}); using an older checkpoint")
            continue
        wrong = sorted(name for name, size in files.items() if listed.get(name) != size)
        if wrong:
            name = wrong[0]
            _fallback(
                f"{where} does not match its marker: {name} is {listed.get(name, 'missing')} in the store, "
                f"the marker says {files[name]} bytes; using an older checkpoint"
            )
            continue
        yield CheckpointRef(run=run, step=step, prefix=prefix, files=files)


def latest(store: ObjectStore, run: str) -> CheckpointRef | None:
    """The newest complete checkpoint of `run`, or None when it has none."""
    return next(complete_checkpoints(store, run), None)


def checkpoint_dir(local_dir: str | Path, ref: CheckpointRef) -> Path:
    """Where a checkpoint's files lie in a local directory: `<local_dir>/step_<step>`."""
    return Path(local_dir) / Path(ref.prefix).name


def download_checkpoint(store: ObjectStore, ref: CheckpointRef, local_dir: str | Path) -> Path:
    """Fetch one checkpoint's files into `<local_dir>/step_<step>/`, skipping those already there at the
    marker's size; returns that directory."""
    directory = checkpoint_dir(local_dir, ref)
    try:
        for name in ref.files:
            store.download(ref.key(name), directory / name)
    except Exception as error:
        raise CheckpointError(f"checkpoint {store.uri(ref.prefix)} cannot be downloaded: {error}") from error
    return directory


def read_checkpoint(ref: CheckpointRef, directory: str | Path, where: str = "") -> Checkpoint:
    """Load a checkpoint from a local copy of its files (`download_checkpoint`), reading nothing from the
    store: each file must have the size its marker records."""
    directory = Path(directory)
    where = where or str(directory)
    try:
        for name, size in ref.files.items():
            path = directory / name
            if not path.is_file() or path.stat().st_size != size:
                raise CheckpointError(
                    f"{path} is {'missing' if not path.is_file() else f'{path.stat().st_size} bytes'}, the "
                    f"marker says {size} bytes"
                )
        trainer_state = torch.load(directory / TRAINER_STATE_NAME, map_location="cpu", weights_only=True)
        if trainer_state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"trainer state format {trainer_state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
            )
        return Checkpoint(
            ref=ref,
            step=int(trainer_state["step"]),
            data_position=DataPosition(*trainer_state["data_position"]),
            model_state=load_file(str(directory / WEIGHTS_NAME)),
            optimizer_state=torch.load(directory / OPTIMIZER_NAME, map_location="cpu", weights_only=True),
            scheduler_state=trainer_state["scheduler"],
            rng_state=trainer_state["rng"],
            config=DrafterConfig.from_json((directory / CONFIG_NAME).read_text()),
            settings=json.loads((directory / TRAIN_SETTINGS_NAME).read_text()),
            extra=json.loads(trainer_state.get("extra_json", "{}")),
        )
    except Exception as error:
        raise CheckpointError(f"checkpoint {where} cannot be loaded: {error}") from error


def load_checkpoint(store: ObjectStore, ref: CheckpointRef, local_dir: str | Path) -> Checkpoint:
    """Download (skipping files already present at the right size) and load one checkpoint."""
    directory = download_checkpoint(store, ref, local_dir)
    return read_checkpoint(ref, directory, store.uri(ref.prefix))


def load_checkpoint_weights(
    store: ObjectStore, run: str, step: int, local_dir: str | Path
) -> dict[str, torch.Tensor]:
    """The drafter weights of `run`'s committed checkpoint at `step`, its model file alone (the best
    checkpoint of a run trained until flat, exported in place of the last)."""
    for ref in complete_checkpoints(store, run):
        if ref.step == step:
            path = checkpoint_dir(local_dir, ref) / WEIGHTS_NAME
            try:
                store.download(ref.key(WEIGHTS_NAME), path, size=ref.files.get(WEIGHTS_NAME))
                return load_file(str(path))
            except Exception as error:
                raise CheckpointError(
                    f"the weights of checkpoint {store.uri(ref.prefix)} cannot be loaded: {error}"
                ) from error
    raise CheckpointError(
        f"run {run} has no committed checkpoint at step {step} in {store.uri(run_prefix(run))}: its "
        "weights cannot be exported (was the checkpoint deleted?)"
    )


def restore_latest(store: ObjectStore, run: str, local_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint of `run` that loads; a corrupt newer one is skipped with a warning."""
    for ref in complete_checkpoints(store, run):
        try:
            return load_checkpoint(store, ref, local_dir)
        except CheckpointError as error:
            _fallback(f"{error}; using an older checkpoint")
    return None


# --------------------------------------------------------------------------------------------------
# Writing checkpoints
# --------------------------------------------------------------------------------------------------


def first_nonfinite(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The first weight or optimiser moment holding NaN or inf, named; None when every one is finite."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"weight {name}"
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return f"optimiser state {key} of {names.get(id(parameter), 'a parameter')}"
    return None


@dataclass
class CheckpointPolicy:
    """Save every `every_steps` steps and/or every `every_minutes` minutes, whichever comes first."""

    every_steps: int | None = None
    every_minutes: float | None = 30.0

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps <= 0:
            raise ValueError(f"checkpoint every_steps must be positive or None, got {self.every_steps}")
        if self.every_minutes is not None and self.every_minutes <= 0:
            raise ValueError(f"checkpoint every_minutes must be positive or None, got {self.every_minutes}")

    def due(self, step: int, last_step: int, seconds_since_last: float) -> bool:
        if self.every_steps is not None and step - last_step >= self.every_steps:
            return True
        return self.every_minutes is not None and seconds_since_last >= self.every_minutes * 60


class CheckpointManager:
    """Saves checkpoints of one run: locally at once, to the store in the background.

    At most one upload is pending: `save()` first waits for the previous one, so markers are written
    in step order and local disk holds at most two checkpoints for a moment, then only the newest.
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        local_dir: str | Path,
        *,
        policy: CheckpointPolicy | None = None,
        uploader: Uploader | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.run = check_run_name(run)
        self.local_dir = Path(local_dir)
        self.policy = policy or CheckpointPolicy()
        self._own_uploader = uploader is None
        self.uploader = uploader or Uploader(store, max_in_flight=8)
        self.clock = clock
        self.written: list[CheckpointRef] = []  # committed in the store by this manager
        self._last_step = 0
        self._last_time = clock()
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None

    def start_from(self, step: int) -> None:
        """Count the next interval from `step` (the step a run resumed at)."""
        self._last_step, self._last_time = step, self.clock()

    def due(self, step: int) -> bool:
        return self.policy.due(step, self._last_step, self.clock() - self._last_time)

    def restore_latest(self) -> Checkpoint | None:
        return restore_latest(self.store, self.run, self.local_dir)

    def save(
        self,
        *,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data_position: DataPosition,
        config: DrafterConfig,
        settings: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> CheckpointRef:
        """Write the checkpoint locally now (training may change the weights right after) and start
        its upload; the marker follows once every file is confirmed in the store."""
        self.wait()
        bad = first_nonfinite(model, optimizer)
        if bad is not None:
            # Committed, it would be the checkpoint every restart resumes from: stop instead.
            newest = f"step {self.written[-1].step}" if self.written else "the newest in the store"
            raise FloatingPointError(
                f"{bad} is not finite at step {step}: the checkpoint is not written ({newest} stays the one "
                "to resume from); lower the learning rate (run config `lr`) or check the hidden states of "
                "the samples trained on since"
            )
        self.local_dir.mkdir(parents=True, exist_ok=True)
        final = self.local_dir / f"step_{step:08d}"
        temp = self.local_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        temp.mkdir()
        try:
            save_weights(model.state_dict(), temp / WEIGHTS_NAME)  # one tensor on the host at a time
            torch.save(optimizer.state_dict(), temp / OPTIMIZER_NAME)
            trainer_state = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "data_position": [data_position.epoch, data_position.batch_index],
                "scheduler": scheduler.state_dict(),
                "rng": capture_rng_state(),
                "extra_json": json.dumps(extra or {}),
            }
            torch.save(trainer_state, temp / TRAINER_STATE_NAME)
            (temp / CONFIG_NAME).write_text(config.to_json() + "\n")
            (temp / TRAIN_SETTINGS_NAME).write_text(json.dumps(settings, indent=2, default=str) + "\n")
            if final.exists():
                shutil.rmtree(final)
            temp.rename(final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        ref = CheckpointRef(
            run=self.run,
            step=step,
            prefix=checkpoint_prefix(self.run, step),
            files={name: (final / name).stat().st_size for name in CHECKPOINT_FILES},
        )
        self._last_step, self._last_time = step, self.clock()
        self._pending = threading.Thread(target=self._upload, args=(final, ref), name="checkpoint-upload")
        self._pending.start()
        return ref

    def _upload(self, directory: Path, ref: CheckpointRef) -> None:
        try:
            marker = {
                "format": CHECKPOINT_FORMAT,
                "run": ref.run,
                "step": ref.step,
                "files": ref.files,
                "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            body = json.dumps(marker, indent=1).encode()
            self.uploader.upload_then_commit(
                {name: directory / name for name in ref.files},
                ref.prefix,
                lambda sizes: self.store.put_bytes(ref.key(CHECKPOINT_MARKER_NAME), body),
                delete_after=False,
            )
            self.written.append(ref)
            for old in self.local_dir.glob("step_*"):
                if old != directory:
                    shutil.rmtree(old, ignore_errors=True)
        except BaseException as error:  # re-raised in the training thread by wait()
            self._pending_error = error

    def upload_finished(self) -> bool:
        """True when no upload is in progress (a failed one included: `wait()` raises its error)."""
        return self._pending is None or not self._pending.is_alive()

    def wait(self) -> None:
        """Block until the pending upload is committed; raise CheckpointError if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise CheckpointError(f"checkpoint upload to {self.store.description} failed: {error}") from error

    def discard_local(self) -> None:
        """Delete the local copies of this run's checkpoints (after the last is committed)."""
        self.wait()
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._own_uploader:
                self.uploader.close()
