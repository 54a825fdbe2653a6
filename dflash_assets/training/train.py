"""The training loop: one run of the DFlash drafter on one rank, wired from the parts beside this module
(settings, data, plan, schedule, metrics, checkpoints, evaluation, reporting, distributed).

Both modes yield the same `DrafterBatch` for the same samples, so a batch gives the same loss whether
its hidden states were captured earlier (offline: streamed from the store through a bounded cache) or
are computed now by the target (online). The data order is a pure function of (seed, epoch) and each
sample's anchors of (seed, epoch, sample index); each rank trains its share of every global batch
(`plan.rank_share`) and the loss is normalised over the whole global batch, so N ranks make the same
steps as one process, up to float reduction order. With model, optimiser, scheduler and RNG restored
from a checkpoint, a resumed run continues exactly where the interrupted one stopped, at any world size.
Rank 0 alone writes checkpoints, curves and reports; every rank evaluates its share of the held-out set.
With `until_flat` a run ends once its held-out tau curve is flat (`until_flat.py`) and exports its best
checkpoint's weights instead of the last.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflash_assets import terminal
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter, flex_compiled
from dflash_assets.drafter.objective import (
    BlockAnchors,
    BlockLossOutput,
    DrafterBatch,
    anchor_generator,
    dflash_loss,
    sample_anchors,
)
from dflash_assets.drafter.published import load_initial_weights
from dflash_assets.drafter.speculative import TargetVerifier
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.layout import TENSORBOARD_DIR
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.devices import current_device
from dflash_assets.training.checkpoint_evaluation import Evaluator
from dflash_assets.training.checkpoints import (
    CheckpointManager,
    CheckpointPolicy,
    DataPosition,
    checkpoint_dir,
    download_checkpoint,
    load_checkpoint_weights,
    read_checkpoint,
    restore_rng_state,
    run_prefix,
)
from dflash_assets.training.curves import TrainingCurves
from dflash_assets.training.data import OfflineData, OfflineSource, OnlineData, OnlineSource
from dflash_assets.training.distributed import SingleProcess
from dflash_assets.training.memory import DeviceMemory
from dflash_assets.training.metrics import StepStats
from dflash_assets.training.plan import (
    GIB,
    default_micro_batch_bytes,
    epoch_plan,
    micro_batches,
    rank_share,
    split_eval,
)
from dflash_assets.training.reporting import QuietReporter, RunReporter
from dflash_assets.training.schedule import build_optimizer, decay_length, decay_start, lr_factor
from dflash_assets.training.settings import TRAJECTORY_SETTINGS, TrainSettings
from dflash_assets.training.until_flat import MIN_RISE, best_point, evaluation_cadence, flat_reason


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
    tokens_per_second: float  # this run's training throughput, every rank's tokens summed
    rank_step_seconds: list[float]  # each rank's mean compute time per step (stragglers)
    world: dict[str, Any]  # world_size, nodes, devices of this run
    world_sizes: list[dict[str, Any]]  # every world size the weights were trained at, by steps
    checkpoints: list[str]  # store URIs committed by this process
    trained_sample_ranges: list[str]  # sample-index range keys trained on, held-out samples excluded
    eval_sample_indices: list[int]
    partitions: list[str]
    skipped_nonfinite_steps: int
    objective: dict[str, Any]  # loss, gamma, dpace_alpha, drafter_init: how the weights were trained
    model: DFlashDrafter = field(repr=False)
    evaluation_seconds: float = 0.0  # this process's time in held-out evaluations (the rest: steps, I/O)
    # The run's evaluations in order, the curve: step, measured tau, teacher-forced tau, held-out CE (a
    # resumed run's continue those its checkpoint carried).
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    # Why training ended: the flat curve's one line (`until_flat.flat_reason`), `max_steps reached (cap N)`
    # or `epochs done`.
    stop_reason: str = ""
    # The step whose weights `model` holds and the figures above describe: the best checkpoint's with
    # `until_flat`, else the last step's. (Ranks other than 0, which export nothing, keep their last.)
    exported_step: int | None = None


def device_seconds(world_sizes: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(wall seconds, device seconds) of training recorded in `world_sizes` segments (each segment's seconds
    times its world size); segments written before seconds were recorded count 0."""
    wall = sum(float(w.get("seconds") or 0.0) for w in world_sizes)
    return wall, sum(float(w.get("seconds") or 0.0) * int(w.get("world_size") or 1) for w in world_sizes)


REDO, UNFIT = 1, 2  # how a rank's step ran out of memory where every rank must know (`_local_step`)


@dataclass(frozen=True)
class _BatchFigures:
    """What the step's figures need of a micro-batch once it has run (not its hidden states)."""

    sample_indices: list[int]
    num_tokens: int


def _index_ranges(indices: Sequence[int]) -> list[str]:
    """[0, 1, 2, 5] -> ["00000000-00000002", "00000005-00000005"]."""
    ranges: list[str] = []
    for index in sorted(set(indices)):
        if ranges and SampleRange.parse(ranges[-1]).end == index - 1:
            ranges[-1] = SampleRange(SampleRange.parse(ranges[-1]).start, index).key
        else:
            ranges.append(SampleRange(index, index).key)
    return ranges


