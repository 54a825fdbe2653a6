"""What a run tells the world, from rank 0: a log line every few steps, the live progress snapshot (the
terminal's status line and `on_progress`), every step's and evaluation's scalars in TensorBoard
(`curves.py`), and the `on_checkpoint` reports once each checkpoint is committed in the store.

The other ranks keep quiet (`QuietReporter`): every figure here is already global (`StepStats`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from dflash_assets import terminal
from dflash_assets.drafter.speculative import describe_by_context_length
from dflash_assets.training.curves import TrainingCurves
from dflash_assets.training.metrics import StepStats, TrainMetrics


class RunReporter:
    def __init__(
        self,
        *,
        run: str,
        block_size: int,
        total_steps: int,
        world: dict[str, Any],  # world_size, nodes, devices
        log: Callable[[str], None],
        log_every_steps: int,
        open_curves: Callable[[int], TrainingCurves],
        on_progress: Callable[[terminal.ProgressSnapshot], None] | None = None,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        selector: bool = False,
        distill: bool = False,
    ) -> None:
        self.run, self.block_size, self.total_steps = run, block_size, total_steps
        self.selector = selector  # DFlash2: its selector's figures too
        self.distill = distill  # distilling: the KL from the target's distribution too
        self.world = world
        self.log, self.log_every_steps = log, log_every_steps
        self._open_curves = open_curves
        self.on_progress, self.on_checkpoint = on_progress, on_checkpoint
        self.metrics = TrainMetrics(block_size, 0, total_steps, world["world_size"])
        self.curves: TrainingCurves | None = None
        self.step_scalars: dict[str, Any] = {}  # the last optimiser step's figures
        self._pending: list[dict[str, Any]] = []

    @property
    def task(self) -> str:
        return f"training {self.run}"

    def start(self, step: int) -> None:
        """Open the curves at the run's first step (0, or the step it resumed at); they say first where
        each rank runs."""
        self.metrics = TrainMetrics(self.block_size, step, self.total_steps, self.world["world_size"])
        self.curves = self._open_curves(step)
        self.curves.log_text(step, "ranks/placement", self.placement())

    def placement(self) -> str:
        """`world size 2: rank 0 node-a cuda:0, rank 1 node-b cuda:0`."""
        places = zip(self.world["nodes"], self.world["devices"], strict=True)
        ranks = ", ".join(f"rank {r} {node} {device}" for r, (node, device) in enumerate(places))
        return f"world size {self.world['world_size']}: {ranks}"

    def start_clock(self) -> None:
        self.metrics.start_clock()

    # -- every step

    def step(
        self, step: int, epoch: int, epochs: int, lr: float, stats: StepStats, grad_norm, seconds, skipped=0
    ):
        """Step `step` is done: its figures to the metrics, the curves, the log and the status line.
        `skipped`: the run's non-finite steps skipped so far (a curve that climbs names a bad stretch)."""
        self.metrics.add_step(stats)
        loss = stats.loss if stats.nonfinite_ranks == 0 else math.nan
        scalars: dict[str, Any] = {
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped_nonfinite_steps": skipped,
            "sequences_per_step": stats.sequences,
            "lr": lr,
            "tokens_per_s": stats.tokens / seconds if seconds > 0 else 0.0,  # every rank's tokens
            **stats.objective_scalars(selector=self.selector, distill=self.distill),
        }
        self.step_scalars = scalars
        if self.curves is not None:
            ranks = {f"ranks/step_s_rank_{r}": s for r, s in enumerate(stats.rank_seconds)}
            self.curves.log_step(step, scalars, {"ranks/world_size": len(stats.rank_seconds), **ranks})
        if step % self.log_every_steps == 0 or step == self.total_steps:
            self.log(self.metrics.report(step, epoch, epochs, lr))
        loss_text = f" · loss {loss:.3f}" if isinstance(loss, float) and math.isfinite(loss) else ""
        self.status(f"epoch {epoch + 1}/{epochs}{loss_text}{self._ranks_text(stats.rank_seconds)}", step)

    def _ranks_text(self, rank_seconds: Sequence[float]) -> str:
        if len(rank_seconds) < 2:
            return ""
        slowest = max(range(len(rank_seconds)), key=lambda r: rank_seconds[r])
        nodes = ", ".join(dict.fromkeys(self.world["nodes"]))
        return (
            f" · {len(rank_seconds)} ranks on {nodes}, {self.metrics.tokens_per_second:,.0f} tok/s · slowest "
            f"rank {slowest} {rank_seconds[slowest]:.2f} s"
        )

    def set_total_steps(self, total_steps: int) -> None:
        """The run now ends at `total_steps` (a decay begun early): progress and the ETA count to it."""
        self.total_steps = self.metrics.total_steps = total_steps

    def status(self, text: str, step: int) -> None:
        snapshot = terminal.ProgressSnapshot(
            task=self.task,
            done=step,
            total=self.total_steps,
            unit="steps",
            rate=self.metrics.steps_per_second(step),
            status=text,
        )
        terminal.report(snapshot)
        if self.on_progress is not None:
            self.on_progress(snapshot)

    # -- evaluations and checkpoints

    def evaluation(self, step: int, evaluation: dict[str, Any] | None) -> None:
        teacher_forced = (evaluation or {}).get("teacher_forced") or {}
        speculative = (evaluation or {}).get("speculative") or {}
        if self.curves is not None and evaluation:
            self.curves.log_eval(
                step,
                {
                    "loss": teacher_forced.get("loss"),
                    "ce": teacher_forced.get("ce"),
                    "tau_teacher_forced": teacher_forced.get("teacher_forced_tau"),
                    "tau_measured": speculative.get("tau"),
                    **context_length_scalars(speculative),
                },
            )
            if speculative.get("by_context_length"):
                self.curves.log_text(
                    step, "eval/tau_by_context_length", describe_by_context_length(speculative)
                )

    def checkpoint_written(self) -> None:
        if self.curves is not None:
            self.curves.rotate()

    def queue_checkpoint_report(
        self, step: int, checkpoint_uri: str | None, epoch: int, evaluation: dict[str, Any] | None
    ) -> None:
        self._pending.append(
            {
                "step": step,
                "checkpoint": checkpoint_uri,
                "epoch": epoch,
                "train": self.metrics.last_window or None,
                "tokens_per_second": self.metrics.tokens_per_second,
                "eval": (evaluation or {}).get("teacher_forced"),
                "speculative": (evaluation or {}).get("speculative"),
                **self.world,
            }
        )

    def send_committed(self) -> None:
        """The queued reports, once their checkpoints are committed (the caller waited for that)."""
        for report in self._pending:
            if self.on_checkpoint is not None:
                self.on_checkpoint(report)
        self._pending.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def close(self, *, failed: bool) -> None:
        try:
            if self.curves is not None:
                self.curves.close(failed=failed)
        finally:
            terminal.finish(self.task)


class QuietReporter(RunReporter):
    """A rank other than 0: keeps the figures (the same global ones), writes and draws nothing."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "on_progress": None, "on_checkpoint": None})

    def start(self, step: int) -> None:
        self.metrics = TrainMetrics(self.block_size, step, self.total_steps, self.world["world_size"])

    def step(self, step, epoch, epochs, lr, stats, grad_norm, seconds, skipped=0):
        self.metrics.add_step(stats)

    def status(self, text: str, step: int) -> None:
        pass

    def close(self, *, failed: bool) -> None:
        pass


def context_length_scalars(speculative: dict[str, Any]) -> dict[str, float]:
    """`tau_measured_<bucket>` and `prompts_<bucket>` for each context-length bucket that had a prompt."""
    scalars: dict[str, float] = {}
    for name, entry in (speculative.get("by_context_length") or {}).items():
        if entry.get("tau") is not None:
            scalars[f"tau_measured_{name}"] = float(entry["tau"])
        scalars[f"prompts_{name}"] = float(entry["prompts"])
    return scalars
