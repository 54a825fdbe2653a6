"""Training until flat: the rule on hand-computed curves (the last third of the run must add 3 % to the
best τ; the best checkpoint is the highest τ, the earlier on a tie), and a real run on the tiny target that
stops on its own, exports its best checkpoint, and stays stopped when run again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import TrainResult, train_drafter
from dflash_assets.training.until_flat import best_point, evaluation_cadence, flat_reason


def curve(*points: tuple[int, float | None], teacher_forced: bool = False) -> list[dict]:
    key, other = ("teacher_forced_tau", "tau") if teacher_forced else ("tau", "teacher_forced_tau")
    return [{"step": step, key: tau, other: None, "ce": None} for step, tau in points]


def test_a_curve_whose_last_third_added_under_3_percent_is_flat_and_says_by_how_much() -> None:
    # last 600, the third from step 400: best before 1.80 (step 400), best after 1.82 (step 600): +1.1 %.
    points = curve((0, 1.0), (200, 1.6), (400, 1.8), (500, 1.79), (600, 1.82))
    assert flat_reason(points) == (
        "flat: held-out tau rose +1.1 % over the last third (steps 400-600), under 3 %"
    )


def test_a_curve_still_rising_is_not_flat() -> None:
    # best before step 400: 1.80; after: 1.86, +3.3 %.
    assert flat_reason(curve((0, 1.0), (200, 1.6), (400, 1.8), (500, 1.83), (600, 1.86))) is None


def test_a_noisy_curve_is_judged_by_its_best_points_not_its_last() -> None:
    # The last point dips below everything, but the best after step 400 (1.90 at 500) is +5.6 % on the best
    # before (1.80): still rising.
    assert flat_reason(curve((0, 1.0), (200, 1.8), (400, 1.7), (500, 1.9), (600, 1.5))) is None
    # A spike before the last third that nothing after beats: the late best (1.7) is below it, -10.5 %.
    assert flat_reason(curve((0, 1.0), (200, 1.9), (400, 1.6), (500, 1.7), (600, 1.65))) == (
        "flat: held-out tau rose -10.5 % over the last third (steps 400-600), under 3 %"
    )


def test_fewer_than_four_evaluated_points_after_the_baseline_never_say_flat() -> None:
    assert flat_reason(curve((0, 1.5), (100, 1.5), (200, 1.5), (300, 1.5))) is None
    assert flat_reason(curve((0, 1.5), (100, 1.5), (200, 1.5), (300, 1.5), (400, 1.5))) is not None
    assert flat_reason([]) is None


def test_points_without_a_tau_are_left_out_and_teacher_forced_tau_stands_in_when_none_is_measured() -> None:
    # A point without measured tau does not count towards the four: (300, None) leaves three.
    assert flat_reason(curve((0, 1.5), (100, 1.5), (200, 1.5), (300, None), (400, 1.5))) is None
    # Measured nowhere: the teacher-forced tau is judged, and the line says so. Steps 3..6, cut at 4.
    teacher_forced = curve((0, 2.0), (3, 2.5), (4, 2.6), (5, 2.61), (6, 2.62), teacher_forced=True)
    assert flat_reason(teacher_forced) == (
        "flat: held-out teacher-forced tau rose +0.8 % over the last third (steps 4-6), under 3 %"
    )


def test_the_best_checkpoint_is_the_highest_tau_the_earlier_on_a_tie_and_never_the_baseline() -> None:
    assert best_point(curve((0, 1.9), (100, 1.5), (200, 1.7), (300, 1.7), (400, 1.6)))["step"] == 200
    assert best_point(curve((0, 1.9))) is None
    assert best_point(curve((0, 1.0), (100, None), (200, 1.2)))["step"] == 200


def test_about_twelve_evaluations_a_run_when_no_interval_is_given() -> None:
    assert [evaluation_cadence(n) for n in (1, 12, 13, 240, 1000)] == [1, 1, 2, 20, 84]


def flat_settings(**overrides: object) -> TrainSettings:
    """A run whose curve is flat from the start: a learning rate that moves the weights (AdamW's step is
    about lr whatever the gradient) but never an argmax, so the held-out τ stays the untrained one's."""
    fields = {
        "mode": "online",
        "max_steps": 48,  # the cap; no interval given: an evaluation every ceil(48 / 12) = 4 steps
        "lr": 1e-6,
        "lr_schedule": "constant",
        "num_anchors": 8,
        "global_batch_size": 4,
        "eval_samples": 2,
        "spec_eval_prompts": 0,  # no target decoding: the teacher-forced τ is judged
        "log_every_steps": 1,
        "checkpoint_every_minutes": None,
        "until_flat": True,
    }
    return TrainSettings(**{**fields, **overrides})


