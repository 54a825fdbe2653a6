"""When a run's held-out τ curve has stopped moving (`DFLASH_TRAIN_UNTIL_FLAT`), and which of its
checkpoints is the best: plain functions of the curve, so every rank, holding the same curve, decides alike.

The rule: with at least 4 evaluated points after the baseline (step 0), let `last` be the latest evaluated
step; the run is flat when the best τ among the points with step > 2/3·last is less than 3 % above the
best τ among the points at or before 2/3·last (the baseline included): the last third of the run added
under 3 %. τ is the measured acceptance length (`tau`) where the run measures it, else the teacher-forced
one; a point without it is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MIN_POINTS = 4  # evaluated points after the baseline before the rule may say flat
LAST_PART = 1 / 3  # the part of the run, by steps, that must add something
MIN_RISE = 0.03  # what that last third must add to the best τ before it, relative
EVALUATIONS_PER_RUN = 12  # the cadence of evaluations when no checkpoint interval is given


def evaluation_cadence(total_steps: int) -> int:
    """Steps between evaluations when none are given: about 12 over the run, so the rule has a curve."""
    return max(1, math.ceil(total_steps / EVALUATIONS_PER_RUN))


def tau_key(curve: Sequence[dict[str, Any]]) -> str:
    """`tau` (measured by speculative decoding) where any point has it, else `teacher_forced_tau`: one
    kind of τ for the whole curve, never a mix."""
    return "tau" if any(point.get("tau") is not None for point in curve) else "teacher_forced_tau"


def _taus(curve: Sequence[dict[str, Any]]) -> tuple[str, dict[int, float]]:
    """(the τ used, step -> τ) over the points that have it; a step evaluated twice keeps its last."""
    key = tau_key(curve)
    return key, {int(p["step"]): float(p[key]) for p in curve if p.get(key) is not None}


def flat_reason(curve: Sequence[dict[str, Any]]) -> str | None:
    """One line saying the curve is flat (and by how much the last third rose), or None while it is not,
    or has too few points to say."""
    key, taus = _taus(curve)
    if sum(1 for step in taus if step > 0) < MIN_POINTS:
        return None
    last = max(taus)
    cut = last * (1 - LAST_PART)
    early = [tau for step, tau in taus.items() if step <= cut]
    late = [tau for step, tau in taus.items() if step > cut]
    if not early or max(early) <= 0:  # a curve resumed without its start: nothing to compare with
        return None
    rise = max(late) / max(early) - 1
    if rise >= MIN_RISE:
        return None
    what = "held-out tau" if key == "tau" else "held-out teacher-forced tau"
    return (
        f"flat: {what} rose {rise * 100:+.1f} % over the last third (steps {round(cut)}-{last}), "
        f"under {MIN_RISE * 100:g} %"
    )


def best_point(curve: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The checkpoint's point with the highest τ (the baseline is no checkpoint), the earlier on a tie;
    None without one."""
    key, taus = _taus(curve)
    trained = sorted(step for step in taus if step > 0)
    if not trained:
        return None
    best = max(trained, key=lambda step: (taus[step], -step))
    return next(p for p in reversed(curve) if int(p["step"]) == best)
