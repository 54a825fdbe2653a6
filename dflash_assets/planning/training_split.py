"""How a node's devices are split between the drafter's ranks and target replicas, and how fast each split
trains: what `dflash-assets plan` recommends and `DFLASH_TRAIN_NPROC_PER_NODE=auto` takes.

The shapes training runs, on each of N nodes of G devices (`training/job.py`, `training/rank.py`):

- online, dedicated: D drafter ranks, each owning k >= 1 devices that run target replicas
  (D·(1 + k) <= G). A rank's replicas make k·t tokens/s of hidden states and its drafter trains on d, so
  the node trains `min(D·d, D·k·t)` tokens/s: the slower side sets the pace, the other waits;
- online, co-located (k = 0): D <= G ranks, each running the target on its own device between its steps
  (time-sharing it): `D / (1/t + 1/d)`. The target's weights and forward and the drafter's training
  memory must fit one device;
- offline: every device trains on stored hidden states (D = G): `G·d`.

t is one device's target forward through the last captured layer (tokens/s), d one device's drafter
training step; both count a sequence's tokens, as the trainer's tokens/s does. The dedicated formula
assumes the target's forward overlaps the drafter's step, so each split also carries its rate without
any overlap, `D / (1/(k·t) + 1/d)`. The trainer overlaps them: with target devices of its own, a rank
runs the target on its next micro-batch (the next step's first, after a step's last) on a thread of its
own while the drafter trains on this one (`training/data.py`, `OnlineSource.prepare`). Co-location has
no overlap to lose.

Across N > 1 nodes every step ends with the gradient all-reduce: a ring sends 2(N-1)/N of the drafter's
float32 gradients (its trainable parameters × 4 bytes) through each node's link to the others
(`--inter-node-gbps`, GB/s: 10^9 bytes a second, default `DEFAULT_INTER_NODE_GBPS`), counted after the
step's compute (an upper bound: DDP's reducer overlaps the sum with a rank's last backward,
`training/distributed.py`). A step of B tokens (the global batch of `global_batch_size` samples of the
mean length) that the N nodes compute at r tokens/s then takes B/r + A seconds: the split trains
B / (B/r + A) tokens/s. Within a node the devices' own links are taken as free.

Offline, every rank reads its samples from the store: at most S / b tokens/s, S the store's read rate
(`--store-gbps`, GB/s, or `dflash-assets bench --only store`'s saved measurement; one figure for the
whole run, however many nodes read) and b the stored bytes a token. Reading runs ahead of training, so
a step takes the longer of its compute (with the all-reduce) and its bytes' reading. With S unknown the
plan gives the ranks' compute rate and the read rate they need for it, and warns.

The choice between online and offline in each stored dtype (`choose_mode`) is made from days, offline's
extraction included, and within `CHOICE_TIE_FRACTION` of the fewest from the bytes stored; an offline
rate that rests on an unmeasured store is never chosen.

Ranking: the feasible splits (they fit the device's memory, with the trainer's own headroom of 10 % +
256 MiB) by tokens/s; splits within `TIE_FRACTION` of the fastest count as equal (the figures are
estimates) and the one on fewer devices wins, then the one that loses least without overlap.

Where t and d come from, in order: d given (`plan --train-tokens-per-s`); a `bench --gpu` measurement
on this device (scaled to this target or drafter by FLOPs per token) or its MFU on another; for d, the
seeds' 25.1 K tokens/s of one GPU training the Qwen3.6-27B drafter, scaled by FLOPs per token to this
drafter (CUDA devices); else FLOPs per token at a stated MFU of the device's peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_assets.drafter.config import DrafterConfig, drafter_shape
from dflash_assets.drafter.model import dflash2_parameter_counts, drafter_parameter_count
from dflash_assets.planning.capacity import (
    SEED_TRAIN_TOKENS_PER_S,
    STATED_MFU,
    DeviceProfile,
    TargetFacts,
    forward_rate,
)
from dflash_assets.planning.memory import online_target_bytes
from dflash_assets.storage.units import human_bytes
from dflash_assets.training.memory import (
    TrainingMemory,
    planned_attention,
    training_memory,
    with_headroom,
)

TIE_FRACTION = 0.02
CHOICE_TIE_FRACTION = 0.05  # days this close count as equal when choosing online, offline or fp8
ALTERNATIVES = 2
# A node's link to the others when none is given (--inter-node-gbps): 200 Gb/s, one common NIC. H200
# nodes with InfiniBand or EFA have 8 × 400 Gb/s (400 GB/s): give the real figure.
DEFAULT_INTER_NODE_GBPS = 25.0
GB = 1e9  # the plan's GB/s are 10^9 bytes a second
# The seeds' run: 25.1 K tokens/s for 5.1 days is 11.06 B tokens, 6 epochs of 914,000 samples: a mean of
# 2,017 tokens a sample. Their drafter: Qwen3.6-27B's (hidden 5120, MLP 17408, vocabulary 248,320, the
# published sliding-window shape, 5 layers over layers [1, 16, 31, 46, 61] of 64).
SEED_MEAN_TOKENS = 2017
SEED_NUM_ANCHORS = 512
SEED_MAX_LENGTH = 3072
SEED_GLOBAL_BATCH = 32  # sequences a step: the recipe's (`TrainSettings.global_batch_size`)


def seed_drafter_config() -> DrafterConfig:
    """The drafter the seeds' 25.1 K tokens/s was measured training."""
    target = {"hidden_size": 5120, "intermediate_size": 17408}
    return DrafterConfig(
        hidden_size=5120,
        vocab_size=248320,
        mask_token_id=248070,
        target_layer_ids=[1, 16, 31, 46, 61],
        target_num_hidden_layers=64,
        **drafter_shape(target, "dflash-swa", 5),
    )


