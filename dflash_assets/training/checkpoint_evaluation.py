"""The evaluations a run makes at each checkpoint (and of its untrained weights): the teacher-forced loss
and acceptance on the held-out samples, and acceptance measured by speculative decoding with the target
through the one measurement (`evaluation/measure.py`), on the prompts of the one held-out rule
(`evaluation/prompt_sets.held_out_prompt_set`) and with the weights rounded as the export stores them: so
the curve's last point is what `drafter_evaluations` measures on `held_out` at the same prompts and budget.

Every rank evaluates its share and the ranks add their sums (`distributed.py`'s object collectives,
waiting with the long timeout): the held-out samples are split as a training batch is (balanced by
tokens), the held-out prompts by number (prompt i on rank i mod the world size), so an evaluation takes
1/N of its time on N ranks and its figures do not depend on N. The speculative decoding needs the target:
online each rank has its replicas; offline each rank loads it for the evaluation only, where it fits
(`memory.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import weights_as_exported
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import DrafterBatch
from dflash_assets.drafter.speculative import TargetVerifier, stop_token_ids_of
from dflash_assets.drafter.teacher_forced import BlockMetrics, block_metrics
from dflash_assets.evaluation.loaders import max_prompt_tokens
from dflash_assets.evaluation.measure import combine_figures, greedy_reference, measure
from dflash_assets.evaluation.prompt_sets import Prompt, PromptSet, held_out_prompt_set
from dflash_assets.target.model import load_target_model
from dflash_assets.target.threads import decoding_threads
from dflash_assets.training.distributed import SingleProcess
from dflash_assets.training.memory import DeviceMemory, TorchDeviceMemory, target_for_evaluation
from dflash_assets.training.plan import micro_batches, rank_share
from dflash_assets.training.settings import TrainSettings


class Evaluator:
    """Evaluates the drafter on the run's fixed held-out samples, this rank's share of them, and adds the
    ranks' figures (`collective`; default one process). `target_verifier` is the loaded target (online
    training); without it the target is loaded for each speculative evaluation and released after it."""

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
        collective: Any = None,
    ) -> None:
        self.source, self.eval_ids = source, list(eval_ids)
        self.collective = collective or SingleProcess()
        ordered = sorted(self.eval_ids, key=lambda i: (-source.lengths[i], i))
        self.share = rank_share(ordered, source.lengths, self.collective.world_size, self.collective.rank)
        self.config, self.settings = config, settings
        self._autocast, self._micro_batch_bytes = autocast, micro_batch_bytes
        self._report, self.log = report, log
        self._target_verifier = target_verifier
        self._device_memory = device_memory or TorchDeviceMemory()
        self._spare_device = spare_device
        self.prompts: PromptSet | None = None  # from the first evaluation's held-out rows
        self.verifier: TargetVerifier | None = None  # None between evaluations, where the target is released
        self._greedy: list[list[int]] | None = None  # the target's own output of this rank's prompts
        self._stops: set[int] | None = None  # the target's end-of-turn ids, read from its tokenizer once

    def evaluate(self, model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """`{"teacher_forced": ..., "speculative": ...}` on the held-out samples (None without any), the
        same on every rank: every rank evaluates its share, then the ranks add their figures."""
        if not self.eval_ids:
            return None
        self._report(f"evaluating {len(self.eval_ids)} held-out samples")
        rows: list[tuple[int, list[int], list[int]]] = []  # (sample index, token ids, loss mask)

        def remember(stream: Iterator[DrafterBatch]) -> Iterator[DrafterBatch]:
            for batch in stream:
                if self.prompts is None:  # the first evaluation: keep the tokens, not the states
                    for row, length in enumerate(batch.lengths.tolist()):
                        ids, mask = batch.input_ids[row, :length], batch.loss_mask[row, :length]
                        rows.append((batch.sample_indices[row], ids.tolist(), mask.tolist()))
                yield batch

        with self._autocast():
            metrics = block_metrics(
                model,
                remember(self._batches(model.attention_backend)),
                objective=self.settings.objective,
                num_anchors=self.settings.num_anchors,
                seed=self.settings.seed,
                tokens_per_anchor=self.settings.tokens_per_anchor,
            )
        first = self.prompts is None
        gathered = self.collective.all_gather_object((metrics.totals(), rows if first else []), long=True)
        teacher_forced = BlockMetrics.summed(model.config.block_size, [g[0] for g in gathered]).as_dict()
        if first:
            every_row = [row for g in gathered for row in g[1]]  # the rule orders them: any world size
            self.prompts = held_out_prompt_set(
                every_row,
                count=self.settings.spec_eval_prompts,
                max_prompt_tokens=max_prompt_tokens(
                    self.config.target_model, self.settings.spec_eval_max_new_tokens
                ),
            )
        mine = self._speculative_decoding(model, optimizer)
        speculative = combine_figures(self.collective.all_gather_object(mine, long=True))
        if speculative is not None and speculative["mismatched"]:
            self.log(
                "WARNING: speculative decoding differs from the target's greedy decoding on held-out "
                f"prompts {[item['prompt'] for item in speculative['mismatched']]} (ties in the target's "
                "logits, or a verification bug)"
            )
        return {"teacher_forced": teacher_forced, "speculative": speculative}

    def _batches(self, attention: str) -> Iterator[DrafterBatch]:
        lengths = self.source.lengths
        budget = self._micro_batch_bytes()
        micro = micro_batches(self.share, lengths, self.config, self.settings, budget, attention)
        samples = self.source.iterate([i for batch in micro for i in batch], "eval")
        for batch in micro:
            yield self.source.collate([next(samples) for _ in batch])

    def _my_prompts(self) -> list[Prompt]:
        """This rank's share of the held-out prompts: prompt i on rank i mod the world size."""
        prompts = self.prompts.prompts if self.prompts is not None else []
        world, rank = self.collective.world_size, self.collective.rank
        return [prompt for i, prompt in enumerate(prompts) if i % world == rank]

    def _speculative_decoding(
        self, model: DFlashDrafter, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        prompts = self._my_prompts()
        if not prompts:
            return None
        self._report(f"speculative decoding with the target on {len(prompts)} held-out prompts")
        if self._target_verifier is not None:
            return self._decode(model, self.verifier or self._target_verifier(), prompts)
        # Offline, the target is loaded for this evaluation only and its memory given back to training
        # after it (a 27B target is ~54 GB in bf16); it is loaded again at the next checkpoint. Where it
        # does not fit, the evaluation is skipped with a warning, never the run.
        result = None
        with target_for_evaluation(
            load=lambda device: TargetVerifier(
                load_target_model(self.config.target_model, device), self.config.target_layer_ids
            ),
            target_model=self.config.target_model,
            prompts=[prompt.token_ids for prompt in prompts],
            new_tokens=self.settings.spec_eval_max_new_tokens,
            drafter_device=self.settings.device,
            optimizer=optimizer,
            memory=self._device_memory,
            spare_device=self._spare_device,
            log=self.log,
        ) as target:
            if target is not None:
                try:
                    result = target.run(lambda verifier: self._decode(model, verifier, prompts))
                finally:
                    self.verifier = None
        return result

    def _decode(
        self, model: DFlashDrafter, verifier: TargetVerifier, prompts: list[Prompt]
    ) -> dict[str, Any]:
        """The one measurement of this rank's prompts, with the weights as the export will hold them; the
        target's greedy output of them is decoded at the first evaluation and reused."""
        self.verifier = verifier
        if self._stops is None:
            self._stops = stop_token_ids_of(self.config.target_model)
        stops = self._stops
        new_tokens = self.settings.spec_eval_max_new_tokens
        # On a CPU the export is measured in float32 without autocast (`evaluation/loaders.py`): so is this.
        autocast = self._autocast() if model.device.type == "cuda" else contextlib.nullcontext()
        with autocast, decoding_threads(verifier.model):  # one thread for a small CPU target
            if self._greedy is None:
                self._greedy = greedy_reference(
                    verifier, prompts, max_new_tokens=new_tokens, stop_token_ids=stops
                )
            with weights_as_exported(model):
                figures = measure(
                    model,
                    verifier,
                    prompts,
                    self._greedy,
                    max_new_tokens=new_tokens,
                    stop_token_ids=stops,
                    block_size=model.config.block_size,
                )
        return figures.as_dict()
