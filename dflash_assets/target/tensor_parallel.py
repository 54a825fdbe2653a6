"""One target replica over k devices: transformers' tensor-parallel plan, one process per device.

Every rank holds its shard of the target (`from_pretrained(..., distributed_config=DistributedConfig(
tp_size=k))`: the family's `base_model_tp_plan`, on DTensors over a mesh of the whole process group).
Under `torch.inference_mode` the plan's linear layers run on local tensors and all-reduce (or gather) their
outputs, so what a decoder layer returns is the whole hidden state, the same on every rank: a forward hook
reads it as on one device (`HiddenStateCapture` checks for a DTensor all the same).

Every rank must run the same forwards in the same order, or the collectives inside them never meet. Rank 0
(the leader) runs the stage (a range's extraction, a generation server) and, before each forward, sends
the followers what it is about to run over a gloo group of its own (`TargetGroup.send`); the followers
run it too and throw their copy away (`TargetGroup.follow`). Every wait has the group's timeout; a leader
with nothing to send for a while sends a heartbeat, so a follower tells an idle leader from a dead one.

A rank that runs out of memory ends them all (`fail_fast_on_out_of_memory`): the other ranks are inside
the same forward, waiting in a collective the failed rank will never reach, so a batch cannot be halved
on one rank alone (its smaller forward's collectives would pair with the others' leftovers). The rank's
error ends its process, torch.distributed's launcher stops the others, and the range's next run resumes
from the store with a smaller token budget.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_assets.settings import environment as settings_environment
from dflash_assets.storage.faults import fault_point
from dflash_assets.target.model import (
    MODEL_SETTING,
    TargetModelError,
    config_value,
    quiet_left_out_lm_head,
    text_config,
)

TP_SETTING = "DFLASH_TARGET_TP"
STOP, PING = "stop", "ping"


class TensorParallelUnsupported(ValueError):
    """The target cannot be split over the configured number of devices: the message says what to do."""


class SplitTargetOutOfMemory(RuntimeError):
    """A rank of a split target ran out of device memory: the message says which, and what to lower.
    Not a `torch.OutOfMemoryError`, so no handler that halves a batch on one device catches it."""


@contextlib.contextmanager
def fail_fast_on_out_of_memory(rank: int, size: int, device: Any, what: str, lower: str) -> Iterator[None]:
    """Turn an out-of-memory on this rank into `SplitTargetOutOfMemory` (see the module docstring):
    `what` ran out (e.g. "a batch of 8 samples x 2,048 tokens"), `lower` is the setting that makes it
    smaller."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        raise SplitTargetOutOfMemory(
            f"rank {rank} of the target split over {size} devices ran out of memory on {device} for {what} "
            f"({first}): the other ranks are inside the same forward, so the batch cannot be halved on one "
            f"rank alone and every rank stops; lower {lower}, then run the range again (it resumes from "
            "what the store holds)"
        ) from None


def tensor_parallel_plan(config: Any) -> dict[str, str] | None:
    """The family's tensor-parallel plan (`base_model_tp_plan` of its text config), or None."""
    plan = getattr(text_config(config), "base_model_tp_plan", None)
    return dict(plan) if plan else None


def head_counts(config: Any) -> dict[str, int]:
    """The head counts a tensor-parallel split must divide (query and key/value heads of attention)."""
    text = text_config(config)
    counts = {}
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = config_value(text, key)
        if isinstance(value, int) and value > 0:
            counts[key] = value
    return counts


def valid_tp_sizes(config: Any, limit: int = 64) -> list[int]:
    """Device counts up to `limit` that divide every head count (1 always)."""
    counts = head_counts(config).values()
    return [k for k in range(1, limit + 1) if all(count % k == 0 for count in counts)]


def check_tensor_parallel(config: Any, tp: int, *, stage: str) -> None:
    """Raise `TensorParallelUnsupported` when `config`'s target cannot span `tp` devices in `stage`
    ("capture", "regeneration"): a family without a plan, or heads `tp` does not divide. Called before
    any device is leased."""
    if tp <= 1:
        return
    model_type = config_value(text_config(config), "model_type") or config_value(config, "model_type")
    if tensor_parallel_plan(config) is None:
        instead = {
            "regeneration": (
                "serve the target with an OpenAI-compatible server that splits it itself (vLLM "
                "`--tensor-parallel-size`, SGLang `--tp`) and set DFLASH_GENERATE_URL to it"
            ),
            "capture": (
                f"set {TP_SETTING}=1 on a device that holds the whole target (`dflash-assets plan` says "
                "how much each stage needs), or use a target family with a plan: qwen3, qwen3_moe, "
                "qwen3_next, qwen3_5_text, qwen3_5_moe_text"
            ),
        }.get(stage, f"set {TP_SETTING}=1")
        raise TensorParallelUnsupported(
            f"{TP_SETTING}={tp}: transformers has no tensor-parallel plan for model type {model_type!r} "
            f"(no `base_model_tp_plan` in its config), so its {stage} cannot be split over devices: {instead}"
        )
    counts = head_counts(config)
    bad = {key: value for key, value in counts.items() if value % tp}
    if bad:
        choices = ", ".join(str(k) for k in valid_tp_sizes(config, limit=max(8, tp)))
        heads = ", ".join(f"{key}={value}" for key, value in bad.items())
        raise TensorParallelUnsupported(
            f"{TP_SETTING}={tp} does not divide the {model_type} target's heads ({heads}): each device "
            f"holds whole heads. Choose one of {choices}"
        )


