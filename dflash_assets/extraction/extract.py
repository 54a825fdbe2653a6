"""Extracting one sample range: capture, write one object per sample, upload, resume exactly once.

Resumable by construction: a sample is done when its object is in the store (one listing tells), a
file under its final name in staging is complete (written atomically) and only needs uploading, and
everything else is recomputed. A fingerprint of what produced the objects keeps runs from mixing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_assets import settings
from dflash_assets.conversations.samples import TokenizedSample, samples_digest
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.monitor import (
    ExtractionCounters,
    ExtractionProgress,
    UploadRecord,
)
from dflash_assets.extraction.object_size import FINAL_STATE_KEY, check_hidden_state_dtype
from dflash_assets.extraction.resume import ExtractionIncomplete, RangeInStore, resubmit_staged
from dflash_assets.extraction.sample_format import (
    SAMPLE_FORMAT,
    parse_sample_object_name,
)
from dflash_assets.extraction.writes import GapExtraction
from dflash_assets.storage.staging import PartitionBusy, StagingDirectory, staging_lock
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.units import human_bytes, human_duration
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.batching import padding_fraction, plan_batches
from dflash_assets.target.kernels import report_kernel_paths

__all__ = [
    "ExtractionIncomplete",
    "ExtractionProgress",
    "ExtractionResult",
    "PartitionBusy",
    "extract_range",
    "extraction_fingerprint",
]


@dataclass
class ExtractionResult:
    objects: dict[
        str, int
    ]  # object name (relative to the prefix) -> size in bytes, every sample of the range
    samples: int
    tokens: int
    bytes_stored: int
    extracted_now: int
    reused_from_store: int
    reused_from_staging: int
    computed_tokens: int  # tokens pushed through the model this run, padding included
    padding_fraction: float
    duration_s: float
    samples_per_s: float  # extraction throughput of this run (extracted_now over the extraction phase)
    tokens_per_s: float
    peak_staging_bytes: int
    device: str
    fingerprint: dict[str, Any] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)  # only with drop_non_finite=True
    peak_device_memory_bytes: int | None = None
    upload_retries: int = 0
    staging_budget_bytes: int = 0

    def metadata(self) -> dict[str, Any]:
        """What the run reports about the range: numbers a UI plots across ranges, and what it stored."""
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "bytes_stored": self.bytes_stored,
            "extracted_now": self.extracted_now,
            "reused_from_store": self.reused_from_store,
            "reused_from_staging": self.reused_from_staging,
            "duration_s": float(self.duration_s),
            "duration": human_duration(self.duration_s),
            "samples_per_s": float(self.samples_per_s),
            "tokens_per_s": float(self.tokens_per_s),
            "peak_staging_bytes": self.peak_staging_bytes,
            "upload_retries": self.upload_retries,
            "staging_budget_bytes": self.staging_budget_bytes,
            "padding_fraction": float(self.padding_fraction),
            "device": self.device,
            "target_layer_ids": list(self.fingerprint.get("target_layer_ids", [])),
            "hidden_state_dtype": self.fingerprint.get("hidden_state_dtype", ""),
        }

    def summary(self) -> str:
        return (
            f"{self.samples} samples on {self.device} in {human_duration(self.duration_s)} "
            f"({self.extracted_now} extracted now, {self.reused_from_store} already in the store, "
            f"{self.reused_from_staging} recovered from local staging)"
        )


def extraction_fingerprint(
    target_model: str,
    target_layer_ids: Sequence[int],
    hidden_size: int,
    hidden_state_dtype: str = "bf16",
    made_from: dict[str, str] | None = None,
    final_state: bool = False,
) -> dict[str, Any]:
    """What must be equal for two objects to belong to the same partition: a range is never a mix of
    targets, layer sets or stored dtypes (a changed `DFLASH_HIDDEN_STATE_DTYPE` re-extracts it), of
    objects with and without the target's final state (`DFLASH_CAPTURE_FINAL_STATE`; the key is there only
    when they hold it, so a range made before it keeps its fingerprint), nor of tokenized ranges
    (`made_from`: where the samples were read and `samples_digest` of them)."""
    fingerprint: dict[str, Any] = {
        "format": SAMPLE_FORMAT,
        "target_model": target_model,
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "hidden_size": int(hidden_size),
        "hidden_state_dtype": check_hidden_state_dtype(hidden_state_dtype),
    }
    if final_state:
        fingerprint[FINAL_STATE_KEY] = True
    if made_from is not None:
        fingerprint["made_from"] = dict(made_from)
    return fingerprint


def extract_range(
    *,
    model: torch.nn.Module,
    target_model_name: str,
    samples: Sequence[TokenizedSample],
    target_layer_ids: list[int],
    store: ObjectStore,
    prefix: str,
    staging_dir: Path,
    uploader: Uploader,
    device: str | torch.device,
    max_tokens_per_batch: int = int(settings.MAX_TOKENS_PER_BATCH.default),
    max_batch_size: int | None = None,
    log: Callable[[str], None] = print,
    progress_every_s: float = 5.0,
    drop_non_finite: bool = False,
    warn: Callable[[str], None] | None = None,
    on_progress: Callable[[ExtractionProgress], None] | None = None,
    hidden_state_dtype: str = "bf16",
    source: str | None = None,
    capture: HiddenStateCapture | None = None,
    final_state: bool = False,
) -> ExtractionResult:
    """Make `<prefix>/hs_<index>.safetensors` exist in `store` for every sample, computing only the gaps.

    `model` is already on `device` (see `load_target_model`). Finished files wait in `staging_dir`
    until the uploader confirms them, so a crash or a store outage loses no finished work. A sample
    whose hidden states are not finite is retried alone (batching cannot be the cause then) and then
    fails the run, naming it; with `drop_non_finite` it is left out and reported in `result.dropped`.
    `log` gets progress lines, `warn` (default: `log` with a "WARNING: " prefix) what needs attention,
    `on_progress` the same progress as an `ExtractionProgress` (e.g. for asset observations).
    `hidden_state_dtype` is how the objects store the states: `bf16`, or `fp8` (e4m3 with a float32
    scale per token and layer, quantised on the device before the copy to the host: half the bytes).
    `source` names where the samples were read (the tokenized range's prefix): with it, the fingerprint
    records what the objects were made from (it and a digest of the samples), so staged files or
    objects made from another tokenized range are never taken for this one's. `capture` replaces the
    plain `HiddenStateCapture(model, target_layer_ids)` (a target split over devices: rank 0's, which
    has the other ranks run each forward too). `final_state` stores the target's final hidden state
    beside the layers (its forward then runs every layer and the final norm).

    The steps, in order: (1) one listing of the prefix, deleting objects another producer made;
    (2) what the store already holds; (3) finished files in staging, uploaded as they are; (4) the
    gaps, batched by length, captured, moved to the host a batch at a time and written one file per
    sample while the next batch runs; (5) wait for the uploads and check the store has every object.
    """
    started = time.monotonic()
    warn = warn or (lambda message: log(f"WARNING: {message}"))
    by_index = _index_samples(samples)
    capture = capture or HiddenStateCapture(model, target_layer_ids, final_state=final_state)
    if capture.final_state != final_state:
        raise ValueError(f"the capture's final_state is {capture.final_state}, the range's {final_state}")
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    made_from = {"tokenized": source, "samples_sha256": samples_digest(samples)} if source else None
    fingerprint = extraction_fingerprint(
        target_model_name,
        capture.target_layer_ids,
        capture.hidden_size,
        hidden_state_dtype,
        made_from,
        final_state,
    )
    partition = RangeInStore(store, prefix, fingerprint, by_index, capture, target_model_name, warn)
    staging = StagingDirectory(staging_dir, fingerprint)
    uploads = UploadRecord(partition.base)
    progress = ExtractionCounters(
        str(device), len(by_index), uploader, uploads, log, progress_every_s, on_progress
    )

    with staging_lock(staging_dir):
        listed = partition.reconcile_fingerprint()  # step 1
        staging.reconcile(warn)
        in_store = partition.objects_already_stored(listed)  # step 2
        from_staging = resubmit_staged(staging, partition, uploader, uploads, in_store, log, warn)  # step 3
        missing = [
            s for s in samples if s.sample_index not in in_store and s.sample_index not in from_staging
        ]
        log(
            f"{partition.where}: {len(samples)} samples; {len(in_store)} already stored, "
            f"{len(from_staging)} finished in staging (uploading), {len(missing)} to extract on {device} "
            f"(layers {capture.target_layer_ids}{' and the final state' if final_state else ''}, stored as "
            f"{fingerprint['hidden_state_dtype']})"
        )
        if missing:
            report_kernel_paths(model, capture.device, log=log, warn=warn)
        if capture.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(capture.device)
        extract_started = time.monotonic()
        batches = plan_batches([s.num_tokens for s in missing], max_tokens_per_batch, max_batch_size)
        gaps = GapExtraction(
            capture=capture,
            partition=partition,
            staging=staging,
            uploader=uploader,
            uploads=uploads,
            progress=progress,
            warn=warn,
            drop_non_finite=drop_non_finite,
        )
        gaps.run(missing, batches)  # step 4
        progress.wait_for_uploads()  # step 5
        extract_seconds = time.monotonic() - extract_started
        objects = partition.verify_store(uploads.sizes(), dropped=gaps.dropped)
        progress.report("done")

    stats = uploader.stats
    tokens_now = sum(s.num_tokens for s in missing if s.sample_index not in gaps.dropped)
    extracted_now = len(missing) - len(gaps.dropped)
    result = ExtractionResult(
        objects=objects,
        samples=len(objects),
        tokens=sum(by_index[parse_sample_object_name(name)].num_tokens for name in objects),
        bytes_stored=sum(objects.values()),
        extracted_now=extracted_now,
        reused_from_store=len(in_store),
        reused_from_staging=len(from_staging),
        computed_tokens=gaps.computed_tokens,
        padding_fraction=padding_fraction(batches, [s.num_tokens for s in missing]),
        duration_s=time.monotonic() - started,
        samples_per_s=extracted_now / extract_seconds if extracted_now else 0.0,
        tokens_per_s=tokens_now / extract_seconds if extracted_now else 0.0,
        peak_staging_bytes=stats.peak_staging_bytes,
        upload_retries=stats.retries,
        staging_budget_bytes=stats.staging_budget_bytes,
        device=str(device),
        fingerprint=fingerprint,
        dropped=dict(gaps.dropped),
        peak_device_memory_bytes=(
            torch.cuda.max_memory_allocated(capture.device) if capture.device.type == "cuda" else None
        ),
    )
    log(
        f"{partition.where}: done: {result.samples} objects ({human_bytes(result.bytes_stored)}), "
        f"{result.extracted_now} extracted now, {result.reused_from_store} reused from the store, "
        f"{result.reused_from_staging} uploaded from staging; {result.samples_per_s:.1f} samples/s, "
        f"{result.tokens_per_s:,.0f} tokens/s, padding {result.padding_fraction:.1%}, "
        f"peak staging {human_bytes(result.peak_staging_bytes)}"
    )
    return result


def _index_samples(samples: Sequence[TokenizedSample]) -> dict[int, TokenizedSample]:
    by_index: dict[int, TokenizedSample] = {}
    for sample in samples:
        if sample.sample_index in by_index:
            raise ValueError(
                f"sample index {sample.sample_index} appears twice in the range; indices must be unique"
            )
        if sample.num_tokens == 0:
            raise ValueError(f"sample {sample.sample_index} has no tokens; drop it when tokenizing")
        by_index[sample.sample_index] = sample
    return by_index