def _gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The global L2 norm of the gradients, as `clip_grad_norm_` measures it, without clipping."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _weights_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """Per tensor, its sum and sum of squares in float64 (computed where it lies: no copy to the host)."""
    sums = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            values = tensor.detach().double()
            sums[name] = [float(values.sum()), float((values * values).sum())]
    return sums


def _same_sums(one: list[float], other: list[float] | None) -> bool:
    """Equal up to the order a device sums in (identical tensors on two kinds of GPU may round apart)."""
    return other is not None and all(
        abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-12 for a, b in zip(one, other, strict=True)
    )


def single_process_world(device: str) -> dict[str, Any]:
    import socket

    return {"world_size": 1, "nodes": [socket.gethostname()], "devices": [device], "target_devices": [[]]}


class DrafterTrainer:
    """The parts of one training run on one rank, wired together: data plan, model, optimiser,
    checkpoints, evaluation and reporting."""

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
        device_memory: DeviceMemory | None = None,
        spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None = None,
        on_progress: Callable[[terminal.ProgressSnapshot], None] | None = None,
        collective: Any = None,
        world: dict[str, Any] | None = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        if data.mode != settings.mode:
            raise ValueError(f"train mode is {settings.mode!r} but the data given is {data.mode!r}")
        if settings.block_size != config.block_size:
            raise ValueError(
                f"train setting block_size {settings.block_size} differs from the drafter config's "
                f"{config.block_size}"
            )
        self.config, self.settings, self.store, self.run = config, settings, store, run
        self.collective = collective or SingleProcess()
        self.rank0 = self.collective.is_rank0
        self.world = world or single_process_world(settings.device)
        self.log = self._rank_log(log or (lambda message: None))
        self.work_dir = Path(work_dir)
        # Local copies of checkpoints, shared by the ranks of a node: rank 0 writes its checkpoints there
        # on their way to the store, and a resume reads the node's one copy there.
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else self.work_dir / "checkpoints"
        self.device = torch.device(settings.device)
        self.autocast_bf16 = settings.bf16_autocast and (
            self.device.type == "cuda" or (self.device.type == "cpu" and cpu_bf16_wanted(settings, self.log))
        )
        self.stats_device = self.device if self.device.type == "cuda" else torch.device("cpu")

        # Data: a fixed held-out set (rank 0 evaluates it), then one shuffled order of global batches per
        # epoch, each rank streaming only its own share of each.
        self.source = (OfflineSource if isinstance(data, OfflineData) else OnlineSource)(
            data, config, settings
        )
        if not self.source.lengths:
            raise ValueError("no training samples: the data source is empty")
        self.train_ids, self.eval_ids = split_eval(
            len(self.source.lengths), settings.eval_samples, settings.seed
        )
        if settings.train_samples:  # a data-size sweep: the first N, the held-out set unchanged
            self.train_ids = self.train_ids[: settings.train_samples]
        self._plans: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = len(self.plan(0))
        self.total_steps = settings.max_steps or self.steps_per_epoch * settings.epochs

        # Model and optimisation: the same seed gives the same initial weights on every rank.
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        self.model = DFlashDrafter.from_target(config)
        if settings.drafter_init:  # a published drafter's weights to start from (a resume overrides them)
            self.log(load_initial_weights(self.model, settings.drafter_init))
        self.model = self.model.to(self.device).train()
        self.model.set_attention_backend(settings.attention)
        self.optimizer = build_optimizer(self.model, settings)
        total = self.total_steps
        # `wsd` until flat: (the step its decay started at, the step it ends and the run with it) once the
        # held-rate curve is flat; None before, and for every other schedule.
        self.decay: tuple[int, int] | None = None
        self.flat: str | None = None  # `flat_reason`'s line where the decay started
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, settings, self.decay)
        )
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) * 4
        self.micro_batch_bytes = settings.micro_batch_bytes or default_micro_batch_bytes(
            self.device, weights_bytes
        )

        # Trained until flat, the run needs a curve to judge: an evaluation (at a checkpoint) about every
        # twelfth of its steps when no interval in steps is given.
        self.until_flat = settings.until_flat
        self.checkpoint_every_steps = settings.checkpoint_every_steps
        if self.until_flat and self.checkpoint_every_steps is None:
            self.checkpoint_every_steps = evaluation_cadence(self.total_steps)
        self.checkpoints = (
            CheckpointManager(
                store,
                run,
                self.checkpoint_dir,
                policy=CheckpointPolicy(self.checkpoint_every_steps, settings.checkpoint_every_minutes),
                uploader=uploader,
            )
            if self.rank0
            else None
        )
        self.evaluator = Evaluator(
            self.source,
            self.eval_ids,
            config,
            settings,
            autocast=self._autocast,
            micro_batch_bytes=lambda: self.micro_batch_bytes,
            report=lambda status: self.reporter.status(status, self.step),
            log=self.log,
            target_verifier=target_verifier,
            device_memory=device_memory,
            spare_device=spare_device,
            collective=self.collective,
        )
        self.source.setup_streams(self.evaluator.share)  # this rank's held-out samples
        if note := self.source.cache_note():
            self.log(note)
        self.step, self.position = 0, DataPosition()
        self.resumed_from: int | None = None
        self.last_saved: int | None = None
        self.last_eval: dict[str, Any] | None = None
        self.baseline: dict[str, Any] | None = None  # the evaluations of the untrained weights
        self.world_sizes: list[dict[str, Any]] = []  # earlier processes' world sizes (from a checkpoint)
        self._evaluated = False  # since this process started (the same on every rank)
        self.evaluation_seconds = 0.0  # spent in `evaluate` by this process
        self.started = time.monotonic()  # the wall clock of this process's training, less evaluations
        self.evaluations: list[dict[str, Any]] = []  # each `evaluate`'s headline figures, by step
        # Until flat: why the run ended early (None while it goes on), the best checkpoint so far
        # ({"step", "evaluation"}; the same on every rank) and, on rank 0 alone (it alone exports), a CPU
        # copy of its weights, (step, state_dict): rank 0's host holds one drafter more, not every rank's.
        self.stop_reason: str | None = None
        self.best: dict[str, Any] | None = None
        self._best_weights: tuple[int, dict[str, torch.Tensor]] | None = None
        self.skipped_nonfinite = self._consecutive_nonfinite = 0
        self._gradients: Any = None  # see `gradients`
        self._in_reduction = False  # this rank's reducing micro-batch has begun (`_accumulate`)
        reporter = RunReporter if self.rank0 else QuietReporter
        self.reporter = reporter(
            run=run,
            block_size=config.block_size,
            total_steps=self.total_steps,
            world=self.world,
            log=self.log,
            log_every_steps=settings.log_every_steps,
            open_curves=self._open_curves,
            on_progress=on_progress,
            on_checkpoint=on_checkpoint,
            selector=config.has_selector,
            distill=settings.distill_weight > 0,
        )
        ranks = (
            f" over {self.world['world_size']} ranks ({', '.join(sorted(set(self.world['nodes'])))})"
            if self.world["world_size"] > 1
            else ""
        )
        self.log(
            f"drafter: {config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} kv heads "
            f"x {config.head_dim} ({', '.join(sorted(set(config.layer_types)))}), mask token "
            f"{config.mask_token_id} ({config.extra.get('mask_token_source', 'given')}); "
            f"{len(self.train_ids)} training samples, {len(self.eval_ids)} held out; "
            f"{self.steps_per_epoch} steps per epoch of up to {settings.global_batch_size} sequences; "
            f"{self.total_steps} steps in total; {self.model.attention_backend} attention on {self.device}"
            f"{ranks}"
        )
        if self.until_flat and settings.lr_schedule == "wsd":
            self.log(
                f"until flat: evaluating every {self.checkpoint_every_steps} steps; the learning rate holds "
                f"until the last third of the held-out tau curve adds under {MIN_RISE * 100:g} %, then "
                f"decays to {settings.min_lr_ratio:g}x over {settings.lr_decay_ratio:.0%} of the run (from "
                f"step {decay_start(self.total_steps, settings)} at the latest, the cap being "
                f"{self.total_steps}), and the run exports its best checkpoint's weights"
            )
        elif self.until_flat:
            self.log(
                f"until flat: evaluating every {self.checkpoint_every_steps} steps; training stops once the "
                f"last third of the held-out tau curve adds under {MIN_RISE * 100:g} %, at step "
                f"{self.total_steps} at the latest, and exports the best checkpoint's weights"
            )

    def _rank_log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """Rank 0 says everything; the others only their warnings, naming themselves."""
        if self.rank0:
            return log
        rank = self.collective.rank

        def warnings_only(message: str) -> None:
            if message.startswith("WARNING"):
                log(f"rank {rank}: {message}")

        return warnings_only

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            self._plans = {epoch: epoch_plan(self.source.lengths, self.train_ids, self.settings, epoch)}
        return self._plans[epoch]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- resume

    def resume(self) -> None:
        """Continue from the newest complete checkpoint of the run, if there is one: the one rank 0
        finds and loads, which every rank then loads too. Each node fetches it once: rank 0 into the
        node's checkpoint directory, which its node's other ranks read; on every other node its first
        local rank, into the same directory there, deleted once every rank has loaded it. Ranks wait for
        those downloads (a ~1 B drafter's checkpoint is ~14 GB) with the long timeout."""
        restored = self.checkpoints.restore_latest() if self.rank0 else None
        ref = self.collective.broadcast_object(restored.ref if restored is not None else None, long=True)
        if ref is None:
            return
        nodes = self.world["nodes"]
        rank0_node = nodes[self.collective.rank] == nodes[0]
        fetches = self.collective.local_rank == 0 and not rank0_node
        if fetches:
            download_checkpoint(self.store, ref, self.checkpoint_dir)
        self.collective.long_barrier()  # this node's copy is complete
        if restored is None:
            directory = checkpoint_dir(self.checkpoint_dir, ref)
            restored = read_checkpoint(ref, directory, f"{self.store.uri(ref.prefix)} (copy in {directory})")
        self.collective.long_barrier()  # every rank has read its node's copy
        if fetches:
            shutil.rmtree(checkpoint_dir(self.checkpoint_dir, ref), ignore_errors=True)
        changed = changed_settings(restored.settings, self.settings)
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
        self.world_sizes = list(restored.extra.get("world_sizes") or [])
        self.skipped_nonfinite = int(restored.extra.get("skipped_nonfinite_steps") or 0)
        self.evaluations = list(restored.extra.get("curve") or [])
        if self.checkpoints is not None:
            self.checkpoints.start_from(self.step)
        earlier = ", ".join(str(w["world_size"]) for w in self.world_sizes) or "unknown"
        self.log(
            f"resuming run {self.run} from {self.store.uri(ref.prefix)}: step {self.step}, "
            f"epoch {self.position.epoch + 1}, batch {self.position.batch_index}; trained so far at world "
            f"size {earlier}, now {self.world['world_size']}"
        )
        self._resume_until_flat(restored.extra.get("until_flat") or {}, restored.model_state)

    def _resume_until_flat(self, saved: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        """Continue the judgement the checkpoint carries (`extra["until_flat"]`, the same on every rank): a
        run that stopped stays stopped, so a rerun trains no further, and the best checkpoint before the
        resume stays the one to beat (its weights: these, or read from the store at the end)."""
        if not self.until_flat:
            if saved.get("stop_reason"):
                self.log(
                    f"this run had stopped at step {self.step} ({saved['stop_reason']}); until_flat is off "
                    f"now, so it trains on to step {self.total_steps}"
                )
            return
        self.best = saved.get("best")
        if self.best is not None and self.best["step"] == self.step and self.rank0:
            self._best_weights = (self.step, weights)  # already a CPU copy, and the model's now
        self.stop_reason = saved.get("stop_reason")
        if self.stop_reason:
            self.log(f"this run stopped at step {self.step} ({self.stop_reason}): nothing more to train")
        if decay := saved.get("decay"):
            self._decay_from(int(decay["from"]), int(decay["to"]), str(decay["flat"]))

    # -- before the first step: every rank ready, and the same

    def compiles(self) -> bool:
        """Whether the first steps compile kernels (flex attention on a GPU): minutes on a busy node."""
        return self.model.attention_backend == "flex" and flex_compiled(self.device)

    def warm_up(self) -> None:
        """Compile every version of the drafter's kernels that training and evaluation will meet before the
        first timed collective, so no rank compiles while another waits under the collective timeout (8
        ranks compiling at once on one node take longer than one). Shapes are dynamic and a micro-batch's
        sequences reach the kernel packed into one row, so only gradients on and off compile apart
        (`drafter/model.py`): one throwaway forward each, with its backward where training has one, under
        the step's autocast. The ranks then meet with the long timeout. Gradients are discarded."""
        if self.compiles():
            length = min(self.settings.max_length, 4 * self.config.block_size)
            self.reporter.status("compiling the drafter's kernels", self.step)
            for grad in (True, False):
                batch = self._throwaway_batch(2, length)
                with self._autocast(), torch.set_grad_enabled(grad):
                    output = dflash_loss(
                        self.model, batch, self._anchors(batch, "warm-up"), self.settings.objective
                    )
                    if grad:
                        output.weighted_ce.backward()
                del output
            self.optimizer.zero_grad(set_to_none=True)
        self.collective.long_barrier()

    def check_ranks_agree(self) -> None:
        """Every rank must start from the same weights (the same seed, or the same checkpoint) and list the
        same samples in the same order: otherwise the ranks train different models, and nothing else would
        say so. A rank that differs from rank 0 is named."""
        mine = {"weights": _weights_fingerprint(self.model), "data": self._data_fingerprint()}
        every = self.collective.all_gather_object(mine)
        for rank, theirs in enumerate(every):
            if theirs["data"] != every[0]["data"]:
                ours, first = theirs["data"], every[0]["data"]
                raise ValueError(
                    f"rank {rank} lists {ours['samples']} training samples (fingerprint "
                    f"{ours['hash'][:12]}) where rank 0 lists {first['samples']} ({first['hash'][:12]}): the "
                    "ranks read different ranges or settings. Give every node the same DFLASH_STORE_URL, "
                    "dataset and settings"
                )
            different = [
                name
                for name, value in theirs["weights"].items()
                if not _same_sums(value, every[0]["weights"].get(name))
            ]
            if different:
                raise ValueError(
                    f"rank {rank}'s weights differ from rank 0's at the start (first: {different[0]}; "
                    f"{len(different)} tensors): the ranks would train different drafters. Give every node "
                    "the same target model directory and settings (seed, drafter shape)"
                )

    def _data_fingerprint(self) -> dict[str, Any]:
        listing = json.dumps(
            [list(self.source.sample_indices), list(self.source.lengths), self.train_ids, self.eval_ids]
        )
        return {"samples": len(self.train_ids), "hash": hashlib.sha256(listing.encode()).hexdigest()}

    # -- one optimiser step: this rank's share, gradient accumulation, one sum over the ranks

    def _anchors(self, batch: DrafterBatch, epoch: int | str) -> BlockAnchors:
        generators = [anchor_generator(self.settings.seed, epoch, index) for index in batch.sample_indices]
        return sample_anchors(
            batch.loss_mask, self.settings.num_anchors, generators, self.settings.tokens_per_anchor
        )

    def _throwaway_batch(self, sequences: int, length: int) -> DrafterBatch:
        """Mask tokens over zero hidden states, every token an assistant one: what the warm-up and a
        rank's zero-loss micro-batch run (sample index -1, so no sample's anchors are drawn)."""
        config = self.config
        final_state = self.settings.distill_weight > 0  # the same shapes and terms as a real micro-batch
        shape = (sequences, length, config.num_context_layers + int(final_state), config.target_hidden_size)
        return DrafterBatch(
            input_ids=torch.full((sequences, length), config.mask_token_id, dtype=torch.long),
            loss_mask=torch.ones(sequences, length, dtype=torch.bool),
            hidden_states=torch.zeros(shape, dtype=torch.bfloat16),
            lengths=torch.full((sequences,), length),
            sample_indices=[-1] * sequences,
            final_state=final_state,
        )

    @property
    def gradients(self) -> Any:
        """How micro-batch gradients become the global sum (`distributed.py`): DDP's reducer across ranks,
        built by every rank together on first use (`train` builds it once the ranks have met)."""
        if self._gradients is None:
            self._gradients = self.collective.gradient_reduction(self.model, self._settle_reduction)
        return self._gradients

    def _settle_reduction(self, gradients: Any) -> None:
        """One zero-loss reducing micro-batch and one more forward on every rank, so DDP settles its
        buckets now rather than inside some later step (`distributed.ReplicatedGradients`)."""
        batch = self._throwaway_batch(1, min(self.settings.max_length, 2 * self.config.block_size))
        self._zero_loss_micro_batch(gradients, batch)
        with gradients.accumulating(), self._autocast():
            self._forward(gradients, batch, "warm-up")  # its output, and graph, dropped at once
        self.optimizer.zero_grad(set_to_none=True)

    def _forward(self, gradients: Any, batch: DrafterBatch, epoch: int | str) -> BlockLossOutput:
        return dflash_loss(
            self.model, batch, self._anchors(batch, epoch), self.settings.objective, forward=gradients.module
        )

    def _zero_loss_micro_batch(self, gradients: Any, batch: DrafterBatch) -> None:
        """A reducing forward and backward that adds nothing: the rank's part in the step's reduction when
        it has no sample (DDP's hooks must fire on every rank)."""
        with gradients.reducing(), self._autocast():
            output = self._forward(gradients, batch, "warm-up")
            (output.weighted_ce * 0.0).backward()

    def _accumulate(
        self,
        share: Sequence[int],
        samples: Sequence[Any],
        plan: Sequence[Sequence[int]],
        epoch: int,
        ahead: Sequence[int],
        gradients: Any,
    ) -> list[tuple]:
        """Forward and backward over the micro-batches `plan` of `samples` (source ids `share`),
        gradients summed (not averaged): the last one's backward reduces them over the ranks, the others
        only add to them. Once a micro-batch is collated the next one is prepared (online with the target
        on devices of its own: its forward runs while the drafter trains), after the last one `ahead`,
        the next step's first micro-batch. Every backward runs, a non-finite loss's too (the step is then
        skipped on every rank): a rank that skipped its reducing backward would leave the others waiting.
        The figures kept are detached, so no micro-batch's graph outlives its backward."""
        outputs = []
        for number, micro in enumerate(plan):
            batch = self.source.collate([samples[i] for i in micro])
            last = number + 1 == len(plan)
            following = ahead if last else [share[i] for i in plan[number + 1]]
            self.source.prepare(following)
            self._in_reduction = last  # from here on, running out of memory is every rank's concern
            with gradients.reducing() if last else gradients.accumulating(), self._autocast():
                output = self._forward(gradients, batch, epoch)
                output.weighted_ce.backward()
            detached = replace(output, loss=output.loss.detach(), weighted_ce=output.weighted_ce.detach())
            outputs.append((detached, _BatchFigures(batch.sample_indices, batch.num_tokens)))
            del output, batch
        return outputs

    def _local_step(
        self, share: Sequence[int], samples: Sequence[Any], epoch: int, ahead: Sequence[int]
    ) -> tuple[list[tuple], int]:
        """This rank's share of the step, split into micro-batches that fit (smaller after running out of
        memory: the gradients are sums, so any split gives the same update), and whether the step must be
        redone on every rank: `REDO` when this rank ran out of memory in its reducing micro-batch (it has
        lowered its budget), `UNFIT` when not even one sequence fits. Either way this rank has finished
        its part of the step's reduction, so no rank waits inside a collective."""
        gradients = self.gradients
        if not share:
            self._zero_loss_micro_batch(
                gradients, self._throwaway_batch(1, min(self.settings.max_length, 2 * self.config.block_size))
            )
            return [], 0
        lengths = [self.source.lengths[i] for i in share]
        ids = list(range(len(samples)))
        while True:
            plan = micro_batches(
                ids, lengths, self.config, self.settings, self.micro_batch_bytes, self.model.attention_backend
            )
            self._in_reduction = False
            try:
                return self._accumulate(share, samples, plan, epoch, ahead, gradients), 0
            except torch.OutOfMemoryError:
                reducing = self._in_reduction
            # Out of the `except`: its traceback held the failed micro-batch's tensors, which empty_cache
            # could not have given back.
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            unfit = max(len(micro) for micro in plan) == 1
            if not unfit:
                self.micro_batch_bytes //= 2
                self.log(
                    f"WARNING: out of memory at step {self.step + 1}; micro-batch budget lowered to "
                    f"{self.micro_batch_bytes / GIB:.2f} GiB and the step redone"
                    + (" on every rank" if reducing and self.collective.world_size > 1 else "")
                )
            if reducing or unfit:
                gradients.finish_failed_reduction(begun=reducing)
                return [], UNFIT if unfit else REDO

    def train_step(
        self, epoch: int, share: Sequence[int], samples: Sequence[Any], ahead: Sequence[int] = ()
    ) -> tuple[StepStats, Any]:
        """One optimiser step over one global batch, of which `samples` (source ids `share`) is this
        rank's share; `ahead` is the next step's first micro-batch, prepared once this step's last is.
        The loss is normalised by the label weight of the whole global batch, so any split over ranks
        and micro-batches gives the same update. The host reads the step's figures once, after their sum
        over the ranks. Returns the step's global figures and gradient norm."""
        fault_point("train_step")  # crash tests: die between steps, checkpoints possibly mid-upload
        while True:
            started = time.monotonic()
            outputs, out_of_memory = self._local_step(share, samples, epoch, ahead)
            due = (
                self.checkpoints is not None
                and self.step + 1 < self.total_steps
                and self.checkpoints.due(self.step + 1)
            )
            local = StepStats.pack_local(
                outputs,
                block_size=self.config.block_size,
                rank=self.collective.rank,
                world_size=self.collective.world_size,
                seconds=time.monotonic() - started,
                checkpoint_due=due,
                out_of_memory=out_of_memory,
                device=self.stats_device,
            )
            # The gradients are already summed over the ranks (the reducing backward): their norm is the
            # same on every rank and rides along with the figures' sum, read in the same copy.
            summed = self.collective.all_reduce_sum(local)
            norm = _gradient_norm(self.model).double().to(self.stats_device)
            packed = torch.cat([summed, norm[None]]).cpu()
            stats = StepStats.unpack(packed[:-1], self.config.block_size, self.collective.world_size)
            if stats.unfit_ranks:  # every rank stops alike, the one that ran out saying how long its sequence
                longest = max((self.source.lengths[i] for i in share), default=0)
                where = (
                    f"on {self.device}" if out_of_memory == UNFIT else f"on {stats.unfit_ranks} other rank(s)"
                )
                raise torch.OutOfMemoryError(
                    f"one sequence does not fit {where} (step {self.step + 1}; here the longest has "
                    f"{longest} tokens); lower max_length or num_anchors, or use a larger device"
                )
            if not stats.redo_ranks:
                break
            self.optimizer.zero_grad(set_to_none=True)
            self.gradients.rebuild()  # every rank together: the failed rank's reducer is spent
        if stats.nonfinite_ranks:
            indices = [i for _, b in outputs for i in b.sample_indices]
            return stats, self._skip_step("loss", indices)
        grad_norm = None
        if stats.weight_sum > 0:  # a step without a single label leaves weights and moments alone
            # The norm of the summed gradients, the same on every rank, so every rank decides alike. A
            # finite loss can still give an inf gradient on one rank, and clipping would then spread NaN
            # into every weight. Dividing by the global label weight and clipping are one scaling, with
            # the figures already on the host: no further wait for the device.
            norm = float(packed[-1]) / stats.weight_sum
            if not math.isfinite(norm):
                indices = [i for _, b in outputs for i in b.sample_indices]
                return stats, self._skip_step("gradient norm", indices)
            scale = 1.0 / stats.weight_sum
            if self.settings.max_grad_norm is not None:
                scale *= min(1.0, self.settings.max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s rule
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, scale)
            grad_norm = norm  # before clipping, for the curves
            self.optimizer.step()
        self._consecutive_nonfinite = 0
        self.optimizer.zero_grad(set_to_none=True)
        return stats, grad_norm

    def _skip_step(self, what: str, indices: Sequence[int]) -> None:
        """Skip the update, not the data: one bad batch must not kill a day-long run. Every rank comes here
        alike (the loss flags and the gradient norm are global), so the weights stay equal."""
        self.skipped_nonfinite += 1
        self._consecutive_nonfinite += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.log(
            f"WARNING: non-finite {what} at step {self.step + 1} (samples {list(indices)} here); the update "
            f"is skipped on every rank ({self.skipped_nonfinite} skipped so far)"
        )
        if self._consecutive_nonfinite > self.settings.max_consecutive_nonfinite:
            raise FloatingPointError(
                f"{self._consecutive_nonfinite} consecutive non-finite steps (last: {what}, samples "
                f"{list(indices)} here); lower the learning rate or check those samples' hidden states"
            )
        return None

    # -- evaluation and checkpoints

    def evaluate(self) -> dict[str, Any] | None:
        """Every rank evaluates its share of the held-out samples and prompts; every rank gets the sums.
        A step evaluated again (a finished run materialised again) replaces its point of the curve."""
        self.source.settle()  # the target's work started ahead ends before the evaluation uses it
        started = time.monotonic()
        result = self.evaluator.evaluate(self.model, self.optimizer)
        self.evaluation_seconds += time.monotonic() - started
        self._evaluated = True
        self.reporter.evaluation(self.step, result)
        self.evaluations = [p for p in self.evaluations if p["step"] != self.step]
        self.evaluations.append(evaluation_point(self.step, result))
        return result

    def judge(self) -> None:
        """After a checkpoint's evaluation, until flat: keep its weights if it is the best checkpoint so far,
        and stop if the curve is flat (before the cap: there the cap is why the run ends). Every rank holds
        the same curve, the sums of the same evaluation, so every rank decides alike and none waits for a
        step the others skip."""
        best = best_point(self.evaluations)
        if best is not None and best["step"] == self.step and (self.best or {}).get("step") != self.step:
            self.best = {"step": self.step, "evaluation": self.last_eval}
            if self.rank0:
                state = self.model.state_dict()
                self._best_weights = (
                    self.step,
                    {name: t.detach().to("cpu", copy=True) for name, t in state.items()},
                )
        if self.stop_reason is not None or self.step >= self.total_steps:
            return
        if self.settings.lr_schedule == "wsd":
            # Flat at the held rate: decay from here. Once the decay has begun (here, or at the cap's
            # `decay_start`), the run ends where the decay does, whatever the curve does meanwhile.
            holding = self.decay is None and self.step < decay_start(self.total_steps, self.settings)
            if holding and (reason := flat_reason(self.evaluations)):
                end = min(self.total_steps, self.step + decay_length(self.step, self.settings))
                self._decay_from(self.step, end, reason)
            return
        self.stop_reason = flat_reason(self.evaluations)
        if self.stop_reason:
            self.log(
                f"{self.stop_reason}: training stops at step {self.step} of {self.total_steps}; the best "
                f"checkpoint is step {(self.best or {}).get('step', self.step)}"
            )

    def _decay_from(self, start: int, end: int, reason: str) -> None:
        """`wsd` until flat: decay the learning rate from step `start` and end the run at step `end`."""
        self.decay, self.total_steps, self.flat = (start, end), end, reason
        self.reporter.set_total_steps(end)
        if self.step == start:
            self.log(f"{reason}: the learning rate decays from step {start} to {end}, where training stops")

    def _end_reason(self) -> str:
        """Why a run that did not stop early ended: its decay's end (`wsd` until flat), else its cap."""
        if self.decay is not None and self.step >= self.decay[1]:
            start, end = self.decay
            return f"{self.flat} at the held learning rate; it then decayed over steps {start}-{end}"
        return self._cap_reason()

    def _cap_reason(self) -> str:
        if self.settings.max_steps:
            return f"max_steps reached (cap {self.settings.max_steps})"
        return "epochs done"

    def export_best(self) -> None:
        """Until flat: make the best checkpoint's weights and figures the run's result, in place of the last
        step's. Its weights are rank 0's CPU copy or, when it predates this process, its checkpoint's in the
        store (committed: a later checkpoint was saved after it)."""
        held, self._best_weights = self._best_weights, None
        if not self.until_flat or self.best is None:
            return
        step, self.last_eval = self.best["step"], self.best["evaluation"]
        if step == self.step:  # the last checkpoint is the best: the model holds its weights
            return
        if self.rank0:
            if held is not None and held[0] == step:
                weights = held[1]
            else:
                weights = load_checkpoint_weights(self.store, self.run, step, self.checkpoint_dir)
            self.model.load_state_dict(weights)
        self.log(f"exporting step {step}'s weights, the best held-out tau, not the last step's ({self.step})")

    def _world_sizes(self) -> list[dict[str, Any]]:
        """The world sizes the weights were trained at so far, this process's included."""
        start = (self.resumed_from or 0) + 1
        # Wall seconds this process trained (steps, checkpoints, data), less its evaluations: with the
        # world size, what the weights cost in device time (`device_seconds` sums it over the segments).
        seconds = max(0.0, time.monotonic() - self.started - self.evaluation_seconds)
        here = {"from_step": start, "to_step": self.step, "seconds": round(seconds, 1), **self.world}
        return [*self.world_sizes, here] if self.step >= start else list(self.world_sizes)

    def save_checkpoint(self) -> None:
        if self.until_flat:
            # Evaluated first, the checkpoint carries its own point of the curve and what it decided: a rerun
            # of a run that stopped here stops too (an evaluation repeated on resume could fall on the other
            # side of the line), at the cost of the upload no longer overlapping this evaluation.
            self.last_eval = self.evaluate()
            self.judge()
        ref = None
        if self.checkpoints is not None:
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
                    "world_sizes": self._world_sizes(),
                    "skipped_nonfinite_steps": self.skipped_nonfinite,
                    "curve": self.evaluations,
                    "until_flat": {
                        "stop_reason": self.stop_reason,
                        "best": self.best,
                        "decay": self.decay
                        and {"from": self.decay[0], "to": self.decay[1], "flat": self.flat},
                    },
                },
            )
        if not self.until_flat:
            self.last_eval = self.evaluate()  # overlaps the upload
        self.last_saved = self.step
        if ref is not None:
            self.reporter.checkpoint_written()
            self.reporter.queue_checkpoint_report(
                self.step, self.store.uri(ref.prefix), self.position.epoch, self.last_eval
            )

    def report_committed(self, *, block: bool) -> None:
        """Tell `on_checkpoint` about checkpoints once committed; training goes on during uploads."""
        if self.checkpoints is None or not self.reporter.has_pending:
            return
        if block or self.checkpoints.upload_finished():
            self.checkpoints.wait()
            self.reporter.send_committed()

    # -- the loop

    def train(self) -> TrainResult:
        failed = True
        try:
            self.reporter.start(self.step)
            self.warm_up()
            self.check_ranks_agree()
            if self.step == 0 and self.resumed_from is None:
                # What an untrained drafter of this architecture achieves, measured the same way.
                self.last_eval = self.baseline = self.evaluate()
                self.reporter.queue_checkpoint_report(0, None, 0, self.last_eval)
                self.report_committed(block=True)
            if self.step < self.total_steps and self.stop_reason is None:
                self._train_steps()
            if self.last_saved != self.step:
                self.save_checkpoint()
            elif not self._evaluated and self.best is None:
                # Resumed at its last checkpoint (a finished run materialised again): the figures the
                # export, its card and the UI carry are measured again on the same weights, not blanked.
                # (Until flat, they are the best checkpoint's, which the checkpoint carries.)
                self.last_eval = self.evaluate()
            self.report_committed(block=True)
            self.export_best()
            failed = False
        finally:
            try:
                self.source.settle()
                self.reporter.close(failed=failed)
            finally:
                if self.checkpoints is not None:
                    self.checkpoints.close()
        if self.checkpoints is not None:
            # Every checkpoint is committed in the store: the local copies would only fill the disk (a
            # ~1 B drafter's is ~14 GB). A failed run keeps them, for a resume on this node to reuse.
            self.checkpoints.discard_local()
        return self.result()

    def _train_steps(self) -> None:
        """Steps from `self.position` to `total_steps`; one streamed pass over this rank's shares per epoch
        (a sample appears once per pass, so the streaming cache never holds two copies of it)."""
        epoch, start = self.position.epoch, self.position.batch_index
        world_size, rank = self.collective.world_size, self.collective.rank
        lengths = self.source.lengths
        self.reporter.start_clock()
        while self.step < self.total_steps:
            plan = self.plan(epoch)
            steps = plan[start : start + self.total_steps - self.step]
            shares = [rank_share(ids, lengths, world_size, rank) for ids in steps]
            samples = self.source.iterate([i for share in shares for i in share])
            with contextlib.closing(samples):
                for index, share in enumerate(shares, start=start):
                    started = time.monotonic()
                    following = shares[index - start + 1] if index - start + 1 < len(shares) else []
                    stats, grad_norm = self.train_step(
                        epoch, share, [next(samples) for _ in share], self._first_micro_batch(following)
                    )
                    lr = self.optimizer.param_groups[0]["lr"]
                    self.scheduler.step()
                    self.step += 1
                    last = index + 1 == len(plan)
                    self.position = DataPosition(epoch + 1, 0) if last else DataPosition(epoch, index + 1)
                    self.reporter.step(
                        self.step,
                        epoch,
                        self.epochs_total,
                        lr,
                        stats,
                        grad_norm,
                        time.monotonic() - started,
                        skipped=self.skipped_nonfinite,
                    )
                    if self.step >= self.total_steps:
                        return
                    if stats.checkpoint_due:
                        self.save_checkpoint()
                        if self.stop_reason is not None:
                            return
                    self.report_committed(block=False)
            epoch, start = epoch + 1, 0

    def _first_micro_batch(self, share: Sequence[int]) -> list[int]:
        """The source ids of the first micro-batch a step over `share` will make (as planned now)."""
        if not share:
            return []
        lengths = [self.source.lengths[i] for i in share]
        plan = micro_batches(
            range(len(share)),
            lengths,
            self.config,
            self.settings,
            self.micro_batch_bytes,
            self.model.attention_backend,
        )
        return [share[i] for i in plan[0]]

    def _open_curves(self, start_step: int) -> TrainingCurves:
        return TrainingCurves(
            self.store,
            f"{run_prefix(self.run)}/{TENSORBOARD_DIR}",
            self.work_dir / TENSORBOARD_DIR,
            self.checkpoints.uploader,
            run=self.run,
            start_step=start_step,
            config=self.settings.to_dict(),
            log=self.log,
        )

    @property
    def epochs_total(self) -> int:
        return math.ceil(self.total_steps / max(1, self.steps_per_epoch))

    def result(self) -> TrainResult:
        metrics = self.reporter.metrics
        window = metrics.last_window
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
            acceptance_length_tau=speculative.get("tau"),
            teacher_forced_tau=teacher_forced.get("teacher_forced_tau"),
            tokens_per_second=metrics.tokens_per_second,
            rank_step_seconds=metrics.mean_rank_step_seconds,
            world=self.world,
            world_sizes=self._world_sizes(),
            checkpoints=[self.store.uri(ref.prefix) for ref in self.checkpoints.written]
            if self.checkpoints
            else [],
            trained_sample_ranges=_index_ranges([self.source.sample_indices[i] for i in self.train_ids]),
            eval_sample_indices=[self.source.sample_indices[i] for i in self.eval_ids],
            partitions=list(self.source.partitions),
            skipped_nonfinite_steps=self.skipped_nonfinite,
            objective={
                name: self.settings.to_dict()[name]
                for name in ("loss", "gamma", "dpace_alpha", "distill_weight", "drafter_init")
            },
            model=self.model,
            evaluation_seconds=self.evaluation_seconds,
            evaluations=list(self.evaluations),
            stop_reason=self.stop_reason or self._end_reason(),
            exported_step=self.best["step"] if self.until_flat and self.best is not None else self.step,
        )