def read_config(model_dir: str | Path) -> Any:
    """The target's config as transformers builds it (its class carries the tensor-parallel plan)."""
    from transformers import AutoConfig

    path = Path(model_dir).expanduser()
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        message = f"cannot read the target config in {str(path)!r}: {error} ({MODEL_SETTING})"
        raise TargetModelError(message) from error


# ------------------------------------------------------------------------------------------ the group


class TargetGroup:
    """This process as one rank of a target replica split over `size` devices (gloo on the CPU, NCCL on
    CUDA), with a gloo channel on which the leader says what to run next."""

    def __init__(self, device: torch.device, timeout_s: float, heartbeat_s: float | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.device = device
        self.timeout_s = timeout_s
        self.rank = int(os.environ["RANK"])
        self.size = int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend=backend, timeout=timeout, **extra)  # env://, from the launcher
        self._channel = dist.new_group(backend="gloo", timeout=timeout)
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._heartbeat_s = heartbeat_s if heartbeat_s is not None else max(1.0, timeout_s / 4)
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        self._dist.all_gather_object(gathered, value, group=self._channel)
        return gathered

    # -------------------------------------------------------------------------------------- leader

    def send(self, command: str, *payload: Any) -> None:
        """Leader: tell every follower to run `command(*payload)` (then run it here)."""
        with self._lock:
            self._dist.broadcast_object_list([(command, payload)], src=0, group=self._channel)
            self._last_sent = time.monotonic()

    def start_heartbeat(self) -> None:
        """Leader: a ping whenever nothing was sent for a while (uploads, store listings, a slow step)."""

        def beat() -> None:
            while not self._stop_heartbeat.wait(min(1.0, self._heartbeat_s)):
                if time.monotonic() - self._last_sent >= self._heartbeat_s:
                    with contextlib.suppress(Exception):  # a dead follower: the next command says so
                        self.send(PING)

        self._heartbeat = threading.Thread(target=beat, name="target-group-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_followers(self) -> None:
        """Leader: end every follower's loop (after the last forward)."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self.send(STOP)

    # ------------------------------------------------------------------------------------ follower

    def follow(self, handlers: Mapping[str, Callable[..., Any]]) -> int:
        """Follower: run what the leader sends until it says stop; returns the commands run. A leader
        silent past the timeout (no heartbeat either) raises here."""
        done = 0
        while True:
            box: list[Any] = [None]
            self._dist.broadcast_object_list(box, src=0, group=self._channel)
            command, payload = box[0]
            if command == STOP:
                return done
            if command == PING:
                continue
            fault_point("target_rank_command")  # crash tests: a follower dies mid-range
            handler = handlers.get(command)
            if handler is None:
                raise RuntimeError(f"rank {self.rank}: the leader sent an unknown command {command!r}")
            handler(*payload)
            done += 1

    def close(self) -> None:
        self._stop_heartbeat.set()
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def load_target_shard(
    model_dir: str | Path,
    device: torch.device,
    tp: int,
    dtype: torch.dtype | None = None,
    *,
    lm_head: bool = True,
):
    """This rank's shard of the target, straight onto `device` (each rank reads only its slices of the
    checkpoint). The process group must be up (`TargetGroup`). `lm_head=False` leaves the LM head out
    (`AutoModel`), as one device's capture does: capture never reads logits."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    auto = AutoModelForCausalLM if lm_head else AutoModel

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = Path(model_dir).expanduser()
    # transformers binds a rank to the accelerator numbered LOCAL_RANK; a rank here leases whichever device
    # is free, so it says which one it leased.
    environment = {"LOCAL_RANK": str(device.index or 0)} if device.type == "cuda" else {}
    with settings_environment(environment), contextlib.nullcontext() if lm_head else quiet_left_out_lm_head():
        try:
            model = auto.from_pretrained(path, dtype=dtype, distributed_config=DistributedConfig(tp_size=tp))
        except (OSError, ValueError, KeyError) as error:
            raise TargetModelError(
                f"cannot load the target from {str(path)!r} over {tp} devices: {error} ({MODEL_SETTING})"
            ) from error
    return model.eval()


def full_tensor(hidden: torch.Tensor) -> torch.Tensor:
    """A layer output as one whole tensor: a DTensor (a plan that leaves it sharded) is gathered."""
    from torch.distributed.tensor import DTensor

    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())