# ------------------------------------------------------------------------------------------ FLOPs


def _mean_visible_context(length: int, window: int | None) -> float:
    """Context keys a block sees on average, its anchor uniform over the sequence: L/2, or with a
    sliding window w < L, E[min(a, w)] = w - w²/(2L)."""
    if window is None or length <= window:
        return length / 2
    return window - window * window / (2 * length)


def drafter_step_flops(config: DrafterConfig, sequence_tokens: int, num_anchors: int) -> float:
    """Model FLOPs of training the drafter on one sequence of L tokens (forward and backward).

    With N = min(num_anchors, L - 1) blocks of S = block_size slots (P = N·S slots, R = N·(S - 1)
    labelled: every drafted slot, an upper bound), W = the drafter layers' weights, K·H·D = the context
    projection `fc`, c = kv heads × head_dim, A = query heads × head_dim, V = the vocabulary:

        layers     3 · 2·P·W                    forward, input gradient, weight gradient (DFlash2's
                                                convolutions' projections included)
        fc         2 · 2·L·K·H·D                forward, weight gradient (the target's states need none)
        context kv 3 · 2·L·(2·D·c)·layers       each layer's k and v of the context
        attention  3 · 4·P·A·Σ_layers (v̄ + S)  scores and values; v̄ = context keys a slot sees on
                                                average: L/2, or w - w²/(2L) on a sliding layer (w < L)
        LM head    3 · 2·R·V·D                  forward, its recompute in backward (the objective
                                                checkpoints the logits in chunks), input gradient; the
                                                head is frozen: no weight gradient
        selector   `selector_step_flops`        DFlash2 only

    `bench/drafter_step.py`'s `step_flops` counts the same but triples `fc` (3 · 2·L·K·H·D: it counts
    an input gradient the target's states never get) and uses L/2 on every layer; a test holds the two
    to that difference.
    """
    length = max(int(sequence_tokens), 0)
    blocks = min(num_anchors, max(length - 1, 0))
    slots = blocks * config.block_size
    labelled = blocks * (config.block_size - 1)
    width, hidden = config.num_heads * config.head_dim, config.hidden_size
    context_weights = config.num_context_layers * config.target_hidden_size * hidden
    _, selector_weights = dflash2_parameter_counts(config)  # its codebooks are looked up, not multiplied
    layer_weights = drafter_parameter_count(config) - context_weights - selector_weights
    kv_weights = 2 * hidden * config.num_kv_heads * config.head_dim * config.num_layers
    layers = 3 * 2 * slots * layer_weights
    fc = 2 * 2 * length * context_weights
    context_kv = 3 * 2 * length * kv_weights
    attention = 0.0
    for kind in config.layer_types:
        window = config.sliding_window if kind == "sliding_attention" else None
        attention += 3 * 4 * slots * width * (_mean_visible_context(length, window) + config.block_size)
    lm_head = 3 * 2 * labelled * config.vocab_size * hidden
    return float(layers + fc + context_kv + attention + lm_head + selector_step_flops(config, labelled))


def selector_step_flops(config: DrafterConfig, labelled: int) -> float:
    """DFlash2's selector over R labelled slots, forward and backward (x3): its hidden projection
    (2·R·D·rank) and each slot's K pair scores (2·R·K·rank). Zero for DFlash."""
    if not config.has_selector:
        return 0.0
    rank = config.selector_rank
    return float(3 * 2 * labelled * rank * (config.hidden_size + config.selector_top_k))


def drafter_flops_per_token(
    config: DrafterConfig, lengths: Sequence[int], num_anchors: int, max_length: int
) -> float:
    """Training FLOPs per sequence token over samples of `lengths` (each truncated at `max_length`, as
    training does): the per-sequence count summed, divided by the tokens. Short sequences cost more per
    token (their blocks are a larger share of them)."""
    kept = [min(int(n), max_length) for n in lengths if n > 0] or [max_length]
    return sum(drafter_step_flops(config, n, num_anchors) for n in kept) / sum(kept)


def seed_flops_per_token() -> float:
    """The seeds' drafter's training FLOPs per token at their mean sample length."""
    seed = seed_drafter_config()
    return drafter_flops_per_token(seed, [SEED_MEAN_TOKENS], SEED_NUM_ANCHORS, SEED_MAX_LENGTH)


# ------------------------------------------------------------------------------------------ rates


