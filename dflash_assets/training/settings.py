"""The settings of one training run: SpecForge's DFlash recipe by default, checked when made."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dflash_assets.drafter.objective import LOSSES, Objective
from dflash_assets.training.checkpoints import (
    CheckpointPolicy,
)

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")

# Settings whose change between an interrupted run and its resumption changes the trajectory.
TRAJECTORY_SETTINGS = (
    "max_steps", "epochs", "global_batch_size", "lr", "warmup_ratio", "lr_schedule", "lr_decay_ratio",
    "min_lr_ratio", "weight_decay", "betas", "adam_eps", "max_grad_norm", "max_length", "num_anchors",
    "tokens_per_anchor", "gamma", "seed", "eval_samples", "loss", "dpace_alpha", "drafter_init",
    "distill_weight", "cpu_bf16_autocast", "train_samples",
)  # fmt: skip


@dataclass
class TrainSettings:
    """SpecForge's DFlash recipe by default: AdamW at 6e-4 with betas (0.9, 0.999) and no weight decay,
    4 % linear warm-up then cosine to 0, gradient clipping at 1.0, 6 epochs, 8192 tokens (the peers' length
    for reasoning targets; the 8B recipe's was 3072), 512 anchors per sequence, and a global batch
    of 32 sequences per optimiser step (4 per GPU x 8 GPUs) reached by gradient accumulation over
    micro-batches that fit the device's memory; the position weights are D-PACE's (alpha 0.5, the default
    of speculators and ModelOpt), or the paper's decay with gamma 7."""

    mode: str = "offline"  # "offline" (hidden states from the store) or "online" (target runs alongside)
    max_steps: int | None = None  # None: `epochs` full passes decide; set: exactly this many steps
    epochs: int = 6
    global_batch_size: int = 32  # sequences per optimiser step
    micro_batch_bytes: int | None = None  # activation memory per micro-batch; None: from the device
    lr: float = 6e-4
    warmup_ratio: float = 0.04  # of the total steps, linear from 0
    lr_schedule: str = "cosine"  # after warm-up: "cosine", "linear", "constant" or "wsd" (hold, then decay)
    lr_decay_ratio: float = 0.2  # "wsd": the part of the run its linear decay takes
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.0  # on matrices only, never on norms
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    max_length: int = 8192  # longer samples are truncated (their tail is not trained on)
    num_anchors: int = 512  # per sequence at most, capped by the positions that qualify
    # One anchor per this many labelled tokens of a sequence, rounded up, up to num_anchors
    # (`drafter/objective.py`'s `anchors_per_sequence`): 6 is the recipe's density at its own length (512
    # anchors in 3072 tokens), so a short answer gets proportionally fewer blocks than a long one. 1 (the
    # default): the paper's fixed count, every qualifying position up to num_anchors.
    tokens_per_anchor: float = 1.0
    loss: str = "dpace"  # position weights: "dpace" (D-PACE, from the drafter's confidences) or "decay"
    gamma: float = 7.0  # the decay's position weight exp(-(p-1)/gamma)
    dpace_alpha: float = 0.5  # D-PACE's confidence smoothing (ModelOpt's and speculators' 0.5)
    # w in (1 - w) CE + w KL from the target's own distribution (its head on its stored final state)
    distill_weight: float = 0.0
    drafter_init: str = ""  # a drafter directory in z-lab's layout to start from; empty: fresh weights
    block_size: int = 16  # must equal the drafter config's
    seed: int = 0
    checkpoint_every_steps: int | None = None
    checkpoint_every_minutes: float | None = 30.0
    # Stop once the held-out tau curve is flat (`until_flat.py`), the steps above being the cap, and export
    # the best checkpoint. Not a trajectory setting: it changes where a run ends, not its steps.
    until_flat: bool = False
    log_every_steps: int = 10
    eval_samples: int = 16  # held out from training, evaluated at every checkpoint
    # 0: every sample not held out; N: the first N of them by sample index. One capture then trains at
    # several data sizes, each measured on the same held-out samples (the held-out rule does not see N).
    train_samples: int = 0
    spec_eval_prompts: int = 8  # held-out prompts decoded speculatively with the target (0: off)
    spec_eval_max_new_tokens: int = 64
    device: str = "cpu"  # the drafter's device; online targets may live elsewhere
    attention: str = "auto"  # drafter attention: "flex" (CUDA's fused kernel), "materialised", "auto"
    bf16_autocast: bool = True  # CUDA: float32 master weights, bf16 matmuls
    cpu_bf16_autocast: bool = False  # the same on a CPU with bf16 matrix units (AMX, AVX-512 BF16)
    max_consecutive_nonfinite: int = 10  # skipped non-finite steps in a row before giving up

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.train_samples < 0:
            raise ValueError(f"train_samples {self.train_samples} must be 0 (every sample) or more")
        if self.mode not in ("offline", "online"):
            raise ValueError(f"train mode {self.mode!r} is not 'offline' or 'online' (DFLASH_TRAIN_MODE)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule {self.lr_schedule!r} is not one of {list(LR_SCHEDULES)} (DFLASH_LR_SCHEDULE)"
            )
        if not 0.0 < self.lr_decay_ratio < 1.0:
            raise ValueError(f"lr_decay_ratio must be between 0 and 1, got {self.lr_decay_ratio}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(
                f"max_steps must be positive or None, got {self.max_steps} (DFLASH_TRAIN_MAX_STEPS)"
            )
        for name in ("epochs", "global_batch_size", "max_length", "num_anchors", "log_every_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train setting {name} must be positive, got {getattr(self, name)}")
        if self.micro_batch_bytes is not None and self.micro_batch_bytes <= 0:
            raise ValueError(f"micro_batch_bytes must be positive or None, got {self.micro_batch_bytes}")
        if not self.tokens_per_anchor >= 1:
            raise ValueError(
                f"tokens_per_anchor must be at least 1 (1: every qualifying position up to num_anchors), got "
                f"{self.tokens_per_anchor}"
            )
        if self.gamma <= 0:
            raise ValueError(f"gamma must be positive, got {self.gamma}")
        if self.loss not in LOSSES:
            raise ValueError(f"drafter loss {self.loss!r} is not one of {list(LOSSES)} (DFLASH_DRAFTER_LOSS)")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha} (DFLASH_DPACE_ALPHA)")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(
                f"distill_weight must be in [0, 1], got {self.distill_weight} (DFLASH_DISTILL_WEIGHT)"
            )
        if self.spec_eval_prompts < 0 or self.spec_eval_max_new_tokens <= 0:
            raise ValueError("spec_eval_prompts must be >= 0 and spec_eval_max_new_tokens positive")
        if self.until_flat and self.eval_samples <= 0:
            raise ValueError(
                "until_flat (DFLASH_TRAIN_UNTIL_FLAT) judges the held-out tau curve, and eval_samples is 0: "
                "hold samples out (eval_samples > 0) or turn until_flat off"
            )
        # Raises early on bad checkpoint intervals rather than at the first checkpoint.
        CheckpointPolicy(self.checkpoint_every_steps, self.checkpoint_every_minutes)

    @property
    def objective(self) -> Objective:
        return Objective(
            loss=self.loss, gamma=self.gamma, dpace_alpha=self.dpace_alpha, distill_weight=self.distill_weight
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