def changed_settings(saved: dict[str, Any], settings: TrainSettings) -> list[str]:
    """`name: saved -> now` for each trajectory setting a checkpoint's `saved` settings differ in. A setting
    the checkpoint predates was its default then (`train_samples` absent: every sample), not a change."""
    current = json.loads(json.dumps(settings.to_dict()))  # tuples -> lists, as saved
    defaults = json.loads(json.dumps(TrainSettings().to_dict()))
    was = {name: saved.get(name, defaults.get(name)) for name in TRAJECTORY_SETTINGS}
    return [
        f"{name}: {was[name]!r} -> {current[name]!r}"
        for name in TRAJECTORY_SETTINGS
        if was[name] != current[name]
    ]


def cpu_bf16_wanted(settings: TrainSettings, log: Callable[[str], None]) -> bool:
    """Whether a CPU run trains under bf16 autocast: asked for (`cpu_bf16_autocast`) and the CPU multiplies
    bf16 in hardware; asked for on a CPU without, it says so and trains in float32 (the reference kernel
    would be slower than float32, not faster)."""
    from dflash_assets.target.bf16_matmul import cpu_has_bf16_matmul

    if not settings.cpu_bf16_autocast:
        return False
    if cpu_has_bf16_matmul():
        return True
    log("cpu_bf16_autocast: this CPU has no bf16 matrix units (AMX, AVX-512 BF16): training in float32")
    return False


