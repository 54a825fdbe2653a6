"""Device memory of training and of its speculative evaluation, and the check before the target is loaded.

Offline training loads the whole target beside the drafter's weights and AdamW state for every
speculative evaluation: a 27B target is ~55 GB in bf16, and the `dflash` drafter for it (~1.7 B
parameters) keeps ~20 GB of float32 weights and optimiser state between steps (its gradients are freed
after each step). The first checkpoint must not end a multi-day run with an out-of-memory error, so
before loading the target the trainer estimates what the evaluation needs and, in this order:

1. loads it beside the drafter when it fits there;
2. else loads it on another leased device with the room (the drafter stays; only the target's context
   states for each drafted block cross between the devices);
3. else moves the optimiser state to host memory for the evaluation, when that makes the room, and moves
   it back afterwards (the same values: the trajectory is unchanged);
4. else skips the evaluation with a warning naming the setting (`spec_eval_prompts: 0`).

A load or an evaluation that runs out of memory all the same (the estimate is an estimate) is caught,
reported the same way and skipped: the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import drafter_parameter_count
from dflash_assets.drafter.objective import estimate_step_bytes
from dflash_assets.drafter.speculative import TargetVerifier
from dflash_assets.storage.units import human_bytes
from dflash_assets.target.memory import (
    forward_activation_bytes,
    host_available_bytes,
    kv_cache_bytes_per_token,
    logits_bytes,
    recurrent_state_bytes,
    target_config,
    weight_bytes,
)
from dflash_assets.target.model import num_decoder_layers

SKIP_SETTING = "spec_eval_prompts: 0"
# The captured layers a decoding keeps for the whole context (bf16), at most: DFlash's 5 by default.
DRAFTER_LAYERS_KEPT = 5
# Room kept free beyond the estimate: allocator fragmentation and what the estimate leaves out.
HEADROOM_FRACTION = 0.10
HEADROOM_BYTES = 256 * 2**20
T = TypeVar("T")


# -------------------------------------------------------------------------------------------- estimates


def evaluation_target_bytes(
    target_model: str | Path, device_type: str, prompt_tokens: int, new_tokens: int
) -> int:
    """What loading the target and decoding one held-out prompt takes on a device: the weights, the KV
    cache and recurrent state twice (the committed cache and the copy each verification runs on), and the
    prefill's activations, all-layer hidden states and logits, a chunk of the prompt at a time
    (`TargetVerifier.PREFILL_CHUNK_TOKENS`), with the drafter's layers kept for the whole prompt."""
    config = target_config(target_model)
    dtype_bytes = 2 if device_type == "cuda" else 4
    tokens = prompt_tokens + new_tokens
    chunk = min(prompt_tokens, TargetVerifier.PREFILL_CHUNK_TOKENS)
    hidden = int(config["hidden_size"])
    width = (num_decoder_layers(config) + 1) * hidden  # output_hidden_states
    prefill_states = width * chunk * dtype_bytes + DRAFTER_LAYERS_KEPT * hidden * prompt_tokens * 2
    return (
        weight_bytes(target_model, device_type)
        + 2 * (kv_cache_bytes_per_token(config, dtype_bytes) * tokens + recurrent_state_bytes(config))
        + prefill_states
        + logits_bytes(config, chunk)
        + forward_activation_bytes(config, chunk, dtype_bytes)
    )


def drafter_frozen_bytes(config: DrafterConfig, dtype_bytes: int = 2) -> int:
    """The target's embedding and LM head, copied into the drafter as frozen buffers."""
    return 2 * config.vocab_size * config.hidden_size * dtype_bytes


@dataclass(frozen=True)
class TrainingMemory:
    """Device bytes of a training run by part (estimates, for the plan)."""

    weights: int  # float32 master weights
    gradients: int  # float32, alive from the first backward of a step to its optimiser update
    optimizer: int  # AdamW's two float32 moments
    frozen: int  # the target's embedding and LM head inside the drafter
    activations: int  # the smallest micro-batch: one sequence of max_length tokens

    @property
    def step_bytes(self) -> int:
        """Peak during a training step."""
        return self.weights + self.gradients + self.optimizer + self.frozen + self.activations

    @property
    def between_steps_bytes(self) -> int:
        """What stays on the device while an evaluation runs: no gradients, no activations."""
        return self.weights + self.optimizer + self.frozen


def planned_attention(device_kind: str) -> str:
    """The attention backend training runs on a device of this kind (`DFlashDrafter.attention_backend`)."""
    return "flex" if device_kind == "cuda" else "materialised"


