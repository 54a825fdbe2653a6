"""The training loop: one run of the DFlash drafter, wired from the parts beside this module (settings,
data, plan, schedule, metrics, checkpoints).

Both modes yield the same `DrafterBatch` for the same samples, so a batch gives the same loss whether
its hidden states were captured earlier (offline: streamed from the store through a bounded cache) or
are computed now by the target (online). The data order is a pure function of (seed, epoch) and each
batch's anchors of (seed, epoch, batch index); with model, optimiser, scheduler and RNG restored from a
checkpoint, a resumed run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_assets import terminal
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.evaluate import evaluate_drafter
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import (
    BlockAnchors,
    DrafterBatch,
    anchor_generator,
    dflash_loss,
    sample_anchors,
)
from dflash_assets.drafter.speculative import (
    SpeculativeEvaluator,
    TargetVerifier,
    held_out_prompts,
    stop_token_ids_of,
)
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.model import load_target_model
from dflash_assets.training.checkpoints import (
    CheckpointManager,
    CheckpointPolicy,
    DataPosition,
    restore_rng_state,
    run_prefix,
)
from dflash_assets.training.curves import TENSORBOARD_DIR, TrainingCurves
from dflash_assets.training.data import OfflineData, OfflineSource, OnlineData, OnlineSource
from dflash_assets.training.memory import DeviceMemory, TorchDeviceMemory, target_for_evaluation
from dflash_assets.training.metrics import TrainMetrics
from dflash_assets.training.plan import GIB, default_micro_batch_bytes, epoch_plan, micro_batches, split_eval
from dflash_assets.training.schedule import build_optimizer, lr_factor
from dflash_assets.training.settings import TRAJECTORY_SETTINGS, TrainSettings


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


def _gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The global L2 norm of the gradients, as `clip_grad_norm_` measures it, without clipping."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


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
        device_memory: DeviceMemory | None = None,
        spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None = None,
        on_progress: Callable[[terminal.ProgressSnapshot], None] | None = None,
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
        self.on_progress = on_progress  # every step's snapshot, as the terminal gets it
        self.work_dir = Path(work_dir)
        self.device = torch.device(settings.device)
        self.autocast_bf16 = self.device.type == "cuda" and settings.bf16_autocast
        # Offline, the trainer loads the target for each speculative evaluation itself, where it fits
        # (`training/memory.py`): beside the drafter, on a spare leased device, or after moving the
        # optimiser state to the host. Online, the caller's target is already loaded.
        self._owns_target = target_verifier is None
        self._target_verifier = target_verifier
        self._device_memory = device_memory or TorchDeviceMemory()
        self._spare_device = spare_device

        # Data: a fixed held-out set, then one shuffled order of global batches per epoch.
        self.source = (OfflineSource if isinstance(data, OfflineData) else OnlineSource)(
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
        self.progress = TrainMetrics(config.block_size, 0, self.total_steps)
        self.curves: TrainingCurves | None = None  # opened by train(), once the start step is known
        self.step_scalars: dict[str, Any] = {}  # the last optimiser step's loss, gradient norm, sizes
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
            for name in TRAJECTORY_SETTINGS
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
        self.progress = TrainMetrics(self.config.block_size, self.step, self.total_steps)
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
            self.step_scalars = self._step_scalars(outputs, len(samples), math.nan, None)
            self.log(f"WARNING: non-finite loss at step {self.step + 1} (samples {sample_indices}); skipped")
            if self._consecutive_nonfinite > self.settings.max_consecutive_nonfinite:
                raise FloatingPointError(
                    f"{self._consecutive_nonfinite} consecutive non-finite losses (last step: samples "
                    f"{sample_indices}); lower the learning rate or check those samples' hidden states"
                )
            return
        self._consecutive_nonfinite = 0
        weight = sum(o.weight_sum for o, _ in outputs)
        grad_norm = None
        if weight > 0:  # a step without a single label leaves weights and moments alone
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(weight)
            if self.settings.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
            else:
                norm = _gradient_norm(self.model)
            grad_norm = float(norm)  # before clipping, for the curves
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = sum(o.weighted_ce_sum for o, _ in outputs) / weight if weight > 0 else None
        self.step_scalars = self._step_scalars(outputs, len(samples), loss, grad_norm)
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
        self._report(f"evaluating {len(self.eval_ids)} held-out samples")
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
        self._report(f"speculative decoding with the target on {len(prompts)} held-out prompts")
        if not self._owns_target:
            verifier = self._speculative.verifier if self._speculative is not None else None
            return self._decode(verifier or self._target_verifier(), prompts)
        # Offline, the target is loaded for this evaluation only and its memory given back to training
        # after it (a 27B target is ~54 GB in bf16); it is loaded again at the next checkpoint. Where it
        # does not fit, the evaluation is skipped with a warning, never the run.
        result = None
        with target_for_evaluation(
            load=lambda device: TargetVerifier(
                load_target_model(self.config.target_model, device), self.config.target_layer_ids
            ),
            target_model=self.config.target_model,
            prompts=prompts,
            new_tokens=self.settings.spec_eval_max_new_tokens,
            drafter_device=self.settings.device,
            optimizer=self.optimizer,
            memory=self._device_memory,
            spare_device=self._spare_device,
            log=self.log,
        ) as verifier:
            if verifier is not None:
                try:
                    result = self._decode(verifier, prompts)
                finally:
                    if self._speculative is not None:
                        self._speculative.verifier = None
        return result

    def _decode(self, verifier: TargetVerifier, prompts: list[list[int]]) -> dict[str, Any]:
        if self._speculative is None:
            self._speculative = SpeculativeEvaluator(
                verifier,
                prompts,
                max_new_tokens=self.settings.spec_eval_max_new_tokens,
                stop_token_ids=stop_token_ids_of(self.config.target_model),
            )
        else:
            self._speculative.verifier = verifier
        with self._autocast():
            result = self._speculative.evaluate(self.model)
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
        self._log_eval()
        if self.curves is not None:
            self.curves.rotate()
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
        failed = True
        try:
            self.curves = self._open_curves()
            if self.step == 0 and self.baseline is None:
                # What an untrained drafter of this architecture achieves, measured the same way.
                self.last_eval = self.baseline = self.evaluate()
                self._log_eval()
                self._queue_report(0, None)
                self.report_committed(block=True)
            if self.step < self.total_steps:
                self._train_steps()
            if self.last_saved != self.step:
                self.save_checkpoint()
            elif self.last_eval is None:
                # Resumed at its last checkpoint (a finished run materialised again): the figures the
                # export, its card and the UI carry are measured again on the same weights, not blanked.
                self.last_eval = self.evaluate()
                self._log_eval()
            self.report_committed(block=True)
            failed = False
        finally:
            try:
                if self.curves is not None:
                    self.curves.close(failed=failed)
            finally:
                terminal.finish(self.progress_task)
                self.checkpoints.close()
        return self.result()

    def _train_steps(self) -> None:
        """Steps from `self.position` to `total_steps`; one streamed pass over the data per epoch (a
        sample appears once per pass, so the streaming cache never holds two copies of it)."""
        epoch, start = self.position.epoch, self.position.batch_index
        self.progress.start_clock()
        while self.step < self.total_steps:
            plan = self.plan(epoch)
            steps = plan[start : start + self.total_steps - self.step]
            samples = self.source.iterate([i for ids in steps for i in ids])
            with contextlib.closing(samples):
                for index, ids in enumerate(steps, start=start):
                    here = DataPosition(epoch, index)
                    started = time.monotonic()
                    self.train_step(here, [next(samples) for _ in ids], [self.source.lengths[i] for i in ids])
                    lr = self.optimizer.param_groups[0]["lr"]
                    self.scheduler.step()
                    self.step += 1
                    self._record_step(lr, epoch, time.monotonic() - started)
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

    # -- curves and live progress

    @property
    def progress_task(self) -> str:
        return f"training {self.run}"

    def _open_curves(self) -> TrainingCurves:
        return TrainingCurves(
            self.store,
            f"{run_prefix(self.run)}/{TENSORBOARD_DIR}",
            self.work_dir / TENSORBOARD_DIR,
            self.checkpoints.uploader,
            run=self.run,
            start_step=self.step,
            config=self.settings.to_dict(),
            log=self.log,
        )

    @staticmethod
    def _step_scalars(
        outputs: Sequence[tuple], sequences: int, loss: float | None, grad_norm: float | None
    ) -> dict[str, Any]:
        tokens = sum(batch.num_tokens for _, batch in outputs)
        return {"loss": loss, "grad_norm": grad_norm, "sequences_per_step": sequences, "tokens": tokens}

    def _record_step(self, lr: float, epoch: int, seconds: float) -> None:
        """The step's scalars to the curves, its snapshot to the terminal (and `on_progress`)."""
        scalars = dict(self.step_scalars)
        tokens = scalars.pop("tokens", 0)
        scalars.update(lr=lr, tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        if self.curves is not None:
            self.curves.log_step(self.step, scalars)
        loss = scalars.get("loss")
        loss_text = f" · loss {loss:.3f}" if isinstance(loss, float) else ""
        self._report(f"epoch {epoch + 1}/{self.epochs_total}{loss_text}")

    def _log_eval(self) -> None:
        evaluation = self.last_eval or {}
        teacher_forced = evaluation.get("teacher_forced") or {}
        speculative = evaluation.get("speculative") or {}
        if self.curves is not None and evaluation:
            self.curves.log_eval(
                self.step,
                {
                    "loss": teacher_forced.get("loss"),
                    "tau_teacher_forced": teacher_forced.get("teacher_forced_tau"),
                    "tau_measured": speculative.get("acceptance_length_tau"),
                },
            )

    def _report(self, status: str) -> None:
        snapshot = terminal.ProgressSnapshot(
            task=self.progress_task,
            done=self.step,
            total=self.total_steps,
            unit="steps",
            rate=self.progress.steps_per_second(self.step),
            status=status,
        )
        terminal.report(snapshot)
        if self.on_progress is not None:
            self.on_progress(snapshot)

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
    device_memory: DeviceMemory | None = None,
    spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None = None,
    on_progress: Callable[[terminal.ProgressSnapshot], None] | None = None,
) -> TrainResult:
    """Train a drafter, resuming from the newest complete checkpoint of `run` in `store` if any.

    Checkpoints go to `checkpoints/<run>/`. `log` gets a progress line every `log_every_steps` steps;
    `on_checkpoint` gets a dict (step, checkpoint URI, training and held-out metrics) once each
    checkpoint is committed; `on_progress` a `terminal.ProgressSnapshot` at every step and evaluation
    (the same one the terminal shows). Uploads run in the background while training continues; the
    final checkpoint is committed before this returns. Per-step and per-evaluation scalars go to
    TensorBoard event files under `checkpoints/<run>/tensorboard/` (see `curves.py`). Offline,
    `spare_device` leases another device for a speculative evaluation that does not fit beside the
    drafter (`training/memory.py`), and `device_memory` reports free memory (default: what torch reports).
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
        device_memory=device_memory,
        spare_device=spare_device,
        on_progress=on_progress,
    )
    trainer.resume()
    return trainer.train()