def drafter_rate(
    drafter_flops: float,
    device: DeviceProfile,
    gpu_result: dict[str, Any] | None,
    *,
    given: float | None = None,
    mfu: float = STATED_MFU,
) -> tuple[float | None, str]:
    """(tokens/s of one device training the drafter, where the figure comes from); `drafter_flops` from
    `drafter_flops_per_token`."""
    if given:
        return given, "the rate given with --train-tokens-per-s"
    step = (gpu_result or {}).get("drafter_step") or {}
    if step.get("tokens_per_s") and step.get("flops_per_token"):
        when = gpu_result.get("measured_at", "")
        measured_on = f"`dflash-assets bench --gpu` on {gpu_result['device']} ({when})"
        if gpu_result["device"] == device.name:
            rate = step["tokens_per_s"] * step["flops_per_token"] / drafter_flops
            return rate, (
                f"{measured_on}: the {step.get('shape', 'drafter')} step at {step['tokens_per_s']:,.0f} "
                "tokens/s, scaled to this drafter by FLOPs per token"
            )
        if step.get("mfu") and device.peak_flops:
            return step["mfu"] * device.peak_flops / drafter_flops, (
                f"{measured_on}: the drafter step at {step['mfu']:.1%} MFU, applied to {device.name}'s peak"
            )
    if device.kind == "cuda":
        seed = seed_flops_per_token()
        return SEED_TRAIN_TOKENS_PER_S * seed / drafter_flops, (
            f"the seeds' measured {SEED_TRAIN_TOKENS_PER_S / 1e3:.1f} K tokens/s of one GPU training the "
            f"Qwen3.6-27B drafter ({seed:.3g} FLOPs a token at {SEED_MEAN_TOKENS:,} tokens a sample), scaled "
            f"by FLOPs per token ({drafter_flops:.3g} here); `dflash-assets bench --gpu` measures it"
        )
    if device.peak_flops is None:
        return None, (
            f"no peak known for {device.name}: set DFLASH_PEAK_TFLOPS or run `dflash-assets bench --gpu`"
        )
    return mfu * device.peak_flops / drafter_flops, (
        f"{drafter_flops:.3g} FLOPs per token at a stated {mfu:.0%} MFU of {device.name}'s "
        f"{device.peak_flops / 1e12:,.1f} TFLOP/s"
    )


# ------------------------------------------------------------------------------------------ splits


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _duration(days: float) -> str:
    if days >= 1 or days != days or days == float("inf"):
        return f"{days:,.1f} days"
    return f"{days * 24:.1f} h" if days * 24 >= 1 else f"{days * 1440:.1f} min"


def _rate(bytes_per_s: float) -> str:
    """A read rate both ways users quote one: 9.6 GiB/s (10.3 GB/s)."""
    return f"{human_bytes(bytes_per_s)}/s ({bytes_per_s / GB:,.1f} GB/s)"


def _needs(bytes_per_s: float, ranks: int) -> str:
    """What `ranks` read: "9.6 GiB/s from the store for 8 ranks (10.3 GB/s; 1.2 GiB/s a rank)"."""
    return (
        f"{human_bytes(bytes_per_s)}/s from the store for {_count(ranks, 'rank')} "
        f"({bytes_per_s / GB:,.1f} GB/s; {human_bytes(bytes_per_s / max(1, ranks))}/s a rank)"
    )


def _tokens(count: float) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M")):
        if count >= size:
            return f"{count / size:,.2f} {unit}"
    return f"{count:,.0f}"


@dataclass(frozen=True)
class NodeFigures:
    """What the split is chosen from (made-up figures in tests)."""

    gpus_per_node: int
    nodes: int
    target_tokens_per_s: float  # t: one device's target forward
    drafter_tokens_per_s: float  # d: one device's drafter training step
    device_memory_bytes: int
    target_device_bytes: int  # the target's weights, one micro-batch's forward and its captured states
    training: TrainingMemory  # the drafter's training memory on one rank (replicated weights: DDP)
    tokens_to_train: float  # tokens per epoch × epochs
    # Devices one target replica spans (DFLASH_TARGET_TP): its layers split over them, one device's speed;
    # a rank's target devices then come in multiples of it, and the target never shares a device.
    target_span: int = 1
    step_tokens: float = 0.0  # one global batch's tokens (with `allreduce_seconds`)
    allreduce_seconds: float = 0.0  # the gradient all-reduce between nodes, a step (0: one node)
    bytes_per_token: float = 0.0  # stored hidden-state bytes a token (offline reads)
    store_bytes_per_s: float | None = None  # what the store delivers to the run (None: unknown)

    def with_allreduce(self, compute_tokens_per_s: float) -> float:
        """The run's tokens/s once every step also waits for the gradient all-reduce."""
        if self.allreduce_seconds <= 0 or self.step_tokens <= 0 or compute_tokens_per_s <= 0:
            return compute_tokens_per_s
        return self.step_tokens / (self.step_tokens / compute_tokens_per_s + self.allreduce_seconds)