def evaluation_point(step: int, result: dict[str, Any] | None) -> dict[str, Any]:
    """One point of the curve: `{step, tau, teacher_forced_tau, ce}` (None where not measured)."""
    result = result or {}
    teacher_forced, speculative = result.get("teacher_forced") or {}, result.get("speculative") or {}
    return {
        "step": step,
        "tau": speculative.get("tau"),
        "teacher_forced_tau": teacher_forced.get("teacher_forced_tau"),
        "ce": teacher_forced.get("ce"),
    }


def train_drafter(
    config: DrafterConfig, settings: TrainSettings, data: OfflineData | OnlineData, **keywords: Any
) -> TrainResult:
    """Train a drafter, resuming from the newest complete checkpoint of `run` in `store` if any.

    `keywords` are `DrafterTrainer`'s, typed there: `store`, `run` and `work_dir`, then those below.
    Checkpoints go to `checkpoints/<run>/`. `log` gets a progress line every `log_every_steps` steps;
    `on_checkpoint` gets a dict (step, checkpoint URI, training and held-out metrics, the world) once each
    checkpoint is committed; `on_progress` a `terminal.ProgressSnapshot` at every step and evaluation
    (the same one the terminal shows). Uploads run in the background while training continues; the
    final checkpoint is committed before this returns. Per-step and per-evaluation scalars go to
    TensorBoard event files under `checkpoints/<run>/tensorboard/` (see `curves.py`). Offline,
    `spare_device` leases another device for a speculative evaluation that does not fit beside the
    drafter (`training/memory.py`), and `device_memory` reports free memory (default: what torch reports).
    `collective` makes this process one rank of a data-parallel job (`distributed.ProcessGroup`; default
    one process alone) and `world` describes the job (world_size, nodes, devices); `checkpoint_dir` is the
    node's local checkpoint directory, shared by its ranks (default `<work_dir>/checkpoints`).
    """
    # The leased device is this thread's current one for the run: without it a lease of cuda:k would save
    # GPU 0's random state in checkpoints, and kernels launched without an explicit device run on GPU 0.
    with current_device(settings.device):
        trainer = DrafterTrainer(config, settings, data, **keywords)
        trainer.resume()
        return trainer.train()
