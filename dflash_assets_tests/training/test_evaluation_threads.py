"""The speculative evaluation decodes a small target on one CPU thread; training keeps the process's
threads (its larger operators gain from them), given back after each evaluation."""

from __future__ import annotations

import torch

from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings


def test_the_speculative_evaluation_runs_a_small_target_on_one_thread_and_gives_training_its_threads_back(
    config, capture, samples, tmp_path, monkeypatch
):
    import dflash_assets.training.checkpoint_evaluation as evaluation_module
    from dflash_assets.training.train import train_drafter

    in_evaluation: list[int] = []  # threads at each forward of the evaluation's target
    real_load = evaluation_module.load_target_model

    def watched_load(model_dir, device, *args, **kwargs):
        model = real_load(model_dir, device, *args, **kwargs)
        model.register_forward_pre_hook(lambda module, args: in_evaluation.append(torch.get_num_threads()))
        return model

    monkeypatch.setattr(evaluation_module, "load_target_model", watched_load)
    monkeypatch.setattr(evaluation_module, "stop_token_ids_of", lambda target: set())  # no tokenizer here
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = train_drafter(
            config,
            TrainSettings(
                mode="online",  # without a verifier given, the target is loaded for each evaluation
                max_steps=2,
                checkpoint_every_steps=None,
                checkpoint_every_minutes=None,
                num_anchors=8,
                global_batch_size=4,
                eval_samples=2,
                spec_eval_prompts=1,
                spec_eval_max_new_tokens=4,
            ),
            OnlineData(samples, capture),
            store=open_store(str(tmp_path / "store")),
            run="threads",
            work_dir=tmp_path / "work",
            log=lambda line: None,
        )
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert result.speculative is not None and result.baseline["speculative"] is not None
    assert in_evaluation and set(in_evaluation) == {1}
    assert after == 2