@dataclass(frozen=True)
class Split:
    """One way to use a node: D drafter ranks, each with k target devices (0: the target shares its
    device), and what it gives over the whole run."""

    drafter_ranks: int  # per node
    target_devices_per_rank: int  # 0: co-located
    gpus_per_node: int  # devices it uses on each node
    tokens_per_s: float  # the whole run's, every rank of every node summed
    no_overlap_tokens_per_s: float  # the same when the target's forward never overlaps the drafter's step
    bottleneck: str  # "drafter", "target" or "shared" (co-located: one device does both)
    bytes_per_device: int  # the most any of its devices holds
    fits: bool
    days: float
    online: bool = True
    compute_tokens_per_s: float = 0.0  # before the all-reduce and the store: what the devices compute
    read_bytes_per_s_needed: float = 0.0  # offline: from the store, for every rank at its own pace
    store_bytes_per_s: float | None = None  # offline: what the store delivers (None: unknown)

    @property
    def co_located(self) -> bool:
        return self.online and self.target_devices_per_rank == 0

    @property
    def label(self) -> str:
        ranks = _count(self.drafter_ranks, "drafter rank")
        if not self.online:
            return f"{ranks} on stored hidden states"
        if self.co_located:
            each = "each sharing its" if self.drafter_ranks > 1 else "sharing its"
            return f"{ranks}, {each} device with the target"
        return f"{ranks} × {_count(self.target_devices_per_rank, 'target device')} each"

    @property
    def store_bound(self) -> bool:
        return self.bottleneck == "store"

    def summary(self, device_word: str = "GPU") -> str:
        return (
            f"{self.label}: {_count(self.gpus_per_node, device_word)} a node, "
            f"{self.tokens_per_s:,.0f} tokens/s, {_duration(self.days)}"
            + ("" if self.fits else f" — DOES NOT FIT ({human_bytes(self.bytes_per_device)} on a device)")
        )

    def read_note(self, nodes: int) -> str:
        """Offline: what its ranks need from the store, and whether the store gives it."""
        need = f"needs {_needs(self.read_bytes_per_s_needed, self.drafter_ranks * nodes)}"
        if self.store_bytes_per_s is None:
            return (
                f"{need} at that pace; the store's rate is unmeasured "
                "(`dflash-assets bench --only store`, or --store-gbps)"
            )
        if self.store_bound:
            return (
                f"store-bound: the store's {self.store_bytes_per_s / GB:,.1f} GB/s carries "
                f"{self.tokens_per_s:,.0f} of the {self.compute_tokens_per_s:,.0f} tokens/s the ranks "
                f"compute, which {need}"
            )
        return f"{need}; the store's {self.store_bytes_per_s / GB:,.1f} GB/s keeps up"

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafter_ranks": self.drafter_ranks,
            "target_devices_per_rank": self.target_devices_per_rank,
            "online": self.online,
            "co_located": self.co_located,
            "gpus_per_node": self.gpus_per_node,
            "tokens_per_s": self.tokens_per_s,
            "no_overlap_tokens_per_s": self.no_overlap_tokens_per_s,
            "bottleneck": self.bottleneck,
            "bytes_per_device": self.bytes_per_device,
            "fits": self.fits,
            "days": self.days,
            "label": self.label,
            "compute_tokens_per_s": self.compute_tokens_per_s,
            "read_bytes_per_s_needed": self.read_bytes_per_s_needed,
            "store_bytes_per_s": self.store_bytes_per_s,
        }


def evaluate_split(figures: NodeFigures, drafter_ranks: int, target_devices_per_rank: int) -> Split:
    """The split's tokens/s, days and memory (see the module docstring for the formulas)."""
    t, d = figures.target_tokens_per_s, figures.drafter_tokens_per_s
    D, k = drafter_ranks, target_devices_per_rank  # noqa: N806 (the docstring's names)
    training = figures.training.step_bytes
    if k == 0:
        per_node = D / (1 / t + 1 / d)
        serial, bottleneck = per_node, "shared"
        most = figures.target_device_bytes + training
    else:
        replicas = k // figures.target_span  # each spans `target_span` of the rank's k devices
        drafter_side, target_side = D * d, D * replicas * t
        per_node = min(drafter_side, target_side)
        serial = D / (1 / (replicas * t) + 1 / d) if replicas else 0.0
        bottleneck = "drafter" if drafter_side <= target_side else "target"
        most = max(figures.target_device_bytes, training)
    compute = per_node * figures.nodes
    rate = figures.with_allreduce(compute)
    return Split(
        drafter_ranks=D,
        target_devices_per_rank=k,
        gpus_per_node=D * (1 + k),
        tokens_per_s=rate,
        no_overlap_tokens_per_s=figures.with_allreduce(serial * figures.nodes),
        bottleneck=bottleneck,
        bytes_per_device=most,
        fits=with_headroom(most) <= figures.device_memory_bytes,
        days=_days(figures.tokens_to_train, rate),
        compute_tokens_per_s=compute,
    )


def _days(tokens: float, rate: float) -> float:
    return tokens / rate / 86400 if rate > 0 else float("inf")