def test_a_run_until_flat_stops_before_its_cap_exports_its_best_checkpoint_and_says_why(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"

    def run(work: str, lines: list[str]) -> TrainResult:
        return train_drafter(
            config,
            flat_settings(),
            OnlineData(samples, capture),
            store=open_store(str(store_dir)),
            run="flat",
            work_dir=tmp_path / work,
            log=lines.append,
        )

    def checkpoint_weights(step: int) -> dict[str, torch.Tensor]:
        return load_file(str(store_dir / "checkpoints" / "flat" / f"step_{step:08d}" / "model.safetensors"))

    lines: list[str] = []
    first = run("first", lines)
    assert any("until flat: evaluating every 4 steps" in line for line in lines)
    # Evaluated at 4, 8, 12, 16: four points after the baseline, all at the baseline's τ. At 16 the last
    # third (after step 10.7) added nothing to the best before it.
    assert [p["step"] for p in first.evaluations] == [0, 4, 8, 12, 16]
    assert first.steps == 16 < first.total_steps == 48
    assert first.stop_reason == (
        "flat: held-out teacher-forced tau rose +0.0 % over the last third (steps 11-16), under 3 %"
    )
    # Every checkpoint ties: the earliest is the best, and its weights are exported, not the last step's.
    assert first.exported_step == 4
    best, last = checkpoint_weights(4), checkpoint_weights(16)
    exported = first.model.state_dict()
    assert all(torch.equal(exported[name].cpu(), weight) for name, weight in best.items())
    assert not all(torch.equal(exported[name].cpu(), weight) for name, weight in last.items())
    assert first.teacher_forced_tau == first.evaluations[1]["teacher_forced_tau"]

    again_lines: list[str] = []
    again = run("again", again_lines)  # the same run materialised again: it stopped, so it stays stopped
    assert again.resumed_from_step == again.steps == 16 and again.checkpoints == []
    assert not any(line.startswith("step ") for line in again_lines)
    assert again.stop_reason == first.stop_reason and again.exported_step == 4
    assert [p["step"] for p in again.evaluations] == [0, 4, 8, 12, 16]  # the curve the checkpoint carried
    exported = again.model.state_dict()  # the best checkpoint's weights, read back from the store
    assert all(torch.equal(exported[name].cpu(), weight) for name, weight in best.items())
    assert again.teacher_forced_tau == first.teacher_forced_tau


def test_under_wsd_a_flat_curve_starts_the_decay_and_the_run_ends_where_the_decay_does(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    """The same flat run under `wsd`: flat at step 16 (the cap's decay would start at 38), the rate decays
    over a quarter of those 16 steps (a fifth of the run) and the run ends at 20; run again, it stays
    ended, which only the decay the checkpoint carries can say (the cap is 48)."""
    store_dir = tmp_path / "store"

    def run(work: str, lines: list[str]) -> TrainResult:
        return train_drafter(
            config,
            flat_settings(lr_schedule="wsd", lr=1e-6),
            OnlineData(samples, capture),
            store=open_store(str(store_dir)),
            run="wsd",
            work_dir=tmp_path / work,
            log=lines.append,
        )

    lines: list[str] = []
    first = run("first", lines)
    assert any("the learning rate holds until" in line for line in lines)
    assert [p["step"] for p in first.evaluations] == [0, 4, 8, 12, 16, 20]
    assert first.steps == 20 and first.stop_reason == (
        "flat: held-out teacher-forced tau rose +0.0 % over the last third (steps 11-16), under 3 % at the "
        "held learning rate; it then decayed over steps 16-20"
    )
    # The rate each step's log line shows: warm-up over 2 steps (4 % of 48), held, then 1e-6 x 1, 3/4, ...
    rates = [float(line.split(" lr ")[1].split()[0]) for line in lines if line.startswith("step ")]
    assert rates == pytest.approx([5e-7] + [1e-6] * 16 + [7.5e-7, 5e-7, 2.5e-7], rel=1e-2)

    again_lines: list[str] = []
    again = run("again", again_lines)
    assert again.resumed_from_step == again.steps == 20 and again.checkpoints == []
    assert not any(line.startswith("step ") for line in again_lines)
    assert again.stop_reason == first.stop_reason


def test_a_run_not_until_flat_exports_its_last_step_and_says_it_reached_its_cap(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    result = train_drafter(
        config,
        flat_settings(until_flat=False, max_steps=4, checkpoint_every_steps=2),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="capped",
        work_dir=tmp_path / "work",
    )
    assert result.steps == 4 and result.exported_step == 4
    assert result.stop_reason == "max_steps reached (cap 4)"


def test_until_flat_without_held_out_samples_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="DFLASH_TRAIN_UNTIL_FLAT"):
        flat_settings(eval_samples=0)