def training_memory(
    config: DrafterConfig,
    max_length: int,
    num_anchors: int,
    frozen_dtype_bytes: int = 2,
    attention: str = "materialised",
):
    """`TrainingMemory` of a drafter of `config` trained on sequences of up to `max_length` tokens with
    the `attention` backend (flex on CUDA: `planned_attention`)."""
    parameters = drafter_parameter_count(config)
    blocks = min(num_anchors, max(max_length - 1, 1))
    return TrainingMemory(
        weights=4 * parameters,
        gradients=4 * parameters,
        optimizer=8 * parameters,
        frozen=drafter_frozen_bytes(config, frozen_dtype_bytes),
        activations=estimate_step_bytes(config, 1, max_length, blocks, attention=attention),
    )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def offload_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | str = "cpu"
) -> Callable[[], None]:
    """Move the optimiser's state tensors to `device`; returns the function that puts each back where it
    was (values unchanged; AdamW's step counters, already on the host, are not touched)."""
    target = torch.device(device)
    moved = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != target:
                moved.append((state, key, value.device))
                state[key] = value.to(target)

    def restore() -> None:
        for state, key, original in moved:
            state[key] = state[key].to(original)

    return restore


# ------------------------------------------------------------------------------------ device memory


class DeviceMemory(Protocol):
    """Free memory per device, and which devices share it (tests pass made-up figures)."""

    def free_bytes(self, device: str) -> int: ...

    def pool(self, device: str) -> str: ...


class TorchDeviceMemory:
    """What torch reports: a CUDA device's free memory after returning its cached blocks, or the host's
    available memory for a CPU lease (every `cpu:N` lease shares the host's memory)."""

    def free_bytes(self, device: str) -> int:
        from dflash_assets.target.devices import torch_device

        target = torch_device(device)
        if target.type == "cuda":
            torch.cuda.empty_cache()
            return int(torch.cuda.mem_get_info(target)[0])
        return host_available_bytes()

    def pool(self, device: str) -> str:
        return "host" if device == "cpu" or device.startswith("cpu:") else device


# ----------------------------------------------------------------------------------------- deciding


@dataclass(frozen=True)
class EvalPlacement:
    """Where the target goes for one speculative evaluation, and why (for the log)."""

    action: str  # "here", "spare" (another leased device), "offload" (optimiser state to host), "skip"
    device: str | None  # where the target is loaded; None when skipped
    message: str


def with_headroom(needed: int) -> int:
    return int(needed * (1 + HEADROOM_FRACTION)) + HEADROOM_BYTES


def place_speculative_evaluation(
    *,
    needed_bytes: int,
    drafter_device: str,
    free_bytes: int,
    offloadable_bytes: int,
    spare: tuple[str, int] | None,
) -> EvalPlacement:
    """The decision (see the module docstring), from memory figures alone: `free_bytes` on the drafter's
    device, `offloadable_bytes` that moving the optimiser state to the host would free there, and a spare
    leased device with its free bytes (None: no other device could be leased)."""
    need = with_headroom(needed_bytes)
    what = f"the target needs ~{human_bytes(needed_bytes)} for the speculative evaluation"
    here = f"{human_bytes(free_bytes)} free on {drafter_device}"
    if need <= free_bytes:
        return EvalPlacement("here", drafter_device, f"{what}; {here}")
    if spare is not None and need <= spare[1]:
        return EvalPlacement(
            "spare",
            spare[0],
            f"{what}, {here} beside the drafter: evaluating on the leased {spare[0]} "
            f"({human_bytes(spare[1])} free)",
        )
    if offloadable_bytes and need <= free_bytes + offloadable_bytes:
        return EvalPlacement(
            "offload",
            drafter_device,
            f"{what}, {here}: moving the optimiser state "
            f"({human_bytes(offloadable_bytes)}) to host memory for the evaluation",
        )
    elsewhere = f"; {spare[0]} has {human_bytes(spare[1])} free" if spare is not None else "; no other device"
    return EvalPlacement(
        "skip",
        None,
        f"{what} but {drafter_device} has {human_bytes(free_bytes)} free (+{human_bytes(offloadable_bytes)} "
        f"if the optimiser state went to the host){elsewhere}: skipping this evaluation, training goes on. "
        f"Set the drafter_checkpoints run config `{SKIP_SETTING}` to turn it off, or add a device to "
        "DFLASH_DEVICES for it",
    )


# ------------------------------------------------------------------------------------------- acting


