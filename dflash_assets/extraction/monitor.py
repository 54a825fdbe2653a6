"""One extraction run's progress: the range counters of `storage/range_progress.py` with the device,
the samples extracted and uploaded by this run, reported as a log line and an `ExtractionProgress`
snapshot (what a monitor shows per device) every few seconds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from dflash_assets.storage.range_progress import RangeCounters, RangeProgress, eta_text
from dflash_assets.storage.store import ObjectInfo
from dflash_assets.storage.units import human_bytes
from dflash_assets.storage.uploader import Uploader


@dataclass(frozen=True, kw_only=True)
class ExtractionProgress(RangeProgress):
    """A range's extraction on one device (the samples: stored, finished in staging, or extracted now)."""

    device: str
    extracted_this_run: int
    uploaded_this_run: int

    @property
    def done_this_run(self) -> int:
        return self.extracted_this_run

    def status_figures(self) -> str:
        return f"{self.tokens_per_s:,.0f} tokens/s · staging {human_bytes(self.staging_bytes)}"


class ExtractionCounters(RangeCounters[ExtractionProgress]):
    """Counters of one extraction run; `count(samples, tokens)` as batches are written."""

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
        super().__init__(samples_total, uploader, log, every_s, on_progress)
        self.device = device
        self.uploads = uploads

    def snapshot(self, reason: str | None = None) -> ExtractionProgress:
        figures = self.range_figures(reason)
        return ExtractionProgress(
            **figures,
            device=self.device,
            extracted_this_run=figures["samples_done"] - self.already_done,
            uploaded_this_run=self.uploads.count(),
        )

    def line(self, progress: ExtractionProgress) -> str:
        return (
            f"{self.device}: {progress.samples_done}/{progress.samples_total} samples extracted "
            f"({progress.extracted_this_run} this run, {progress.uploaded_this_run} uploaded this run) | "
            f"{progress.samples_per_s:.2f} samples/s, {progress.tokens_per_s:,.0f} tokens/s | "
            f"ETA {eta_text(progress)} | staging {human_bytes(progress.staging_bytes)} / "
            f"{human_bytes(progress.staging_budget_bytes)} | uploads in flight {progress.uploads_in_flight}, "
            f"uploaded {human_bytes(progress.uploaded_bytes)}"
        )


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