def online_splits(figures: NodeFigures, target_devices_per_rank: int | None = None) -> list[Split]:
    """Every split of a node's devices training runs online (k fixed when given)."""
    gpus, span = figures.gpus_per_node, figures.target_span
    shapes = [
        (ranks, k)
        for ranks in range(1, gpus + 1)
        for k in range(0, gpus // ranks)
        if (target_devices_per_rank is None or k == target_devices_per_rank)
        and k % span == 0
        and (k > 0 or span == 1)
    ]
    return [evaluate_split(figures, ranks, k) for ranks, k in shapes]


def offline_split(figures: NodeFigures) -> Split:
    """Offline, every device of every node trains on stored hidden states: G·d a node, less the
    all-reduce's wait, and no more than the store's rate carries."""
    gpus, training = figures.gpus_per_node, figures.training.step_bytes
    compute = gpus * figures.drafter_tokens_per_s * figures.nodes
    ranks_pace = figures.with_allreduce(compute)
    need = ranks_pace * figures.bytes_per_token
    rate, bottleneck = ranks_pace, "drafter"
    store = figures.store_bytes_per_s
    if store is not None and figures.bytes_per_token > 0 and store / figures.bytes_per_token < ranks_pace:
        # Whole tokens, rounded down: the figure never claims more than the store carries.
        rate, bottleneck = math.floor(store / figures.bytes_per_token), "store"
    return Split(
        drafter_ranks=gpus,
        target_devices_per_rank=0,
        gpus_per_node=gpus,
        tokens_per_s=rate,
        no_overlap_tokens_per_s=rate,
        bottleneck=bottleneck,
        bytes_per_device=training,
        fits=with_headroom(training) <= figures.device_memory_bytes,
        days=_days(figures.tokens_to_train, rate),
        online=False,
        compute_tokens_per_s=compute,
        read_bytes_per_s_needed=need,
        store_bytes_per_s=store,
    )


def rank_splits(splits: Sequence[Split]) -> list[Split]:
    """Best first: the fastest, except that a split within `TIE_FRACTION` of it on fewer devices (then
    losing less without overlap) goes first; the rest ranked the same way."""
    left, ranked = list(splits), []
    while left:
        fastest = max(split.tokens_per_s for split in left)
        close = [split for split in left if split.tokens_per_s >= fastest * (1 - TIE_FRACTION)]
        best = min(
            close,
            key=lambda s: (s.gpus_per_node, -s.no_overlap_tokens_per_s, -s.tokens_per_s, s.drafter_ranks),
        )
        ranked.append(best)
        left.remove(best)
    return ranked


@dataclass(frozen=True)
class StoredHiddenStates:
    """What offline training would read, stored in one dtype."""

    dtype: str  # "bf16" or "fp8"
    bytes_per_token: float  # the objects' bytes over their tokens, headers included
    total_bytes: float
    extraction_hours: float | None  # on the run's devices, before offline training can start


@dataclass(frozen=True)
class ModeOption:
    """One way to train the run: online, or offline on hidden states stored in one dtype."""

    name: str  # "online", "offline in bf16", "offline in fp8"
    split: Split
    extraction_hours: float = 0.0
    stored_bytes: float = 0.0

    @property
    def days(self) -> float:
        return self.split.days + self.extraction_hours / 24

    @property
    def known(self) -> bool:
        """Offline without the store's rate: its days hold only if the store keeps up."""
        return self.split.online or self.split.store_bytes_per_s is not None

    def describe(self) -> str:
        if self.split.online:
            return f"online: {_duration(self.days)}, no hidden states stored ({self.split.label})"
        training = _duration(self.split.days)
        if self.split.store_bytes_per_s is None:
            pace = f"if the store delivers {_rate(self.split.read_bytes_per_s_needed)}: unmeasured"
        elif self.split.store_bound:
            pace = f"store-bound at {self.split.store_bytes_per_s / GB:,.1f} GB/s"
        else:
            pace = "the store keeps up"
        return (
            f"{self.name}: {_duration(self.days)} = {_duration(self.extraction_hours / 24)} extraction + "
            f"{training} training ({pace}), {human_bytes(self.stored_bytes)} stored"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "days": self.days,
            "training_days": self.split.days,
            "extraction_hours": self.extraction_hours,
            "stored_bytes": self.stored_bytes,
            "known": self.known,
            "tokens_per_s": self.split.tokens_per_s,
        }


def choose_mode(options: Sequence[ModeOption], configured_dtype: str) -> tuple[ModeOption | None, str]:
    """(the option to train with, why): the fewest days among those that are known; within
    `CHOICE_TIE_FRACTION` of them, the fewest bytes stored. Offline without the store's rate is never
    chosen on faith: the reason says what it would take."""
    known = [option for option in options if option.known]
    if not known:
        return None, "no option can be timed"
    fastest = min(option.days for option in known)
    close = [option for option in known if option.days <= fastest * (1 + CHOICE_TIE_FRACTION)]
    best = min(close, key=lambda option: (option.stored_bytes, option.days))
    others = [option for option in known if option is not best]
    against = "; ".join(
        f"{o.name} {_duration(o.days)}, "
        + (f"{human_bytes(o.stored_bytes)} stored" if o.stored_bytes else "nothing stored")
        for o in others
    )
    why = f"{best.name}: {_duration(best.days)}" + (
        f", {human_bytes(best.stored_bytes)} stored" if best.stored_bytes else ", nothing stored"
    )
    if others:
        why += (
            " (the fewest days"
            if best.days == fastest
            else f" (within {CHOICE_TIE_FRACTION:.0%} of the fewest days, with fewer bytes"
        ) + f", against {against})"
    if not best.split.online and not best.name.endswith(configured_dtype):
        why += f"; set DFLASH_HIDDEN_STATE_DTYPE={best.name.rsplit(' ', 1)[-1]}"
    unknown = [option for option in options if not option.known]
    if unknown:
        fastest_unknown = min(unknown, key=lambda option: option.days)
        if fastest_unknown.days < best.days:
            why += (
                f"; {fastest_unknown.name} would take {_duration(fastest_unknown.days)} only if the store "
                f"delivers {_rate(fastest_unknown.split.read_bytes_per_s_needed)}, unmeasured: "
                "`dflash-assets bench --only store` measures it (or give --store-gbps)"
            )
    return best, why


@dataclass
class TrainingSplit:
    """The recommendation and what it is made of; `as_dict` is `plan --json`'s `training_split`."""

    figures: NodeFigures
    recommended: Split | None
    alternatives: list[Split]
    stated: Split | None  # the user's split, when it is neither the recommendation nor an alternative
    stated_from: str
    offline: Split
    strategy: str  # "DDP" or "FSDP2 needed"
    sources: dict[str, str]
    flops_per_token: dict[str, float]
    warnings: list[str] = field(default_factory=list)
    device_word: str = "GPU"  # what the printed block calls a device ("device" on a CPU)
    gradient_bytes: int = 0  # the drafter's float32 gradients: what the all-reduce sums a step
    inter_node: str = ""  # where the link's rate comes from
    store_source: str = ""  # where the store's rate comes from ("" unknown)
    options: list[ModeOption] = field(default_factory=list)
    choice: ModeOption | None = None
    choice_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        f = self.figures
        return {
            "gpus_per_node": f.gpus_per_node,
            "nodes": f.nodes,
            "tokens_to_train": f.tokens_to_train,
            "target_tokens_per_s_per_device": f.target_tokens_per_s,
            "drafter_tokens_per_s_per_device": f.drafter_tokens_per_s,
            "sources": dict(self.sources),
            "flops_per_token": dict(self.flops_per_token),
            "memory": {
                "device_bytes": f.device_memory_bytes,
                "target_device_bytes": f.target_device_bytes,
                "drafter_device_bytes": f.training.step_bytes,
                "co_located_bytes": f.target_device_bytes + f.training.step_bytes,
            },
            "data_parallel": self.strategy,
            "recommended": self.recommended.as_dict() if self.recommended else None,
            "alternatives": [split.as_dict() for split in self.alternatives],
            "stated": self.stated.as_dict() if self.stated else None,
            "stated_from": self.stated_from,
            "offline": self.offline.as_dict(),
            "gradient_allreduce": {
                "gradient_bytes": self.gradient_bytes,
                "seconds_per_step": f.allreduce_seconds,
                "step_tokens": f.step_tokens,
                "inter_node": self.inter_node,
            },
            "store": {
                "read_bytes_per_s": f.store_bytes_per_s,
                "source": self.store_source or None,
                "bytes_per_token": f.bytes_per_token,
            },
            "options": [option.as_dict() for option in self.options],
            "choice": self.choice.name if self.choice else None,
            "choice_reason": self.choice_reason,
            "warnings": list(self.warnings),
        }

    def table_rows(self) -> list[tuple[str, str]]:
        """The printed plan's "training split" block, (name, value) rows."""
        f, word = self.figures, self.device_word
        rows = [
            (
                "training split",
                f"{_count(f.gpus_per_node, word)} a node × {_count(f.nodes, 'node')}; "
                f"{_tokens(f.tokens_to_train)} tokens to train; data parallel: {self.strategy}",
            ),
            (
                "  target forward",
                f"{f.target_tokens_per_s:,.0f} tokens/s per device "
                f"({self.flops_per_token.get('target', 0):.3g} FLOPs a token)",
            ),
            ("", f"from {self.sources.get('target', '?')}"),
            (
                "  drafter step",
                f"{f.drafter_tokens_per_s:,.0f} tokens/s per device "
                f"({self.flops_per_token.get('drafter', 0):.3g} FLOPs a token)",
            ),
            ("", f"from {self.sources.get('drafter', '?')}"),
            (
                "  memory a device",
                f"target {human_bytes(f.target_device_bytes)}, drafter {human_bytes(f.training.step_bytes)}, "
                f"both {human_bytes(f.target_device_bytes + f.training.step_bytes)}; the device has "
                f"{human_bytes(f.device_memory_bytes)}",
            ),
        ]
        best = self.recommended
        if best is not None:
            rows.append(("  recommended", best.summary(word)))
            if not best.co_located:
                rows.append(
                    (
                        "",
                        "assuming the target's forward overlaps the drafter's step; without overlap "
                        f"{best.no_overlap_tokens_per_s:,.0f} tokens/s",
                    )
                )
        rows += [("  alternative", split.summary(word)) for split in self.alternatives]
        if self.stated is not None:
            rows.append(("  stated", f"{self.stated.summary(word)} ({self.stated_from})"))
        rows.append(("  offline", self.offline.summary(word)))
        rows.append(("", self.offline.read_note(f.nodes)))
        if self.store_source:
            rows.append(("", f"the store's rate from {self.store_source}"))
        if f.nodes > 1:
            rows.append(
                (
                    "  gradient all-reduce",
                    f"{human_bytes(self.gradient_bytes)} of float32 gradients a step between "
                    f"{f.nodes} nodes: {f.allreduce_seconds:.2f} s a step at {self.inter_node}, in every "
                    f"split's tokens/s above (a step of {f.step_tokens:,.0f} tokens)",
                )
            )
        if self.options:
            rows.append(("  choice", self.choice_reason))
            rows += [("", option.describe()) for option in self.options]
        return rows


def data_parallel_strategy(training: TrainingMemory, device_memory_bytes: int, device_name: str):
    """("DDP" or "FSDP2 needed", the warning naming what does not fit, or None)."""
    if with_headroom(training.step_bytes) <= device_memory_bytes:
        return "DDP", None
    state = training.weights + training.gradients + training.optimizer + training.frozen
    parts = (
        f"float32 weights {human_bytes(training.weights)}, gradients {human_bytes(training.gradients)}, "
        f"AdamW state {human_bytes(training.optimizer)}, the frozen embedding and LM head "
        f"{human_bytes(training.frozen)}"
    )
    if state > device_memory_bytes:
        what = f"its {parts} alone make {human_bytes(state)}"
    else:
        what = (
            f"its {parts} and one sequence's activations {human_bytes(training.activations)} make "
            f"{human_bytes(training.step_bytes)}"
        )
    return "FSDP2 needed", (
        f"FSDP2 needed: the drafter's training does not fit one {device_name} "
        f"({human_bytes(device_memory_bytes)}): {what}. Training replicates them on every rank (DDP, all it "
        "implements); sharding them over the ranks (FSDP2) is not implemented: lower DFLASH_MAX_LENGTH or "
        "the drafter_checkpoints run config `num_anchors`, or use a larger device"
    )


def plan_training_split(
    figures: NodeFigures,
    *,
    device_name: str,
    sources: dict[str, str] | None = None,
    flops_per_token: dict[str, float] | None = None,
    stated: tuple[int, int] | None = None,
    stated_from: str = "",
    target_devices_per_rank: int | None = None,
    device_word: str = "GPU",
) -> TrainingSplit:
    """The recommended online split, the next `ALTERNATIVES`, the `stated` (drafter ranks, target devices
    per rank) when it is neither, and offline's every-device split. `target_devices_per_rank` fixes k."""
    splits = online_splits(figures, target_devices_per_rank)
    feasible = [split for split in splits if split.fits]
    ranked = rank_splits(feasible or splits)
    recommended = ranked[0] if ranked else None
    alternatives = ranked[1 : 1 + ALTERNATIVES]
    strategy, dp_warning = data_parallel_strategy(figures.training, figures.device_memory_bytes, device_name)
    warnings = [dp_warning] if dp_warning else []
    if not feasible and recommended is not None and dp_warning is None:
        warnings.append(
            f"no online split fits {device_name}'s {human_bytes(figures.device_memory_bytes)}: the target "
            f"needs {human_bytes(figures.target_device_bytes)} on a device of its own (its weights, one "
            "sequence's forward and its captured states); train offline or use a larger device"
        )
    shown = [s for s in (recommended, *alternatives) if s is not None]
    stated_split = None
    if stated is not None and not any(
        (s.drafter_ranks, s.target_devices_per_rank) == tuple(stated) for s in shown
    ):
        stated_split = evaluate_split(figures, *stated)
        if stated_split.gpus_per_node > figures.gpus_per_node:
            warnings.append(
                f"the stated split ({stated_from}) needs {stated_split.gpus_per_node} devices a node, more "
                f"than the {figures.gpus_per_node} planned for (--gpus-per-node)"
            )
    offline = offline_split(figures)
    return TrainingSplit(
        figures=figures,
        recommended=recommended,
        alternatives=alternatives,
        stated=stated_split,
        stated_from=stated_from,
        offline=offline,
        strategy=strategy,
        sources=dict(sources or {}),
        flops_per_token=dict(flops_per_token or {}),
        warnings=warnings,
        device_word=device_word,
    )


def training_split_for(
    *,
    target: TargetFacts,
    drafter: DrafterConfig,
    device: DeviceProfile,
    gpu_result: dict[str, Any] | None,
    lengths: Sequence[int],
    tokens_to_train: float,
    gpus_per_node: int,
    nodes: int = 1,
    max_length: int = SEED_MAX_LENGTH,
    num_anchors: int = SEED_NUM_ANCHORS,
    mfu: float = STATED_MFU,
    given_drafter_tokens_per_s: float | None = None,
    stated: tuple[int, int] | None = None,
    stated_from: str = "",
    target_devices_per_rank: int | None = None,
    longest: int | None = None,
    target_span: int = 1,
    global_batch_size: int = SEED_GLOBAL_BATCH,
    inter_node_gbps: float | None = None,
    store_bytes_per_s: float | None = None,
    store_source: str = "",
    stored: Sequence[StoredHiddenStates] = (),
    hidden_state_dtype: str = "bf16",
) -> TrainingSplit:
    """The training split for `target` and `drafter` on `gpus_per_node` of `device` × `nodes`, over
    samples of `lengths` (their distribution: the count does not matter). Raises `SplitUnknown` when a
    rate cannot be known (a device without a known peak). Memory is counted for one sequence of
    `longest` tokens (default: the longest of `lengths`), the smallest micro-batch.

    Across nodes each step waits for the gradient all-reduce over `inter_node_gbps` (GB/s; default
    `DEFAULT_INTER_NODE_GBPS`). Offline reads `stored` in `hidden_state_dtype` at no more than
    `store_bytes_per_s` (None: unknown); with `stored` in several dtypes the choice between online and
    each offline one is made from days (extraction included) and bytes."""
    kept = [min(int(n), max_length) for n in lengths if n > 0] or [max_length]
    drafter_flops = drafter_flops_per_token(drafter, kept, num_anchors, max_length)
    t, target_source = forward_rate(target, device, gpu_result, "forward", mfu)
    d, drafter_source = drafter_rate(
        drafter_flops, device, gpu_result, given=given_drafter_tokens_per_s, mfu=mfu
    )
    if t is None or d is None:
        raise SplitUnknown(target_source if t is None else drafter_source)
    longest = min(longest or max(kept), max_length)
    gradient_bytes = 4 * drafter_parameter_count(drafter)  # float32, the trainable weights only
    link_gbps = inter_node_gbps or DEFAULT_INTER_NODE_GBPS
    allreduce = 2 * (nodes - 1) / nodes * gradient_bytes / (link_gbps * GB) if nodes > 1 else 0.0
    by_dtype = {entry.dtype: entry for entry in stored}
    configured = by_dtype.get(hidden_state_dtype)
    figures = NodeFigures(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        target_tokens_per_s=t,
        drafter_tokens_per_s=d,
        device_memory_bytes=device.total_memory_bytes,
        target_device_bytes=online_target_bytes(target, device, longest, target_span),
        training=training_memory(drafter, longest, num_anchors, attention=planned_attention(device.kind)),
        tokens_to_train=tokens_to_train,
        target_span=target_span,
        step_tokens=global_batch_size * sum(kept) / len(kept),
        allreduce_seconds=allreduce,
        bytes_per_token=configured.bytes_per_token if configured else 0.0,
        store_bytes_per_s=store_bytes_per_s,
    )
    split = plan_training_split(
        figures,
        device_name=device.name,
        sources={"target": target_source, "drafter": drafter_source},
        flops_per_token={"target": target.flops_per_token, "drafter": drafter_flops},
        device_word="GPU" if device.kind == "cuda" else "device",
        stated=stated,
        stated_from=stated_from,
        target_devices_per_rank=target_devices_per_rank,
    )
    split.gradient_bytes = gradient_bytes
    split.inter_node = (
        f"{link_gbps:,.1f} GB/s between nodes ("
        + ("--inter-node-gbps" if inter_node_gbps else "the default; --inter-node-gbps gives the link's")
        + ")"
    )
    split.store_source = store_source if store_bytes_per_s is not None else ""
    if configured is not None and store_bytes_per_s is None:
        offline = split.offline
        split.warnings.append(
            f"offline training at {offline.tokens_per_s:,.0f} tokens/s needs "
            f"{_needs(offline.read_bytes_per_s_needed, offline.drafter_ranks * nodes)}, and the store's "
            "rate is unknown: measure it from this node with `dflash-assets bench --only store` or give "
            "--store-gbps, or the offline figure may be one the store cannot feed"
        )
    if nodes > 1 and figures.step_tokens > 0:
        one_node = split.offline.compute_tokens_per_s / nodes
        compute_s = figures.step_tokens / split.offline.compute_tokens_per_s
        if allreduce > compute_s:
            split.warnings.append(
                f"the gradient all-reduce takes {allreduce:.2f} s a step between {nodes} nodes, more than "
                f"the step's {compute_s:.2f} s of compute offline: {nodes} nodes train "
                f"{split.offline.tokens_per_s / one_node:.2f}× one node's {one_node:,.0f} tokens/s. Give the "
                "link's real rate (--inter-node-gbps), or a larger global batch (run config "
                "global_batch_size) spreads the all-reduce over more tokens"
            )
    options = [ModeOption("online", split.recommended)] if split.recommended is not None else []
    for entry in stored:
        offline = offline_split(replace(figures, bytes_per_token=entry.bytes_per_token))
        options.append(
            ModeOption(f"offline in {entry.dtype}", offline, entry.extraction_hours or 0.0, entry.total_bytes)
        )
    if len(options) > 1:
        split.options = options
        split.choice, split.choice_reason = choose_mode(options, hidden_state_dtype)
    for side, rate, flops in (
        ("target forward", t, target.flops_per_token),
        ("drafter step", d, drafter_flops),
    ):
        if device.peak_flops and rate * flops > device.peak_flops:
            split.warnings.append(
                f"the {side}'s {rate:,.0f} tokens/s at {flops:.3g} FLOPs a token is "
                f"{rate * flops / device.peak_flops:.0%} of {device.name}'s {device.peak_flops / 1e12:,.0f} "
                "TFLOP/s peak: it cannot hold there, and the split leans on it. `dflash-assets bench --gpu` "
                "measures it on the device (or give --train-tokens-per-s)"
            )
    return split


class SplitUnknown(ValueError):
    """A rate the split needs cannot be known on this device: the message says which and what to set."""
