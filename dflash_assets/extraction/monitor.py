"""One extraction run's progress: counters reported as a log line and as an `ExtractionProgress`
snapshot (what a monitor shows per device) every few seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_assets.storage.store import ObjectInfo
from dflash_assets.storage.units import human_bytes
from dflash_assets.storage.uploader import Uploader


@dataclass(frozen=True)
class ExtractionProgress:
    """A snapshot of one range's extraction, handed to `on_progress` every `progress_every_s` seconds
    (and once more at the end): what a monitor shows per device."""

    device: str
    samples_total: int  # every sample of the range
    samples_done: int  # stored, finished in staging, or extracted by this run
    extracted_this_run: int
    uploaded_this_run: int
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None  # None while the rate is unknown
    staging_bytes: int
    staging_budget_bytes: int
    uploads_in_flight: int  # queued + uploading
    uploaded_bytes: int
    reason: str | None = None  # what the run is waiting for, if anything

    @property
    def fraction_done(self) -> float:
        return self.samples_done / self.samples_total if self.samples_total else 1.0


class ExtractionCounters:
    """Counters of one run, reported as a log line and an `ExtractionProgress` every `every_s` seconds."""

    def __init__(
        self,
        device: str,
        samples_total: int,
        uploader: Uploader,
        uploads: UploadRecord,
        log: Callable[[str], None],
        every_s: float,
        on_progress: Callable[[ExtractionProgress], None] | None,
    ) -> None:
        self.device = device
        self.samples_total = samples_total
        self.uploader = uploader
        self.uploads = uploads
        self.log = log
        self.every_s = every_s
        self.on_progress = on_progress
        self.extracted = 0
        self.extracted_tokens = 0
        self.total_to_extract = 0
        self.already_done = 0
        self._started = time.monotonic()
        self._last = time.monotonic()

    def start(self, to_extract: int) -> None:
        self.total_to_extract = to_extract
        self.already_done = self.samples_total - to_extract
        self._started = time.monotonic()

    def snapshot(self, reason: str | None = None) -> ExtractionProgress:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = self.extracted / elapsed
        remaining = self.total_to_extract - self.extracted
        stats = self.uploader.stats
        return ExtractionProgress(
            device=self.device,
            samples_total=self.samples_total,
            samples_done=self.already_done + self.extracted,
            extracted_this_run=self.extracted,
            uploaded_this_run=self.uploads.count(),
            samples_per_s=rate,
            tokens_per_s=self.extracted_tokens / elapsed,
            eta_s=remaining / rate if rate > 0 else (0.0 if remaining == 0 else None),
            staging_bytes=stats.staging_bytes,
            staging_budget_bytes=stats.staging_budget_bytes,
            uploads_in_flight=stats.queued + stats.in_flight,
            uploaded_bytes=stats.uploaded_bytes,
            reason=reason,
        )

    def report(self, reason: str | None = None) -> None:
        """One progress line (and `on_progress` snapshot) now, whatever the interval."""
        self._last = time.monotonic()
        progress = self.snapshot(reason)
        eta = f"{progress.eta_s:,.0f} s" if progress.eta_s is not None else "unknown"
        self.log(
            f"{self.device}: {progress.samples_done}/{progress.samples_total} samples extracted "
            f"({progress.extracted_this_run} this run, {progress.uploaded_this_run} uploaded this run) | "
            f"{progress.samples_per_s:.2f} samples/s, {progress.tokens_per_s:,.0f} tokens/s | ETA {eta} | "
            f"staging {human_bytes(progress.staging_bytes)} / {human_bytes(progress.staging_budget_bytes)}"
            f" | uploads in flight {progress.uploads_in_flight}, uploaded "
            f"{human_bytes(progress.uploaded_bytes)}" + (f" | {reason}" if reason else "")
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def maybe_report(self, reason: str | None = None) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.report(reason)


class UploadRecord:
    """Sizes the store confirmed for this run's uploads; fed from uploader threads."""

    def __init__(self, base: str) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}

    def __call__(self, info: ObjectInfo) -> None:
        with self._lock:
            self._sizes[info.key[len(self.base) :]] = info.size

    def count(self) -> int:
        with self._lock:
            return len(self._sizes)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sizes)


def wait_for_uploads(uploader: Uploader, progress: ExtractionCounters) -> None:
    while not uploader.wait_idle(timeout_s=max(progress.every_s, 0.05)):
        progress.maybe_report(reason="waiting for uploads")
    uploader.flush()  # raises if an upload failed for good
