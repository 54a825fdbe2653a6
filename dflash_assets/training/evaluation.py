"""The evaluations a run makes at each checkpoint (and of its untrained weights): the teacher-forced loss
and acceptance on the held-out samples, and acceptance measured by speculative decoding with the target.

Rank 0 alone evaluates (the other ranks wait for it, `distributed.py`): the held-out samples are few,
and the speculative decoding needs the target, which offline training loads for the evaluation only,
where it fits (`memory.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.evaluate import evaluate_drafter
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import DrafterBatch
from dflash_assets.drafter.speculative import (
    SpeculativeEvaluator,
    TargetVerifier,
    held_out_prompts,
    stop_token_ids_of,
)
from dflash_assets.target.model import load_target_model
from dflash_assets.training.memory import DeviceMemory, TorchDeviceMemory, target_for_evaluation
from dflash_assets.training.plan import micro_batches
from dflash_assets.training.settings import TrainSettings


class Evaluator:
    """Evaluates the drafter on the run's fixed held-out samples. `target_verifier` is the loaded target
    (online training); without it the target is loaded for each speculative evaluation and released
    after it."""

    def __init__(
        self,
        source: Any,  # OfflineSource / OnlineSource (`data.py`)
        eval_ids: Sequence[int],
        config: DrafterConfig,
        settings: TrainSettings,
        *,
        autocast: Callable[[], contextlib.AbstractContextManager],
        micro_batch_bytes: Callable[[], int],
        report: Callable[[str], None],
        log: Callable[[str], None],
        target_verifier: Callable[[], TargetVerifier] | None = None,
        device_memory: DeviceMemory | None = None,
        spare_device: Callable[[], contextlib.AbstractContextManager[str | None]] | None = None,
    ) -> None:
        self.source, self.eval_ids = source, list(eval_ids)
        self.config, self.settings = config, settings
        self._autocast, self._micro_batch_bytes = autocast, micro_batch_bytes
        self._report, self.log = report, log
        self._target_verifier = target_verifier
        self._device_memory = device_memory or TorchDeviceMemory()
        self._spare_device = spare_device
        self._prompts: list[list[int]] | None = None  # from the first evaluation's held-out rows
        self._speculative: SpeculativeEvaluator | None = None

    def evaluate(self, model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """`{"teacher_forced": ..., "speculative": ...}` on the held-out samples (None without any)."""
        if not self.eval_ids:
            return None
        self._report(f"evaluating {len(self.eval_ids)} held-out samples")
        rows: list[tuple[list[int], list[int]]] = []  # (token ids, loss mask) of each held-out sample

        def remember(stream: Iterator[DrafterBatch]) -> Iterator[DrafterBatch]:
            for batch in stream:
                if self._prompts is None:  # the first evaluation: keep the tokens, not the states
                    for row, length in enumerate(batch.lengths.tolist()):
                        ids, mask = batch.input_ids[row, :length], batch.loss_mask[row, :length]
                        rows.append((ids.tolist(), mask.tolist()))
                yield batch

        with self._autocast():
            teacher_forced = evaluate_drafter(
                model,
                remember(self._batches()),
                gamma=self.settings.gamma,
                num_anchors=self.settings.num_anchors,
                seed=self.settings.seed,
            )
        if self._prompts is None:
            limit = max(1, self.settings.max_length - self.settings.spec_eval_max_new_tokens)
            self._prompts = held_out_prompts([r[0] for r in rows], [r[1] for r in rows], limit)
        return {"teacher_forced": teacher_forced, "speculative": self._speculative_decoding(model, optimizer)}

    def _batches(self) -> Iterator[DrafterBatch]:
        lengths = self.source.lengths
        micro = micro_batches(
            sorted(self.eval_ids, key=lambda i: (-lengths[i], i)),
            lengths,
            self.config,
            self.settings,
            self._micro_batch_bytes(),
        )
        samples = self.source.iterate([i for batch in micro for i in batch], "eval")
        for batch in micro:
            yield self.source.collate([next(samples) for _ in batch])

    def _speculative_decoding(
        self, model: DFlashDrafter, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        prompts = (self._prompts or [])[: self.settings.spec_eval_prompts]
        if not prompts:
            return None
        self._report(f"speculative decoding with the target on {len(prompts)} held-out prompts")
        if self._target_verifier is not None:
            verifier = self._speculative.verifier if self._speculative is not None else None
            return self._decode(model, verifier or self._target_verifier(), prompts)
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
            optimizer=optimizer,
            memory=self._device_memory,
            spare_device=self._spare_device,
            log=self.log,
        ) as verifier:
            if verifier is not None:
                try:
                    result = self._decode(model, verifier, prompts)
                finally:
                    if self._speculative is not None:
                        self._speculative.verifier = None
        return result

    def _decode(
        self, model: DFlashDrafter, verifier: TargetVerifier, prompts: list[list[int]]
    ) -> dict[str, Any]:
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
            result = self._speculative.evaluate(model)
        if not result["matches_target_greedy"]:
            self.log(
                "WARNING: speculative decoding differs from the target's greedy decoding on held-out "
                f"prompts {result['mismatched_prompts']} (ties in the target's logits, or a verification bug)"
            )
        return result
