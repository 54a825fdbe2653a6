"""The evaluations a run makes at each checkpoint (and of its untrained weights): the teacher-forced loss
and acceptance on the held-out samples, and acceptance measured by speculative decoding with the target.

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
from dflash_assets.drafter.evaluate import BlockMetrics, block_metrics
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import DrafterBatch
from dflash_assets.drafter.speculative import (
    SpeculativeEvaluator,
    TargetVerifier,
    combine_results,
    held_out_prompts,
    spread_over_lengths,
    stop_token_ids_of,
)
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
        self._prompts: list[list[int]] | None = None  # from the first evaluation's held-out rows
        self._speculative: SpeculativeEvaluator | None = None

    def evaluate(self, model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """`{"teacher_forced": ..., "speculative": ...}` on the held-out samples (None without any), the
        same on every rank: every rank evaluates its share, then the ranks add their figures."""
        if not self.eval_ids:
            return None
        self._report(f"evaluating {len(self.eval_ids)} held-out samples")
        rows: list[tuple[int, list[int], list[int]]] = []  # (sample index, token ids, loss mask)

        def remember(stream: Iterator[DrafterBatch]) -> Iterator[DrafterBatch]:
            for batch in stream:
                if self._prompts is None:  # the first evaluation: keep the tokens, not the states
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
        first = self._prompts is None
        gathered = self.collective.all_gather_object((metrics.totals(), rows if first else []), long=True)
        teacher_forced = BlockMetrics.summed(model.config.block_size, [g[0] for g in gathered]).as_dict()
        if first:
            every_row = sorted(row for g in gathered for row in g[1])  # by sample index: any world size
            limit = max(1, self.settings.max_length - self.settings.spec_eval_max_new_tokens)
            prompts = held_out_prompts([r[1] for r in every_row], [r[2] for r in every_row], limit)
            self._prompts = spread_over_lengths(prompts, self.settings.spec_eval_prompts)
        mine = self._speculative_decoding(model, optimizer)
        speculative = combine_results(self.collective.all_gather_object(mine, long=True))
        if speculative is not None and not speculative["matches_target_greedy"]:
            self.log(
                "WARNING: speculative decoding differs from the target's greedy decoding on held-out "
                f"prompts {speculative['mismatched_prompts']} (ties in the target's logits, or a "
                "verification bug)"
            )
        return {"teacher_forced": teacher_forced, "speculative": speculative}

    def _batches(self, attention: str) -> Iterator[DrafterBatch]:
        lengths = self.source.lengths
        budget = self._micro_batch_bytes()
        micro = micro_batches(self.share, lengths, self.config, self.settings, budget, attention)
        samples = self.source.iterate([i for batch in micro for i in batch], "eval")
        for batch in micro:
            yield self.source.collate([next(samples) for _ in batch])

    def _my_prompts(self) -> list[tuple[int, list[int]]]:
        """(index among the evaluated prompts, prompt) of this rank's share."""
        prompts = (self._prompts or [])[: self.settings.spec_eval_prompts]
        world, rank = self.collective.world_size, self.collective.rank
        return [(i, prompt) for i, prompt in enumerate(prompts) if i % world == rank]

    def _speculative_decoding(
        self, model: DFlashDrafter, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        mine = self._my_prompts()
        prompts = [prompt for _, prompt in mine]
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
        ) as target:
            if target is not None:
                try:
                    result = target.run(lambda verifier: self._decode(model, verifier, prompts))
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
        with self._autocast(), decoding_threads(verifier.model):  # one thread for a small CPU target
            result = self._speculative.evaluate(model)
        numbering = [index for index, _ in self._my_prompts()]  # this rank's prompts, in every rank's numbers
        return {**result, "mismatched_prompts": [numbering[i] for i in result["mismatched_prompts"]]}