class EvaluationTarget:
    """The target loaded for one speculative evaluation, as `target_for_evaluation` yields it.

    `run(evaluate)` calls `evaluate(target)`. The `with` block's end drops this object's reference before
    the memory is released and the optimiser state comes back, whoever still holds the object (the
    caller's `as` name outlives the block), so the target's memory is free by then."""

    def __init__(self, target: object, device: str, log: Callable[[str], None]) -> None:
        self._target: object | None = target
        self.device = device
        self._log = log

    def run(self, evaluate: Callable[[object], T]) -> T | None:
        """`evaluate(target)`, or None when it ran out of device memory (logged: the evaluation is
        skipped, training goes on). The handler ends here, before the release: its traceback holds the
        failed evaluation's frames, and with them the target and every tensor they allocated."""
        if self._target is None:
            raise RuntimeError("the evaluation's target was released: run it inside the `with` block")
        try:
            return evaluate(self._target)
        except torch.OutOfMemoryError as error:
            message = _out_of_memory_message("the speculative evaluation", self.device, error)
        self._log(message)
        return None

    def release(self) -> None:
        self._target = None


@contextlib.contextmanager
def target_for_evaluation(
    *,
    load: Callable[[str], object],
    target_model: str | Path,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    drafter_device: str,
    optimizer: torch.optim.Optimizer,
    memory: DeviceMemory,
    spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None,
    log: Callable[[str], None],
) -> Iterator[EvaluationTarget | None]:
    """Yields the target loaded where it fits (`load(device)`, held by an `EvaluationTarget`), or None
    when the evaluation is skipped.

    Afterwards the target is released, the optimiser state is back on the drafter's device and a spare
    lease is returned, in that order. An out-of-memory error while loading or evaluating is logged and
    swallowed: the caller sees the evaluation as skipped (its result stays unset). Evaluate through
    `EvaluationTarget.run`: an error that leaves the `with` block is still in flight while the block
    ends, and what its traceback holds cannot be released."""
    from dflash_assets.target.devices import torch_device

    device_type = torch_device(drafter_device).type
    try:
        needed = evaluation_target_bytes(target_model, device_type, max(map(len, prompts)), new_tokens)
    except (OSError, KeyError, ValueError) as error:
        needed = None
        log(f"WARNING: cannot estimate the target's memory ({error}); loading it beside the drafter")
    with contextlib.ExitStack() as stack:
        spare_lease = stack.enter_context(contextlib.ExitStack())  # given back early when not used
        placement = EvalPlacement("here", drafter_device, "no estimate")
        if needed is not None:
            free = memory.free_bytes(drafter_device)
            spare = None
            if with_headroom(needed) > free and spare_device is not None:
                leased = spare_lease.enter_context(spare_device())
                if leased is not None and memory.pool(leased) != memory.pool(drafter_device):
                    spare = (leased, memory.free_bytes(leased))
            separate = memory.pool(drafter_device) != memory.pool("cpu")
            offloadable = optimizer_state_bytes(optimizer) if separate else 0
            placement = place_speculative_evaluation(
                needed_bytes=needed,
                drafter_device=drafter_device,
                free_bytes=free,
                offloadable_bytes=offloadable,
                spare=spare,
            )
            log(("WARNING: " if placement.action == "skip" else "") + placement.message)
        if placement.action != "spare":
            spare_lease.close()
        if placement.action == "skip":
            yield None
            return
        if placement.action == "offload":
            stack.callback(offload_optimizer_state(optimizer, "cpu"))
        stack.callback(_release_memory, device_type)
        held = _load(load, placement.device, log)
        if held is None:
            yield None
            return
        stack.callback(held.release)  # first of the callbacks: the reference goes before the release
        try:
            yield held
        except torch.OutOfMemoryError as error:
            log(_out_of_memory_message("the speculative evaluation", placement.device, error))


def _load(load: Callable[[str], object], device: str, log: Callable[[str], None]) -> EvaluationTarget | None:
    """The loaded target, or None when loading it ran out of memory (logged after the handler has ended:
    the partly loaded weights its traceback holds are freed with it)."""
    try:
        return EvaluationTarget(load(device), device, log)
    except torch.OutOfMemoryError as error:
        message = _out_of_memory_message("loading the target", device, error)
    log(message)
    return None


def _out_of_memory_message(what: str, device: str | None, error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"WARNING: {what} ran out of memory on {device} ({first_line}); the evaluation is skipped and "
        f"training goes on. Set the drafter_checkpoints run config `{SKIP_SETTING}` to turn it off, or add "
        "a device to DFLASH_DEVICES for it"
    )


def _release_memory(device_type: str) -> None:
    # On a GPU the allocator's cache can only return what no reference cycle still holds, so cycles
    # are collected first. On the host the last reference frees the target's tensors; a full
    # collection there costs a quarter of a second per evaluation and frees nothing more.
    if device_type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
