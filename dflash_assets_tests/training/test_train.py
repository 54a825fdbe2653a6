"""Training the drafter: it learns, both data modes agree, and a killed run resumes exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import estimate_step_bytes
from dflash_assets.drafter.teacher_forced import evaluate_drafter
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OfflineData, OnlineData, collate_tokenized_samples
from dflash_assets.training.plan import epoch_plan, micro_batches
from dflash_assets.training.schedule import build_optimizer, lr_factor
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import TrainResult, train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    counting_samples,
    write_hidden_state_partition,
)

PARTITION = "00000000-00000099"


def quick_settings(**overrides: object) -> TrainSettings:
    fields = {
        "mode": "online",
        "epochs": 3,
        "lr": 3e-3,
        "warmup_ratio": 0.05,
        "num_anchors": 8,
        "global_batch_size": 4,
        "eval_samples": 2,
        "spec_eval_prompts": 0,
        "log_every_steps": 1,
        "checkpoint_every_minutes": None,
    }
    return TrainSettings(**{**fields, **overrides})


def train_logged(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    run: str,
    **settings: object,
) -> tuple[TrainResult, list[str]]:
    """A short online run without evaluation; its result and log lines."""
    lines: list[str] = []
    result = train_drafter(
        config,
        quick_settings(eval_samples=0, **settings),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run=run,
        work_dir=tmp_path / run,
        log=lines.append,
    )
    return result, lines


def logged_losses(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.search(r" loss (\S+) ", line))]


def test_the_drafter_learns_a_repeated_small_dataset(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    settings = quick_settings(epochs=8, log_every_steps=4)
    lines: list[str] = []
    reports: list[dict] = []
    result = train_drafter(
        config,
        settings,
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="learns",
        work_dir=tmp_path / "work",
        log=lines.append,
        on_checkpoint=reports.append,
    )

    held_out = [s for s in samples if s.sample_index in result.eval_sample_indices]
    torch.manual_seed(settings.seed)  # the trainer's initial weights
    untrained = DFlashDrafter.from_target(config)
    batch = collate_tokenized_samples(held_out, settings.max_length, capture, config)
    anchors = {"num_anchors": settings.num_anchors, "tokens_per_anchor": settings.tokens_per_anchor}
    before = evaluate_drafter(untrained, [batch], **anchors)
    after = evaluate_drafter(result.model, [batch], **anchors)
    # The plain cross-entropy per label falls (the objective's own loss is D-PACE's weighted sum).
    assert after["ce"] < before["ce"] - 1.0, (before["ce"], after["ce"])
    assert after["teacher_forced_tau"] >= before["teacher_forced_tau"]

    assert result.steps == result.total_steps > 0
    assert result.eval is not None and result.eval["loss"] == pytest.approx(after["loss"], abs=1e-4)
    assert len(result.per_position_accuracy) == config.block_size - 1
    assert reports[-1]["step"] == result.steps
    assert reports[-1]["eval"]["teacher_forced_tau"] == pytest.approx(after["teacher_forced_tau"], abs=1e-4)
    assert reports[0]["step"] == 0 and reports[0]["checkpoint"] is None  # the untrained baseline
    assert reports[0]["eval"]["loss"] == pytest.approx(before["loss"], abs=1e-4)
    assert result.checkpoints == [reports[-1]["checkpoint"]]
    progress = [line for line in lines if line.startswith("step ")]
    assert progress and all(re.search(r"step \d+/\d+ .* lr .* sequences/step .* eta ", p) for p in progress)
    trained = {i for r in result.trained_sample_ranges for i in range(int(r[:8]), int(r[9:]) + 1)}
    assert trained | set(result.eval_sample_indices) == set(range(12))
    assert not trained & set(result.eval_sample_indices)


def test_offline_and_online_training_see_the_same_batches_and_losses(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    target_dir: Path,
    tmp_path: Path,
) -> None:
    store = open_store(str(tmp_path / "store"))
    objects = write_hidden_state_partition(
        store, PARTITION, samples, capture, str(target_dir), tmp_path / "scratch"
    )
    settings = {"max_steps": 3, "eval_samples": 0}
    online_lines: list[str] = []
    online = train_drafter(
        config,
        quick_settings(**settings),
        OnlineData(samples, capture),
        store=store,
        run="online",
        work_dir=tmp_path / "online",
        log=online_lines.append,
    )
    offline_lines: list[str] = []
    offline = train_drafter(
        config,
        quick_settings(mode="offline", **settings),
        OfflineData(store, objects, tmp_path / "cache", num_tokens=[s.num_tokens for s in samples]),
        store=store,
        run="offline",
        work_dir=tmp_path / "offline",
        log=offline_lines.append,
    )

    assert offline.partitions == [PARTITION]
    assert offline.trained_sample_ranges == online.trained_sample_ranges
    # Offline objects were captured one sample at a time, online batches all at once; after rounding
    # to bf16 (the stored precision) the hidden states agree up to the target's batch-size noise.
    assert logged_losses(offline_lines) == pytest.approx(logged_losses(online_lines), rel=1e-4)
    for name, weight in online.model.state_dict().items():
        torch.testing.assert_close(offline.model.state_dict()[name], weight, rtol=1e-3, atol=1e-5)


def test_online_with_the_target_on_devices_of_its_own_runs_it_ahead_and_makes_the_same_steps(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    import threading

    calls: list[tuple[str, tuple[int, ...]]] = []

    def recorded(input_ids, attention_mask):
        calls.append((threading.current_thread().name, tuple(input_ids.shape)))
        return capture(input_ids, attention_mask)

    # One sequence per micro-batch: the next one within a step, then the next step's first, run ahead.
    settings = quick_settings(max_steps=3, eval_samples=2, micro_batch_bytes=1)
    results = {}
    for overlap in (False, True):
        calls.clear()
        results[overlap] = train_drafter(
            config,
            settings,
            OnlineData(samples, recorded, overlap=overlap),
            store=open_store(str(tmp_path / "store")),
            run=f"overlap-{overlap}",
            work_dir=tmp_path / f"overlap-{overlap}",
        )
        ahead = [shape for thread, shape in calls if thread.startswith("target-ahead")]
        assert bool(ahead) == overlap, calls
    # 12 samples, 2 held out: one epoch of 3 steps (4 + 4 + 2 sequences), each sequence its own
    # micro-batch; every one but the very first ran ahead.
    assert len(ahead) == 10 - 1
    for name, weight in results[False].model.state_dict().items():
        assert torch.equal(results[True].model.state_dict()[name], weight), name


class Killed(Exception):
    pass


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_a_killed_run_resumes_from_the_store_and_ends_at_the_same_weights(
    s3_store_url: str,
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    target_dir: Path,
    tmp_path: Path,
) -> None:
    store = open_store(s3_store_url)
    objects = write_hidden_state_partition(
        store, PARTITION, samples, capture, str(target_dir), tmp_path / "scratch"
    )
    settings = quick_settings(mode="offline", checkpoint_every_steps=2)

    def offline(cache: str) -> OfflineData:
        return OfflineData(store, objects, tmp_path / cache, num_tokens=[s.num_tokens for s in samples])

    straight = train_drafter(
        config, settings, offline("cache-a"), store=store, run="straight", work_dir=tmp_path / "a"
    )
    assert straight.steps >= 6

    def kill_at_step_5(line: str) -> None:
        if line.startswith("step 5/"):
            raise Killed(line)

    with pytest.raises(Killed):
        train_drafter(
            config,
            settings,
            offline("cache-b"),
            store=store,
            run="killed",
            work_dir=tmp_path / "b",
            log=kill_at_step_5,
        )
    lines: list[str] = []
    resumed = train_drafter(
        config,
        settings,
        offline("cache-c"),
        store=store,
        run="killed",
        work_dir=tmp_path / "c",
        log=lines.append,
    )

    assert resumed.resumed_from_step == 4 and any("resuming run killed" in line for line in lines)
    assert resumed.steps == straight.steps
    for name, weight in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], weight), name


def test_each_step_takes_a_global_batch_of_sequences_and_each_epoch_is_a_new_order() -> None:
    settings = quick_settings(global_batch_size=4)
    lengths = [s.num_tokens for s in counting_samples(10, seed=1)]
    ids = list(range(10))
    plans = [epoch_plan(lengths, ids, settings, epoch) for epoch in range(3)]
    for plan in plans:
        assert [len(step) for step in plan] == [4, 4, 2]
        assert sorted(i for step in plan for i in step) == ids
        # longest first inside a step: micro-batches of neighbours pad little
        for step in plan:
            assert [lengths[i] for i in step] == sorted((lengths[i] for i in step), reverse=True)
    assert plans[0] != plans[1]
    assert plans[0] == epoch_plan(lengths, ids, settings, 0)  # a pure function of (seed, epoch)


def test_micro_batches_fit_the_memory_budget_and_never_change_the_update(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    lengths = [s.num_tokens for s in samples]
    one = estimate_step_bytes(config, 1, max(lengths), 8)
    split = micro_batches(list(range(4)), lengths, config, quick_settings(), budget_bytes=one)
    assert split == [[0], [1], [2], [3]]
    assert micro_batches(list(range(4)), lengths, config, quick_settings(), budget_bytes=10 * one) == [
        [0, 1, 2, 3]
    ]

    def run(name: str, budget: int) -> tuple[TrainResult, list[str]]:
        return train_logged(config, capture, samples, tmp_path, name, max_steps=3, micro_batch_bytes=budget)

    whole, whole_lines = run("whole", 10 * one)
    per_sample, per_sample_lines = run("per-sample", one)
    assert "4.0 sequences/step in 1.0 micro-batches" in whole_lines[-1]
    assert "4.0 sequences/step in 4.0 micro-batches" in per_sample_lines[-1]
    # The loss is normalised over the whole global batch, so the split is invisible to the update.
    for name, weight in whole.model.state_dict().items():
        # Sums in another order, through Adam (which scales a near-zero gradient's rounding up): 1e-5 failed
        # by 1.1e-5 on one element on one CPU.
        torch.testing.assert_close(per_sample.model.state_dict()[name], weight, rtol=1e-4, atol=5e-5)


def test_a_step_budget_runs_exactly_that_many_steps_over_as_many_epochs_as_it_takes(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    # 10 training samples, 4 per step: 3 steps per epoch; 8 steps take three epochs.
    result = train_drafter(
        config,
        quick_settings(max_steps=8, epochs=1, eval_samples=2),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="budget",
        work_dir=tmp_path / "work",
    )
    assert (result.steps, result.total_steps, result.steps_per_epoch) == (8, 8, 3)


def test_the_default_recipe_is_specforges_dflash_recipe_at_the_reasoning_length() -> None:
    settings = TrainSettings()
    assert (settings.lr, settings.betas, settings.weight_decay) == (6e-4, (0.9, 0.999), 0.0)
    assert (settings.warmup_ratio, settings.lr_schedule, settings.min_lr_ratio) == (0.04, "cosine", 0.0)
    assert (settings.max_grad_norm, settings.epochs, settings.max_length) == (1.0, 6, 8192)
    assert (settings.num_anchors, settings.gamma, settings.global_batch_size) == (512, 7.0, 32)
    assert settings.max_steps is None  # epochs decide
    assert lr_factor(0, 100, settings) == pytest.approx(1 / 4)  # 4 warm-up steps
    assert lr_factor(3, 100, settings) == pytest.approx(1.0)
    assert lr_factor(99, 100, settings) == pytest.approx(0.0, abs=1e-3)  # cosine to 0


def test_wsd_holds_the_peak_after_warm_up_then_decays_linearly_over_the_runs_last_fifth() -> None:
    settings = TrainSettings(lr_schedule="wsd", min_lr_ratio=0.1)
    factors = [lr_factor(step, 100, settings) for step in range(100)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # 4 warm-up steps
    assert factors[4:80] == [1.0] * 76  # held until the last 20 steps
    # Linear from 1 at step 80 towards 0.1 at the end: the update after step 90 is halfway.
    assert factors[80] == 1.0 and factors[90] == pytest.approx(0.55) and factors[99] == pytest.approx(0.145)
    assert all(a > b for a, b in zip(factors[80:], factors[81:], strict=False))
    # Moved (until flat): a decay from step 40 to 50 ends there, whatever the cap.
    moved = [lr_factor(step, 100, settings, decay=(40, 50)) for step in (39, 40, 45, 49, 50, 99)]
    assert moved == pytest.approx([1.0, 1.0, 0.55, 0.19, 0.1, 0.1])
    with pytest.raises(ValueError, match="DFLASH_LR_SCHEDULE"):
        TrainSettings(lr_schedule="step")
    with pytest.raises(ValueError, match="lr_decay_ratio"):
        TrainSettings(lr_schedule="wsd", lr_decay_ratio=1.0)


def test_the_optimiser_is_adamw_s_fused_kernel_and_makes_the_per_tensor_loop_s_update(
    config: DrafterConfig,
) -> None:
    """One pass over every parameter (a tenth of a SmolLM2 drafter's CPU step was the per-tensor loop), the
    same update: norms without weight decay either way."""
    torch.manual_seed(0)
    models = [DFlashDrafter.from_target(config) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    settings = TrainSettings(weight_decay=0.1)
    fused = build_optimizer(models[0], settings)
    assert fused.defaults["fused"] is True
    trained = [p for p in models[1].parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    adam = {"lr": settings.lr, "betas": settings.betas, "eps": settings.adam_eps}
    looped = torch.optim.AdamW(groups, **adam, fused=False)
    for step in range(3):
        for model, optimizer in ((models[0], fused), (models[1], looped)):
            generator = torch.Generator().manual_seed(step)
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.randn(parameter.shape, generator=generator)
            optimizer.step()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_unknown_train_mode_is_rejected_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="DFLASH_TRAIN_MODE"):
        TrainSettings(mode="hybrid")


def test_running_out_of_memory_halves_the_micro_batch_budget_and_redoes_the_same_step(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dflash_assets.training.train as train_module

    lengths = [s.num_tokens for s in samples]
    one = estimate_step_bytes(config, 1, max(lengths), 8)
    real_loss = train_module.dflash_loss
    failures = []

    def loss_that_fits_one_sequence(model, batch, anchors, gamma, **kwargs):
        if len(batch.sample_indices) > 1:  # "out of memory" for anything bigger than one sequence
            failures.append(len(batch.sample_indices))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real_loss(model, batch, anchors, gamma, **kwargs)

    def run(name: str) -> tuple[TrainResult, list[str]]:
        return train_logged(config, capture, samples, tmp_path, name, max_steps=2, micro_batch_bytes=4 * one)

    unconstrained, _ = run("fits")
    monkeypatch.setattr(train_module, "dflash_loss", loss_that_fits_one_sequence)
    constrained, lines = run("out-of-memory")
    assert failures and sum("out of memory at step 1" in line for line in lines) >= 1
    assert "4.0 sequences/step in 4.0 micro-batches" in lines[-1]
    for name, weight in unconstrained.model.state_dict().items():
        # Sums in another order, through Adam (which scales a near-zero gradient's rounding up): 1e-5 failed
        # by 1.1e-5 on one element on one CPU.
        torch.testing.assert_close(constrained.model.state_dict()[name], weight, rtol=1e-4, atol=5e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_training_steps_run_with_flex_attention_under_bf16_autocast(
    config: DrafterConfig, samples: list[TokenizedSample], target_dir: Path, tmp_path: Path
) -> None:
    capture = HiddenStateCapture(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(target_dir).cuda().eval(),
        config.target_layer_ids,
    )
    lines: list[str] = []
    result = train_drafter(
        config,
        quick_settings(max_steps=3, eval_samples=0, device="cuda"),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="cuda",
        work_dir=tmp_path / "work",
        log=lines.append,
    )
    assert "flex attention on cuda" in lines[0]
    assert result.steps == 3 and result.final_loss is not None and result.skipped_nonfinite_steps == 0
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # master weights stay fp32


def test_the_target_is_loaded_for_each_speculative_evaluation_and_released_after_it(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dflash_assets.training.checkpoint_evaluation as evaluation_module
    import dflash_assets.training.train as train_module

    loads = []
    real_load = evaluation_module.load_target_model

    def counted_load(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(evaluation_module, "load_target_model", counted_load)
    monkeypatch.setattr(evaluation_module, "stop_token_ids_of", lambda target: set())  # no tokenizer here
    reports: list[dict] = []
    trainer = train_module.DrafterTrainer(
        config,
        quick_settings(
            max_steps=4, checkpoint_every_steps=2, spec_eval_prompts=1, spec_eval_max_new_tokens=4
        ),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="released",
        work_dir=tmp_path / "work",
        on_checkpoint=reports.append,
    )
    trainer.train()
    # The baseline, step 2 and step 4: three evaluations, three loads, nothing held in between.
    assert [r["step"] for r in reports] == [0, 2, 4] and all(r["speculative"] for r in reports)
    assert len(loads) == 3 and trainer.evaluator.verifier is None


def test_a_finished_run_materialised_again_reports_the_same_measured_acceptance(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dflash_assets.training.checkpoint_evaluation as evaluation_module

    monkeypatch.setattr(evaluation_module, "stop_token_ids_of", lambda target: set())  # no tokenizer here
    settings = quick_settings(
        max_steps=2, checkpoint_every_steps=2, spec_eval_prompts=1, spec_eval_max_new_tokens=4
    )
    store = open_store(str(tmp_path / "store"))

    def run(work: str) -> TrainResult:
        return train_drafter(
            config, settings, OnlineData(samples, capture), store=store, run="again", work_dir=tmp_path / work
        )

    first = run("first")
    again = run("again")  # resumes at its last checkpoint: nothing left to train
    assert again.resumed_from_step == first.steps == again.steps == 2
    assert first.acceptance_length_tau is not None and first.teacher_forced_tau is not None
    assert again.acceptance_length_tau == first.acceptance_length_tau  # measured, not left blank
    assert again.teacher_forced_tau == first.teacher_forced_tau


@pytest.mark.parametrize("has_bf16_units", [True, False])
def test_on_a_cpu_with_bf16_units_training_can_run_under_bf16_autocast_and_says_when_it_cannot(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    has_bf16_units: bool,
) -> None:
    import dflash_assets.target.bf16_matmul as bf16_matmul
    import dflash_assets.training.train as train_module

    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: has_bf16_units)
    seen: list[torch.dtype] = []
    real_loss = train_module.dflash_loss

    def watched_loss(model, *args, **kwargs):  # the dtype a matmul of the step gives
        seen.append((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)
        return real_loss(model, *args, **kwargs)

    monkeypatch.setattr(train_module, "dflash_loss", watched_loss)
    lines: list[str] = []
    result = train_drafter(
        config,
        quick_settings(max_steps=2, eval_samples=0, cpu_bf16_autocast=True),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="cpu-bf16",
        work_dir=tmp_path / "work",
        log=lines.append,
    )
    assert result.steps == 2 and result.final_loss is not None
    assert set(seen) == {torch.bfloat16 if has_bf16_units else torch.float32}
    assert any("no bf16 matrix units" in line for line in lines) is not has_bf16_units
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # master weights stay fp32


def test_train_samples_trains_the_first_n_samples_not_held_out_and_holds_out_the_same_ones(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    """A data-size sweep from one capture: each size trains on the first N samples that are not held out,
    and every size is measured on the same held-out samples."""

    def trained(train_samples: int) -> tuple[list[int], list[int]]:
        result = train_drafter(
            config,
            quick_settings(epochs=1, train_samples=train_samples, eval_samples=3),
            OnlineData(samples, capture),
            store=open_store(str(tmp_path / "store")),
            run=f"size-{train_samples}",
            work_dir=tmp_path / f"size-{train_samples}",
            log=lambda line: None,
        )
        indices = [i for r in result.trained_sample_ranges for i in range(int(r[:8]), int(r[9:]) + 1)]
        return indices, list(result.eval_sample_indices)

    every, held_out = trained(0)
    first, held_out_too = trained(4)
    assert len(every) == len(samples) - 3
    assert held_out_too == held_out  # the held-out rule does not see N
    assert first == sorted(every)[:4] and not set(first) & set(held_out)
    with pytest.raises(ValueError, match="train_samples -1"):
        quick_settings(train_samples=-1)


def test_a_checkpoint_from_before_a_setting_existed_resumes_without_a_changed_settings_warning() -> None:
    """A trajectory setting a checkpoint predates was its default when it was written: resuming it is not a
    change (a run checkpointed before `train_samples` existed warned `None -> 0`). A real change is named."""
    from dflash_assets.training.train import changed_settings

    settings = quick_settings()
    saved = json.loads(json.dumps(settings.to_dict()))
    assert changed_settings(saved, settings) == []
    del saved["train_samples"]
    assert changed_settings(saved, settings) == []
    assert changed_settings(saved, quick_settings(train_samples=5)) == ["train_samples: 0 -> 5"]
    assert changed_settings({**saved, "lr": 1e-3}, settings) == [f"lr: 0.001 -> {settings.lr!r}"]
