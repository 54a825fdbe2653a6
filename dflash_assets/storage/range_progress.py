"""One run's progress over a sample range: samples done (before this run and by it), rates, ETA, local
staging and uploads, reported as a log line and a snapshot every few seconds and once at the end.

Extraction (`extraction/monitor.py`) and regeneration (`generation/regenerate.py`) count with one
`RangeCounters`; each adds its own figures to the snapshot (a `RangeProgress` of its own) and to the line.
It lives with storage because half of what it reports is the uploader's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from dflash_assets.storage.uploader import Uploader


@dataclass(frozen=True, kw_only=True)
class RangeProgress:
    """A snapshot of one range, handed to `on_progress`: what a monitor shows per range."""

    unit: ClassVar[str] = "samples"  # what the range counts, for a status line

    samples_total: int  # every sample of the range
    samples_done: int  # already done before this run, plus this run's
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None  # None while the rate is unknown
    staging_bytes: int
    staging_budget_bytes: int
    uploads_in_flight: int  # queued + uploading
    uploaded_bytes: int
    reason: str | None = None  # what the run is waiting for, if anything; "done" at the end

    @property
    def fraction_done(self) -> float:
        return self.samples_done / self.samples_total if self.samples_total else 1.0

    @property
    def done_this_run(self) -> int:
        raise NotImplementedError

    def status_figures(self) -> str:
        """The few figures a one-line status shows beside the count and the rate."""
        raise NotImplementedError


P = TypeVar("P", bound=RangeProgress)


class RangeCounters(Generic[P]):
    """Counters of one run over a range; a subclass makes the snapshot (`snapshot`) and the line (`line`).

    `count` may be called from several threads (an engine's callbacks)."""

    def __init__(
        self,
        samples_total: int,
        uploader: Uploader,
        log: Callable[[str], None],
        every_s: float,
        on_progress: Callable[[P], None] | None,
    ) -> None:
        self.samples_total = samples_total
        self.uploader = uploader
        self.log = log
        self.every_s = every_s
        self.on_progress = on_progress
        self.already_done = 0
        self.done_this_run = 0
        self.tokens_this_run = 0
        self._to_do = samples_total
        self._lock = threading.Lock()
        self._started = self._last = time.monotonic()

    def start(self, to_do: int) -> None:
        """The run begins the work left: `to_do` of the range's samples (the rest were done before)."""
        self._to_do = to_do
        self.already_done = self.samples_total - to_do
        self._started = time.monotonic()

    def count(self, samples: int, tokens: int) -> None:
        with self._lock:
            self.done_this_run += samples
            self.tokens_this_run += tokens

    def range_figures(self, reason: str | None) -> dict[str, Any]:
        """The fields every `RangeProgress` has, as of now."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        with self._lock:
            done, tokens = self.done_this_run, self.tokens_this_run
        rate = done / elapsed
        remaining = self._to_do - done
        uploads = self.uploader.stats
        return {
            "samples_total": self.samples_total,
            "samples_done": self.already_done + done,
            "samples_per_s": rate,
            "tokens_per_s": tokens / elapsed,
            "eta_s": remaining / rate if rate > 0 else (0.0 if remaining <= 0 else None),
            "staging_bytes": uploads.staging_bytes,
            "staging_budget_bytes": uploads.staging_budget_bytes,
            "uploads_in_flight": uploads.queued + uploads.in_flight,
            "uploaded_bytes": uploads.uploaded_bytes,
            "reason": reason,
        }

    def snapshot(self, reason: str | None = None) -> P:
        raise NotImplementedError

    def line(self, progress: P) -> str:
        raise NotImplementedError

    def report(self, reason: str | None = None) -> None:
        """One progress line (and `on_progress` snapshot) now, whatever the interval."""
        self._last = time.monotonic()
        progress = self.snapshot(reason)
        self.log(self.line(progress) + (f" | {reason}" if reason else ""))
        if self.on_progress is not None:
            self.on_progress(progress)

    def maybe_report(self, reason: str | None = None) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.report(reason)

    def wait_for_uploads(self) -> None:
        """Wait until every submitted upload is confirmed, reporting meanwhile; raises if one failed."""
        while not self.uploader.wait_idle(timeout_s=max(self.every_s, 0.05)):
            self.maybe_report(reason="waiting for uploads")
        self.uploader.flush()  # raises if an upload failed for good


def eta_text(progress: RangeProgress) -> str:
    return f"{progress.eta_s:,.0f} s" if progress.eta_s is not None else "unknown"
