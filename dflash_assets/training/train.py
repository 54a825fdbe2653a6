"""Training the DFlash drafter, in named parts: settings, data (offline or online), metrics, the loop.

Both modes yield the same `DrafterBatch` for the same samples, so a batch gives the same loss whether
its hidden states were captured earlier (offline: streamed from the store through a bounded cache) or
are computed now by the target (online). The data order is a pure function of (seed, epoch) and each
batch's anchors of (seed, epoch, batch index); with model, optimiser, scheduler and RNG restored from a
checkpoint, a resumed run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.evaluate import BlockMetrics, evaluate_drafter
from dflash_assets.drafter.model import (
    BlockAnchors,
    BlockLossOutput,
    DFlashDrafter,
    DrafterBatch,
    DrafterConfig,
    anchor_generator,
    dflash_loss,
    estimate_step_bytes,
    sample_anchors,
)
from dflash_assets.drafter.speculative import (
    SpeculativeEvaluator,
    TargetVerifier,
    held_out_prompts,
    stop_token_ids_of,
)
from dflash_assets.extraction.batching import pad_batch
from dflash_assets.extraction.capture import load_target_model
from dflash_assets.extraction.sample_format import HiddenStateSample, parse_sample_object_name
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.training.checkpoints import (
    CheckpointManager,
    CheckpointPolicy,
    DataPosition,
    restore_rng_state,
)
from dflash_assets.training.sample_stream import SampleStream, partition_of

# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------

# Settings whose change between an interrupted run and its resumption changes the trajectory.
_TRAJECTORY_SETTINGS = (
    "max_steps", "epochs", "global_batch_size", "lr", "warmup_ratio", "lr_schedule", "min_lr_ratio",
    "weight_decay", "betas", "adam_eps", "max_grad_norm", "max_length", "num_anchors", "gamma", "seed",
    "eval_samples",
)  # fmt: skip

GIB = 2**30


@dataclass
class TrainSettings:
    """SpecForge's DFlash recipe by default: AdamW at 6e-4 with betas (0.9, 0.999) and no weight decay,
    4 % linear warm-up then cosine to 0, gradient clipping at 1.0, 6 epochs, 3072 tokens, 512 anchors
    per sequence, gamma 7, and a global batch of 32 sequences per optimiser step (4 per GPU x 8 GPUs)
    reached by gradient accumulation over micro-batches that fit the device's memory."""

    mode: str = "offline"  # "offline" (hidden states from the store) or "online" (target runs alongside)
    max_steps: int | None = None  # None: `epochs` full passes decide; set: exactly this many steps
    epochs: int = 6
    global_batch_size: int = 32  # sequences per optimiser step
    micro_batch_bytes: int | None = None  # activation memory per micro-batch; None: from the device
    lr: float = 6e-4
    warmup_ratio: float = 0.04  # of the total steps, linear from 0
    lr_schedule: str = "cosine"  # "cosine", "linear" or "constant" after warmup
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.0  # on matrices only, never on norms
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    max_length: int = 3072  # longer samples are truncated (their tail is not trained on)
    num_anchors: int = 512  # per sequence, capped by the positions that qualify
    gamma: float = 7.0  # position weight exp(-(p-1)/gamma)
    block_size: int = 16  # must equal the drafter config's
    seed: int = 0
    checkpoint_every_steps: int | None = None
    checkpoint_every_minutes: float | None = 30.0
    log_every_steps: int = 10
    eval_samples: int = 16  # held out from training, evaluated at every checkpoint
    spec_eval_prompts: int = 8  # held-out prompts decoded speculatively with the target (0: off)
    spec_eval_max_new_tokens: int = 64
    device: str = "cpu"  # the drafter's device; online targets may live elsewhere
    attention: str = "auto"  # drafter attention: "flex" (CUDA's fused kernel), "materialised", "auto"
    bf16_autocast: bool = True  # CUDA only: float32 master weights, bf16 matmuls
    max_consecutive_nonfinite: int = 10  # skipped non-finite steps in a row before giving up

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.mode not in ("offline", "online"):
            raise ValueError(f"train mode {self.mode!r} is not 'offline' or 'online' (DFLASH_TRAIN_MODE)")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_schedule {self.lr_schedule!r} is not 'cosine', 'linear' or 'constant'")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(
                f"max_steps must be positive or None, got {self.max_steps} (DFLASH_TRAIN_MAX_STEPS)"
            )
        for name in ("epochs", "global_batch_size", "max_length", "num_anchors", "log_every_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train setting {name} must be positive, got {getattr(self, name)}")
        if self.micro_batch_bytes is not None and self.micro_batch_bytes <= 0:
            raise ValueError(f"micro_batch_bytes must be positive or None, got {self.micro_batch_bytes}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be positive, got {self.gamma}")
        if self.spec_eval_prompts < 0 or self.spec_eval_max_new_tokens <= 0:
            raise ValueError("spec_eval_prompts must be >= 0 and spec_eval_max_new_tokens positive")
        # Raises early on bad checkpoint intervals rather than at the first checkpoint.
        CheckpointPolicy(self.checkpoint_every_steps, self.checkpoint_every_minutes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Data: both modes produce DrafterBatch
# --------------------------------------------------------------------------------------------------

HiddenStatesFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OfflineData:
    """Hidden-state objects in the store, e.g. `StoredPartition.object_keys()` of several partitions."""

    store: ObjectStore
    objects: Sequence[tuple[str, int]]  # (key, size in bytes)
    cache_dir: str | Path  # owned by training: files there that it will not read soon are deleted
    cache_budget_bytes: int = 16 * 2**30
    # Token count of each object (e.g. from the partition manifest), for length bucketing. Without it,
    # lengths are estimated from object sizes: close enough to bucket, never used for correctness.
    num_tokens: Sequence[int] | None = None
    prefetch_objects: int = 16
    download_threads: int = 8
    mode: ClassVar[str] = "offline"


@dataclass
class OnlineData:
    """Tokenized samples plus the target: `target_hidden_states(input_ids [B, T], attention_mask [B, T])
    -> [B, T, K, H]`, e.g. a `capture.HiddenStateCapture`, possibly on other devices than the drafter."""

    samples: Sequence[TokenizedSample]
    target_hidden_states: HiddenStatesFn
    partitions: Sequence[str] = ()  # reported in the result
    mode: ClassVar[str] = "online"


def collate_hidden_state_samples(samples: Sequence[HiddenStateSample], max_length: int) -> DrafterBatch:
    """Right-pad stored samples (truncated to `max_length`) into one batch."""
    lengths = [min(sample.num_tokens, max_length) for sample in samples]
    input_ids, attention_mask = pad_batch(
        [s.input_ids[:n].tolist() for s, n in zip(samples, lengths, strict=True)], 0
    )
    first = samples[0].hidden_states
    hidden_states = torch.zeros((len(samples), input_ids.shape[1], *first.shape[1:]), dtype=torch.bfloat16)
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        hidden_states[row, :length] = sample.hidden_states[:length]
        loss_mask[row, :length] = sample.loss_mask[:length].bool()
    return DrafterBatch(
        input_ids=input_ids,
        loss_mask=loss_mask & attention_mask.bool(),
        hidden_states=hidden_states,
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_indices=[sample.sample_index for sample in samples],
    )


def collate_tokenized_samples(
    samples: Sequence[TokenizedSample],
    max_length: int,
    target_hidden_states: HiddenStatesFn,
    config: DrafterConfig,
) -> DrafterBatch:
    """Right-pad tokenized samples and run the target on them.

    The result is rounded to bfloat16 and zeroed on padding, exactly like stored objects, so online
    and offline training see identical inputs.
    """
    lengths = [min(sample.num_tokens, max_length) for sample in samples]
    input_ids, attention_mask = pad_batch([s.input_ids[:n] for s, n in zip(samples, lengths, strict=True)], 0)
    loss_mask, _ = pad_batch([s.loss_mask[:n] for s, n in zip(samples, lengths, strict=True)], 0)
    hidden_states = target_hidden_states(input_ids, attention_mask)
    expected = (*input_ids.shape, config.num_context_layers, config.target_hidden_size)
    if tuple(hidden_states.shape) != expected:
        raise ValueError(
            f"the target returned hidden states of shape {tuple(hidden_states.shape)} for samples "
            f"{[s.sample_index for s in samples]}, expected {expected} [B, T, K, H]; do the capture's "
            f"target layers match the drafter's {config.target_layer_ids}?"
        )
    padding = attention_mask.to(hidden_states.device)[:, :, None, None] == 0
    return DrafterBatch(
        input_ids=input_ids,
        loss_mask=loss_mask.bool() & attention_mask.bool(),
        hidden_states=hidden_states.to(torch.bfloat16).masked_fill(padding, 0),
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_indices=[s.sample_index for s in samples],
    )


class _OfflineSource:
    """Stored samples, streamed from the store in the order training will use them."""

    def __init__(self, data: OfflineData, config: DrafterConfig, settings: TrainSettings) -> None:
        self.data, self.config, self.settings = data, config, settings
        self.cache_dir = Path(data.cache_dir)
        self.objects = list(data.objects)
        if data.num_tokens is not None:
            lengths = list(data.num_tokens)
        else:
            # bf16 states + int32 id + uint8 mask per token, plus a header of ~450 bytes.
            per_token = config.num_context_layers * config.target_hidden_size * 2 + 5
            lengths = [max(1, round((size - 512) / per_token)) for _, size in self.objects]
        self.lengths = [min(n, settings.max_length) for n in lengths]
        parsed = [parse_sample_object_name(key.rsplit("/", 1)[-1]) for key, _ in self.objects]
        self.sample_indices = [index if index is not None else pos for pos, index in enumerate(parsed)]
        self.partitions = sorted({partition_of(key) for key, _ in self.objects})
        self._streams: dict[str, SampleStream] = {}

    def setup_streams(self, eval_ids: Sequence[int]) -> None:
        """Split the cache budget: evaluation gets what its largest objects need, training the rest."""
        budget = self.data.cache_budget_bytes
        eval_sizes = sorted((self.objects[i][1] for i in eval_ids), reverse=True)
        eval_budget = max(sum(eval_sizes[:2]), budget // 8) if eval_sizes else 0
        train_budget = budget - eval_budget
        largest = max(size for _, size in self.objects)
        if train_budget < largest:
            raise ValueError(
                f"sample cache budget {budget} bytes leaves {train_budget} for training, less than the "
                f"largest hidden-state object ({largest} bytes); raise the cache budget"
            )
        common = {
            "prefetch_objects": self.data.prefetch_objects,
            "download_threads": self.data.download_threads,
            "config": self.config,
        }
        self._streams["train"] = SampleStream(
            self.data.store, self.cache_dir / "train", cache_budget_bytes=train_budget, **common
        )
        if eval_budget:
            self._streams["eval"] = SampleStream(
                self.data.store, self.cache_dir / "eval", cache_budget_bytes=eval_budget, **common
            )

    def iterate(self, ids: Sequence[int], stream: str = "train") -> Iterator[HiddenStateSample]:
        for _, sample in self._streams[stream].iterate([self.objects[i] for i in ids]):
            yield sample

    def collate(self, samples: Sequence[HiddenStateSample]) -> DrafterBatch:
        return collate_hidden_state_samples(samples, self.settings.max_length)


class _OnlineSource:
    """Tokenized samples; collating a micro-batch runs the target on it."""

    def __init__(self, data: OnlineData, config: DrafterConfig, settings: TrainSettings) -> None:
        self.data, self.config, self.settings = data, config, settings
        self.samples = list(data.samples)
        self.lengths = [min(s.num_tokens, settings.max_length) for s in self.samples]
        self.sample_indices = [s.sample_index for s in self.samples]
        self.partitions = list(data.partitions)

    def setup_streams(self, eval_ids: Sequence[int]) -> None:
        pass

    def iterate(self, ids: Sequence[int], stream: str = "train") -> Iterator[TokenizedSample]:
        return (self.samples[i] for i in ids)

    def collate(self, samples: Sequence[TokenizedSample]) -> DrafterBatch:
        return collate_tokenized_samples(
            samples, self.settings.max_length, self.data.target_hidden_states, self.config
        )


def split_eval(num_samples: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): a fixed random choice for the seed, at least one sample left to train."""
    count = min(eval_samples, num_samples - 1) if num_samples > 1 else 0
    held_out = sorted(random.Random(f"dflash-eval:{seed}").sample(range(num_samples), count))
    held = set(held_out)
    return [i for i in range(num_samples) if i not in held], held_out


def epoch_plan(
    source_lengths: Sequence[int], train_ids: Sequence[int], settings: TrainSettings, epoch: int
) -> list[list[int]]:
    """Epoch `epoch`'s optimiser steps as lists of sample ids: a fresh shuffle for (seed, epoch), cut into
    global batches of `global_batch_size` sequences (the last may be smaller). Within a step, samples
    are ordered longest first, so micro-batches of neighbours carry little padding."""
    order = list(train_ids)
    random.Random(f"dflash-epoch:{settings.seed}:{epoch}").shuffle(order)
    size = settings.global_batch_size
    steps = [order[start : start + size] for start in range(0, len(order), size)]
    return [sorted(step, key=lambda i: (-source_lengths[i], i)) for step in steps]


def micro_batches(
    ids: Sequence[int],
    lengths: Sequence[int],
    config: DrafterConfig,
    settings: TrainSettings,
    budget_bytes: int,
) -> list[list[int]]:
    """`ids` (longest first) cut into consecutive micro-batches whose estimated activation memory
    (`estimate_step_bytes`, padded to the longest sample and its anchor count) fits `budget_bytes`.
    A sample that alone exceeds the budget still gets a micro-batch of its own."""
    batches: list[list[int]] = []
    for index in ids:
        candidate = [*batches[-1], index] if batches else [index]
        longest = max(lengths[i] for i in candidate)
        blocks = min(settings.num_anchors, max(longest - 1, 1))
        if batches and estimate_step_bytes(config, len(candidate), longest, blocks) <= budget_bytes:
            batches[-1] = candidate
        else:
            batches.append([index])
    return batches


def default_micro_batch_bytes(device: torch.device, reserved_bytes: int) -> int:
    """Activation memory for one micro-batch: on CUDA, 70 % of what is free once weights and optimiser
    state (`reserved_bytes`) are in place; on the CPU, 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(GIB // 4, int((free - reserved_bytes) * 0.7))
    return 4 * GIB


# --------------------------------------------------------------------------------------------------
# Optimiser and schedule
# --------------------------------------------------------------------------------------------------


def build_optimizer(model: DFlashDrafter, settings: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.adam_eps)


def lr_factor(step: int, total_steps: int, settings: TrainSettings) -> float:
    """Multiplier of `settings.lr` for the update after `step` updates: linear warmup, then decay."""
    warmup = max(1, math.ceil(settings.warmup_ratio * total_steps)) if settings.warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if settings.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if settings.lr_schedule == "cosine" else 1 - progress
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * shape


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class _Progress:
    """Training loss and throughput over the current logging window and over the whole run."""

    def __init__(self, block_size: int, start_step: int, total_steps: int) -> None:
        self.block_size, self.start_step, self.total_steps = block_size, start_step, total_steps
        self.run_started = time.monotonic()
        self.run_tokens = 0
        self.last_window: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self.window = BlockMetrics(self.block_size)
        self.window_started = time.monotonic()
        self.window_steps = 0
        self.window_micro_batches = 0

    def add(self, output: BlockLossOutput, batch: DrafterBatch) -> None:
        self.window.add(output, batch)
        self.run_tokens += batch.num_tokens

    def count_step(self, micro_batches: int) -> None:
        self.window_steps += 1
        self.window_micro_batches += micro_batches

    @property
    def tokens_per_second(self) -> float:
        elapsed = time.monotonic() - self.run_started
        return self.run_tokens / elapsed if elapsed > 0 else 0.0

    def report(self, step: int, epoch: int, epochs: int, lr: float) -> str:
        elapsed = time.monotonic() - self.window_started
        steps_done = step - self.start_step
        eta = (time.monotonic() - self.run_started) / max(1, steps_done) * (self.total_steps - step)
        loss = self.window.loss
        self.last_window = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_second": self.window.num_tokens / elapsed if elapsed > 0 else 0.0,
            "per_position_accuracy": self.window.per_position_accuracy,
            "teacher_forced_tau": self.window.teacher_forced_tau,
            "sequences_per_step": self.window.num_samples / max(1, self.window_steps),
            "micro_batches_per_step": self.window_micro_batches / max(1, self.window_steps),
            "eta_seconds": eta,
        }
        self._reset()
        loss_text = f"{loss:.4f}" if loss is not None else "n/a"
        return (
            f"step {step}/{self.total_steps} epoch {epoch + 1}/{epochs} loss {loss_text} lr {lr:.2e} "
            f"{self.last_window['sequences_per_step']:.1f} sequences/step in "
            f"{self.last_window['micro_batches_per_step']:.1f} micro-batches, "
            f"tokens/s {self.last_window['tokens_per_second']:,.0f} eta {_duration(eta)}"
        )


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    steps: int  # optimiser steps done in total (including those before a resume)
    total_steps: int
    steps_per_epoch: int
    resumed_from_step: int | None
    final_loss: float | None  # mean training loss over the last logging window
    eval: dict[str, Any] | None  # the last teacher-forced held-out evaluation
    speculative: dict[str, Any] | None  # the last speculative decoding evaluation (measured tau)
    baseline: dict[str, Any] | None  # both evaluations of the untrained weights
    per_position_accuracy: list[float | None]  # held-out if evaluated, else the last training window
    acceptance_length_tau: float | None  # measured by speculative decoding with the target
    teacher_forced_tau: float | None  # predicted from held-out labels
    tokens_per_second: float  # this process's training throughput
    checkpoints: list[str]  # store URIs committed by this process
    trained_sample_ranges: list[str]  # sample-index range keys trained on, held-out samples excluded
    eval_sample_indices: list[int]
    partitions: list[str]
    skipped_nonfinite_steps: int
    model: DFlashDrafter = field(repr=False)


def _index_ranges(indices: Sequence[int]) -> list[str]:
    """[0, 1, 2, 5] -> ["00000000-00000002", "00000005-00000005"]."""
    ranges: list[str] = []
    for index in sorted(set(indices)):
        if ranges and SampleRange.parse(ranges[-1]).end == index - 1:
            ranges[-1] = SampleRange(SampleRange.parse(ranges[-1]).start, index).key
        else:
            ranges.append(SampleRange(index, index).key)
    return ranges


class DrafterTrainer:
    """The parts of one training run, wired together: data plan, model, optimiser, checkpoints, metrics,
    and the evaluations (teacher-forced on held-out samples, speculative decoding with the target)."""

    def __init__(
        self,
        config: DrafterConfig,
        settings: TrainSettings,
        data: OfflineData | OnlineData,
        *,
        store: ObjectStore,
        run: str,
        work_dir: str | Path,
        log: Callable[[str], None] | None = None,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        uploader: Uploader | None = None,
        target_verifier: Callable[[], TargetVerifier] | None = None,
    ) -> None:
        if data.mode != settings.mode:
            raise ValueError(f"train mode is {settings.mode!r} but the data given is {data.mode!r}")
        if settings.block_size != config.block_size:
            raise ValueError(
                f"train setting block_size {settings.block_size} differs from the drafter config's "
                f"{config.block_size}"
            )
        self.config, self.settings, self.store, self.run = config, settings, store, run
        self.log = log or (lambda message: None)
        self.on_checkpoint = on_checkpoint
        self.device = torch.device(settings.device)
        self.autocast_bf16 = self.device.type == "cuda" and settings.bf16_autocast
        self._owns_target = target_verifier is None
        self._target_verifier = target_verifier or (
            lambda: TargetVerifier(
                load_target_model(config.target_model, self.device), config.target_layer_ids
            )
        )

        # Data: a fixed held-out set, then one shuffled order of global batches per epoch.
        self.source = (_OfflineSource if isinstance(data, OfflineData) else _OnlineSource)(
            data, config, settings
        )
        if not self.source.lengths:
            raise ValueError("no training samples: the data source is empty")
        self.train_ids, self.eval_ids = split_eval(
            len(self.source.lengths), settings.eval_samples, settings.seed
        )
        self.source.setup_streams(self.eval_ids)
        self._plans: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = len(self.plan(0))
        self.total_steps = settings.max_steps or self.steps_per_epoch * settings.epochs

        # Model and optimisation: the same seed gives the same initial weights.
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        self.model = DFlashDrafter.from_target(config).to(self.device).train()
        self.model.set_attention_backend(settings.attention)
        self.optimizer = build_optimizer(self.model, settings)
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, settings)
        )
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) * 4
        self.micro_batch_bytes = settings.micro_batch_bytes or default_micro_batch_bytes(
            self.device, weights_bytes
        )

        self.checkpoints = CheckpointManager(
            store,
            run,
            Path(work_dir) / "checkpoints",
            policy=CheckpointPolicy(settings.checkpoint_every_steps, settings.checkpoint_every_minutes),
            uploader=uploader,
        )
        self.step, self.position = 0, DataPosition()
        self.resumed_from: int | None = None
        self.last_saved: int | None = None
        self.last_eval: dict[str, Any] | None = None
        self.baseline: dict[str, Any] | None = None  # the evaluations of the untrained weights
        self.skipped_nonfinite = self._consecutive_nonfinite = 0
        self._pending_reports: list[dict[str, Any]] = []
        self._eval_prompts: list[list[int]] | None = None
        self._speculative: SpeculativeEvaluator | None = None
        self.progress = _Progress(config.block_size, 0, self.total_steps)
        self.log(
            f"drafter: {config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} kv heads "
            f"x {config.head_dim} ({', '.join(sorted(set(config.layer_types)))}), mask token "
            f"{config.mask_token_id} ({config.extra.get('mask_token_source', 'given')}); "
            f"{len(self.train_ids)} training samples, {len(self.eval_ids)} held out; "
            f"{self.steps_per_epoch} steps per epoch of up to {settings.global_batch_size} sequences; "
            f"{self.total_steps} steps in total; {self.model.attention_backend} attention on {self.device}"
        )

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            self._plans = {epoch: epoch_plan(self.source.lengths, self.train_ids, self.settings, epoch)}
        return self._plans[epoch]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- resume

    def resume(self) -> None:
        """Continue from the newest complete checkpoint of the run, if there is one."""
        restored = self.checkpoints.restore_latest()
        if restored is None:
            return
        current = json.loads(json.dumps(self.settings.to_dict()))  # tuples -> lists, as saved
        changed = [
            f"{name}: {restored.settings.get(name)!r} -> {current[name]!r}"
            for name in _TRAJECTORY_SETTINGS
            if restored.settings.get(name) != current[name]
        ]
        if changed:
            self.log(
                f"WARNING: resuming with changed settings ({'; '.join(changed)}); the run will not match "
                "an uninterrupted one"
            )
        self.model.load_state_dict(restored.model_state)
        self.optimizer.load_state_dict(restored.optimizer_state)
        self.scheduler.load_state_dict(restored.scheduler_state)
        restore_rng_state(restored.rng_state)
        self.step, self.position = restored.step, restored.data_position
        self.resumed_from = self.last_saved = restored.step
        self.baseline = restored.extra.get("baseline")
        self.checkpoints.start_from(self.step)
        self.progress = _Progress(self.config.block_size, self.step, self.total_steps)
        self.log(
            f"resuming run {self.run} from {self.store.uri(restored.ref.prefix)}: step {self.step}, "
            f"epoch {self.position.epoch + 1}, batch {self.position.batch_index}"
        )

    # -- one optimiser step: gradient accumulation over micro-batches

    def _anchors(self, batch: DrafterBatch, epoch: int | str) -> BlockAnchors:
        generators = [anchor_generator(self.settings.seed, epoch, index) for index in batch.sample_indices]
        return sample_anchors(batch.loss_mask, self.settings.num_anchors, generators)

    def _accumulate(self, samples: Sequence[Any], plan: Sequence[Sequence[int]], epoch: int) -> list[tuple]:
        """Forward and backward over the micro-batches `plan` of `samples`, gradients summed (not
        averaged)."""
        outputs = []
        for micro in plan:
            batch = self.source.collate([samples[i] for i in micro])
            with self._autocast():
                output = dflash_loss(self.model, batch, self._anchors(batch, epoch), self.settings.gamma)
            if torch.isfinite(output.loss) and output.weight_sum > 0:
                output.weighted_ce.backward()
            outputs.append((output, batch))
        return outputs

    def train_step(self, here: DataPosition, samples: Sequence[Any], lengths: Sequence[int]) -> None:
        """One optimiser step over one global batch. The loss is normalised by the label weight of the
        whole global batch, so any micro-batch split (including a split made after running out of
        memory) gives the same update."""
        fault_point("train_step")  # crash tests: die between steps, checkpoints possibly mid-upload
        ids = list(range(len(samples)))
        while True:
            plan = micro_batches(ids, lengths, self.config, self.settings, self.micro_batch_bytes)
            try:
                outputs = self._accumulate(samples, plan, here.epoch)
                break
            except torch.OutOfMemoryError as error:
                self.optimizer.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if max(len(micro) for micro in plan) == 1:
                    raise torch.OutOfMemoryError(
                        f"one sequence of up to {max(lengths)} tokens does not fit on {self.device} (step "
                        f"{self.step + 1}); lower max_length or num_anchors, or use a larger device"
                    ) from error
                self.micro_batch_bytes //= 2
                self.log(
                    f"WARNING: out of memory at step {self.step + 1}; micro-batch budget lowered to "
                    f"{self.micro_batch_bytes / GIB:.2f} GiB and the step redone"
                )
        bad = [o for o, _ in outputs if not torch.isfinite(o.loss)]
        sample_indices = [i for _, b in outputs for i in b.sample_indices]
        if bad:
            # Skip the update, not the data: one bad batch must not kill a day-long run.
            self.skipped_nonfinite += 1
            self._consecutive_nonfinite += 1
            self.optimizer.zero_grad(set_to_none=True)
            self.log(f"WARNING: non-finite loss at step {self.step + 1} (samples {sample_indices}); skipped")
            if self._consecutive_nonfinite > self.settings.max_consecutive_nonfinite:
                raise FloatingPointError(
                    f"{self._consecutive_nonfinite} consecutive non-finite losses (last step: samples "
                    f"{sample_indices}); lower the learning rate or check those samples' hidden states"
                )
            return
        self._consecutive_nonfinite = 0
        weight = sum(o.weight_sum for o, _ in outputs)
        if weight > 0:  # a step without a single label leaves weights and moments alone
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(weight)
            if self.settings.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for output, batch in outputs:
            self.progress.add(output, batch)
        self.progress.count_step(len(outputs))

    # -- evaluation

    def _eval_batches(self) -> Iterator[DrafterBatch]:
        micro = micro_batches(
            sorted(self.eval_ids, key=lambda i: (-self.source.lengths[i], i)),
            self.source.lengths,
            self.config,
            self.settings,
            self.micro_batch_bytes,
        )
        samples = self.source.iterate([i for batch in micro for i in batch], "eval")
        for batch in micro:
            yield self.source.collate([next(samples) for _ in batch])

    def evaluate(self) -> dict[str, Any] | None:
        """`{"teacher_forced": ..., "speculative": ...}` on the held-out samples (None without any)."""
        if not self.eval_ids:
            return None
        rows: list[tuple[list[int], list[int]]] = []  # (token ids, loss mask) of each held-out sample

        def remember(stream: Iterator[DrafterBatch]) -> Iterator[DrafterBatch]:
            for batch in stream:
                if self._eval_prompts is None:  # the first evaluation: keep the tokens, not the states
                    for row, length in enumerate(batch.lengths.tolist()):
                        ids, mask = batch.input_ids[row, :length], batch.loss_mask[row, :length]
                        rows.append((ids.tolist(), mask.tolist()))
                yield batch

        with self._autocast():
            teacher_forced = evaluate_drafter(
                self.model,
                remember(self._eval_batches()),
                gamma=self.settings.gamma,
                num_anchors=self.settings.num_anchors,
                seed=self.settings.seed,
            )
        if self._eval_prompts is None:
            limit = max(1, self.settings.max_length - self.settings.spec_eval_max_new_tokens)
            self._eval_prompts = held_out_prompts([r[0] for r in rows], [r[1] for r in rows], limit)
        return {"teacher_forced": teacher_forced, "speculative": self.speculative_evaluation()}

    def speculative_evaluation(self) -> dict[str, Any] | None:
        prompts = (self._eval_prompts or [])[: self.settings.spec_eval_prompts]
        if not prompts:
            return None
        if self._speculative is None:
            self._speculative = SpeculativeEvaluator(
                self._target_verifier(),
                prompts,
                max_new_tokens=self.settings.spec_eval_max_new_tokens,
                stop_token_ids=stop_token_ids_of(self.config.target_model),
            )
        elif self._speculative.verifier is None:
            self._speculative.verifier = self._target_verifier()
        with self._autocast():
            result = self._speculative.evaluate(self.model)
        if self._owns_target:
            # Offline, the target was loaded for this evaluation only: give its memory back to training
            # (a 27B target is ~54 GB in bf16); it is loaded again at the next checkpoint.
            self._speculative.verifier = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if not result["matches_target_greedy"]:
            self.log(
                "WARNING: speculative decoding differs from the target's greedy decoding on held-out "
                f"prompts {result['mismatched_prompts']} (ties in the target's logits, or a verification bug)"
            )
        return result

    # -- checkpoints

    def save_checkpoint(self) -> None:
        ref = self.checkpoints.save(
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_position=self.position,
            config=self.config,
            settings=self.settings.to_dict(),
            extra={
                "eval_sample_indices": [self.source.sample_indices[i] for i in self.eval_ids],
                "baseline": self.baseline,
            },
        )
        self.last_eval = self.evaluate()  # overlaps the upload
        self.last_saved = self.step
        self._queue_report(self.step, self.store.uri(ref.prefix))

    def _queue_report(self, step: int, checkpoint_uri: str | None) -> None:
        self._pending_reports.append(
            {
                "step": step,
                "checkpoint": checkpoint_uri,
                "epoch": self.position.epoch,
                "train": self.progress.last_window or None,
                "tokens_per_second": self.progress.tokens_per_second,
                "eval": (self.last_eval or {}).get("teacher_forced"),
                "speculative": (self.last_eval or {}).get("speculative"),
            }
        )

    def report_committed(self, *, block: bool) -> None:
        """Tell `on_checkpoint` about checkpoints once committed; training goes on during uploads."""
        if self._pending_reports and (block or self.checkpoints.upload_finished()):
            self.checkpoints.wait()
            for report in self._pending_reports:
                if self.on_checkpoint is not None:
                    self.on_checkpoint(report)
            self._pending_reports.clear()

    # -- the loop

    def train(self) -> TrainResult:
        try:
            if self.step == 0 and self.baseline is None:
                # What an untrained drafter of this architecture achieves, measured the same way.
                self.last_eval = self.baseline = self.evaluate()
                self._queue_report(0, None)
                self.report_committed(block=True)
            if self.step < self.total_steps:
                self._train_steps()
            if self.last_saved != self.step:
                self.save_checkpoint()
            self.report_committed(block=True)
        finally:
            self.checkpoints.close()
        return self.result()

    def _train_steps(self) -> None:
        """Steps from `self.position` to `total_steps`; one streamed pass over the data per epoch (a
        sample appears once per pass, so the streaming cache never holds two copies of it)."""
        epoch, start = self.position.epoch, self.position.batch_index
        while self.step < self.total_steps:
            plan = self.plan(epoch)
            steps = plan[start : start + self.total_steps - self.step]
            samples = self.source.iterate([i for ids in steps for i in ids])
            with contextlib.closing(samples):
                for index, ids in enumerate(steps, start=start):
                    here = DataPosition(epoch, index)
                    self.train_step(here, [next(samples) for _ in ids], [self.source.lengths[i] for i in ids])
                    lr = self.optimizer.param_groups[0]["lr"]
                    self.scheduler.step()
                    self.step += 1
                    last = index + 1 == len(plan)
                    self.position = DataPosition(epoch + 1, 0) if last else DataPosition(epoch, index + 1)
                    if self.step % self.settings.log_every_steps == 0 or self.step == self.total_steps:
                        self.log(self.progress.report(self.step, epoch, self.epochs_total, lr))
                    if self.step >= self.total_steps:
                        return
                    if self.checkpoints.due(self.step):
                        self.save_checkpoint()
                    self.report_committed(block=False)
            epoch, start = epoch + 1, 0

    @property
    def epochs_total(self) -> int:
        return math.ceil(self.total_steps / max(1, self.steps_per_epoch))

    def result(self) -> TrainResult:
        window = self.progress.last_window
        evaluation = self.last_eval or {}
        teacher_forced = evaluation.get("teacher_forced") or window or {}
        speculative = evaluation.get("speculative") or {}
        return TrainResult(
            steps=self.step,
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            resumed_from_step=self.resumed_from,
            final_loss=window.get("loss") if window else None,
            eval=evaluation.get("teacher_forced"),
            speculative=evaluation.get("speculative"),
            baseline=self.baseline,
            per_position_accuracy=teacher_forced.get("per_position_accuracy") or [],
            acceptance_length_tau=speculative.get("acceptance_length_tau"),
            teacher_forced_tau=teacher_forced.get("teacher_forced_tau"),
            tokens_per_second=self.progress.tokens_per_second,
            checkpoints=[self.store.uri(ref.prefix) for ref in self.checkpoints.written],
            trained_sample_ranges=_index_ranges([self.source.sample_indices[i] for i in self.train_ids]),
            eval_sample_indices=[self.source.sample_indices[i] for i in self.eval_ids],
            partitions=list(self.source.partitions),
            skipped_nonfinite_steps=self.skipped_nonfinite,
            model=self.model,
        )


def train_drafter(
    config: DrafterConfig,
    settings: TrainSettings,
    data: OfflineData | OnlineData,
    *,
    store: ObjectStore,
    run: str,
    work_dir: str | Path,
    log: Callable[[str], None] | None = None,
    on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
    uploader: Uploader | None = None,
    target_verifier: Callable[[], TargetVerifier] | None = None,
) -> TrainResult:
    """Train a drafter, resuming from the newest complete checkpoint of `run` in `store` if any.

    Checkpoints go to `checkpoints/<run>/`. `log` gets a progress line every `log_every_steps` steps;
    `on_checkpoint` gets a dict (step, checkpoint URI, training and held-out metrics) once each
    checkpoint is committed. Uploads run in the background while training continues; the final
    checkpoint is committed before this returns.
    """
    trainer = DrafterTrainer(
        config,
        settings,
        data,
        store=store,
        run=run,
        work_dir=work_dir,
        log=log,
        on_checkpoint=on_checkpoint,
        uploader=uploader,
        target_verifier=target_verifier,
    )
    trainer.resume()
    return trainer.train()
