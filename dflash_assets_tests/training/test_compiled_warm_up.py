"""The trainer's warm-up compiles every version of flex attention that its steps and evaluations meet, so
nothing compiles inside a timed collective (counted on the CPU with `aot_eager`,
`support/compiled_flex.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.distributed import SingleProcess
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import DrafterTrainer
from dflash_assets_tests.support.compiled_flex import compiled_graphs, flex_compiled_on_cpu


class GraphsAtEachCollective(SingleProcess):
    """One process, noting how many graphs were compiled whenever a timed collective begins."""

    def __init__(self) -> None:
        self.graphs: list[tuple[str, int]] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.graphs.append(("all_reduce_sum", compiled_graphs()))
        return tensor

    def all_gather_object(self, value: Any, *, long: bool = False) -> list[Any]:
        self.graphs.append(("all_gather_object", compiled_graphs()))
        return [value]

    def long_barrier(self) -> None:
        self.graphs.append(("long_barrier", compiled_graphs()))


@pytest.mark.slow  # compiles three versions of flex attention on the CPU: a minute or more
def test_after_the_warm_up_no_training_step_or_evaluation_compiles_anything(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collective = GraphsAtEachCollective()
    # Micro-batches of one sequence and of several, the held-out evaluation (no gradients) before and after
    # the steps, and speculative decoding's drafted blocks: every kind of call the run makes.
    settings = TrainSettings(
        mode="online",
        attention="flex",
        max_steps=3,  # 9 training samples: steps of 4, 4 and 1 sequences
        num_anchors=8,
        global_batch_size=4,
        micro_batch_bytes=2**40,
        eval_samples=3,
        spec_eval_prompts=1,
        spec_eval_max_new_tokens=4,
        checkpoint_every_minutes=None,
        log_every_steps=1,
    )
    monkeypatch.setattr(
        "dflash_assets.training.checkpoint_evaluation.stop_token_ids_of", lambda target: set()
    )
    with flex_compiled_on_cpu(monkeypatch):
        trainer = DrafterTrainer(
            config,
            settings,
            OnlineData(samples, capture),
            store=open_store(str(tmp_path / "store")),
            run="warm-up",
            work_dir=tmp_path / "work",
            collective=collective,
        )
        assert trainer.compiles()
        sizes: list[tuple[bool, int]] = []
        model_forward = trainer.model.forward

        def noted(*args: Any, **kwargs: Any) -> torch.Tensor:
            sizes.append((torch.is_grad_enabled(), args[0].shape[0]))
            return model_forward(*args, **kwargs)

        monkeypatch.setattr(trainer.model, "forward", noted)
        trainer.resume()
        result = trainer.train()

    assert result.steps == 3 and result.speculative is not None
    warmed = collective.graphs[0]
    assert warmed[0] == "long_barrier" and warmed[1] > 0  # the warm-up compiled, and only then did ranks meet
    assert all(graphs == warmed[1] for _, graphs in collective.graphs), collective.graphs
    assert compiled_graphs() == warmed[1]
    # The run did meet every kind of call after its warm-up: several sequences and one with gradients,
    # several without. Speculative decoding's drafts (one block, no gradients) do not go through the
    # compiled forward: the drafter's kept context keys and values (`DraftCache`) run them.
    after = set(sizes[2:])  # after the warm-up's two forwards
    assert (True, 1) in after and any(grad and n > 1 for grad, n in after)
    assert any(not grad and n > 1 for grad, n in after)
    assert (False, 1) not in after
