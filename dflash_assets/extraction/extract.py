"""Extracting one sample range: capture, write one object per sample, upload, resume exactly once.

Resumable by construction: a sample is done when its object is in the store (one listing tells), a
file under its final name in staging is complete (written atomically) and only needs uploading, and
everything else is recomputed. A fingerprint of what produced the objects keeps runs from mixing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.batching import pad_batch, padding_fraction, plan_batches
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.host_transfer import HostBatch, HostTransfer, PendingHostBatch
from dflash_assets.extraction.sample_format import (
    SAMPLE_FORMAT,
    NonFiniteHiddenStates,
    estimate_sample_nbytes,
    parse_sample_object_name,
    sample_object_name,
    write_sample,
)
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.manifest import delete_partition
from dflash_assets.storage.staging import (
    FINGERPRINT_NAME,
    PartitionBusy,
    StagingDirectory,
    staged_file_problem,
    staging_lock,
)
from dflash_assets.storage.store import ObjectInfo, ObjectNotFound, ObjectStore, StoreError
from dflash_assets.storage.units import human_bytes
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.kernels import report_kernel_paths

__all__ = [
    "FINGERPRINT_NAME",
    "ExtractionIncomplete",
    "ExtractionProgress",
    "ExtractionResult",
    "PartitionBusy",
    "extract_range",
    "extraction_fingerprint",
]

# Samples go to a writer thread in chunks of about this many bytes; at most two chunks per writer thread
# wait, which bounds the host memory that finished batches hold.
_CHUNK_BYTES = 32 * 2**20


def writer_threads() -> int:
    """Threads writing sample files. Each file is one `writev` from host memory into the page cache
    (the GIL is released meanwhile), so a few threads keep up with an H200 (~1 GB/s at the 8B shape);
    on a small machine one leaves the other cores to the forward and the uploads."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class ExtractionIncomplete(StoreError):
    """After the uploads finished, the store still lacks objects this range needs."""


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


def extraction_fingerprint(
    target_model: str, target_layer_ids: Sequence[int], hidden_size: int
) -> dict[str, Any]:
    """What must be equal for two objects to belong to the same partition."""
    return {
        "format": SAMPLE_FORMAT,
        "target_model": target_model,
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "hidden_size": int(hidden_size),
    }


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
    max_tokens_per_batch: int = 16384,
    max_batch_size: int | None = None,
    log: Callable[[str], None] = print,
    progress_every_s: float = 5.0,
    drop_non_finite: bool = False,
    warn: Callable[[str], None] | None = None,
    on_progress: Callable[[ExtractionProgress], None] | None = None,
) -> ExtractionResult:
    """Make `<prefix>/hs_<index>.safetensors` exist in `store` for every sample, computing only the gaps.

    `model` is already on `device` (see `load_target_model`). Finished files wait in `staging_dir`
    until the uploader confirms them, so a crash or a store outage loses no finished work. A sample
    whose hidden states are not finite is retried alone (batching cannot be the cause then) and then
    fails the run, naming it; with `drop_non_finite` it is left out and reported in `result.dropped`.
    `log` gets progress lines, `warn` (default: `log` with a "WARNING: " prefix) what needs attention,
    `on_progress` the same progress as an `ExtractionProgress` (e.g. for asset observations).

    The steps, in order: (1) one listing of the prefix, deleting objects another producer made;
    (2) what the store already holds; (3) finished files in staging, uploaded as they are; (4) the
    gaps, batched by length, captured, moved to the host a batch at a time and written one file per
    sample while the next batch runs; (5) wait for the uploads and check the store has every object.
    """
    started = time.monotonic()
    warn = warn or (lambda message: log(f"WARNING: {message}"))
    by_index = _index_samples(samples)
    capture = HiddenStateCapture(model, target_layer_ids)
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = extraction_fingerprint(target_model_name, capture.target_layer_ids, capture.hidden_size)
    partition = _StoredPartition(store, prefix, fingerprint, by_index, capture, target_model_name, warn)
    staging = StagingDirectory(staging_dir, fingerprint)
    uploads = _UploadRecord(partition.base)
    progress = _Progress(str(device), len(by_index), uploader, uploads, log, progress_every_s, on_progress)

    with staging_lock(staging_dir):
        listed = partition.reconcile_fingerprint()  # step 1
        staging.reconcile(warn)
        in_store = partition.objects_already_stored(listed)  # step 2
        from_staging = _resubmit_staged(staging, partition, uploader, uploads, in_store, log, warn)  # step 3
        missing = [
            s for s in samples if s.sample_index not in in_store and s.sample_index not in from_staging
        ]
        log(
            f"{partition.where}: {len(samples)} samples; {len(in_store)} already stored, "
            f"{len(from_staging)} finished in staging (uploading), {len(missing)} to extract on {device} "
            f"(layers {capture.target_layer_ids})"
        )
        if missing:
            report_kernel_paths(model, capture.device, log=log, warn=warn)
        if capture.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(capture.device)
        extract_started = time.monotonic()
        batches = plan_batches([s.num_tokens for s in missing], max_tokens_per_batch, max_batch_size)
        gaps = _GapExtraction(
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
        _wait_for_uploads(uploader, progress)  # step 5
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


class _UploadRecord:
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


# ------------------------------------------------------------------------------ steps 1, 2, 5: the store


class _StoredPartition:
    """The range's prefix in the store: who made its objects, which are complete, and the final check."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        fingerprint: dict[str, Any],
        by_index: dict[int, TokenizedSample],
        capture: HiddenStateCapture,
        target_model_name: str,
        warn: Callable[[str], None],
    ) -> None:
        self.store = store
        self.base = prefix.strip("/") + "/"
        self.where = store.uri(self.base.rstrip("/"))
        self.fingerprint = fingerprint
        self.by_index = by_index
        self.num_layers = len(capture.target_layer_ids)
        self.hidden_size = capture.hidden_size
        self.metadata_nbytes = len(target_model_name.encode())
        self.warn = warn

    def reconcile_fingerprint(self) -> dict[str, int]:
        """One listing of the prefix; objects made under another fingerprint (or none) are deleted."""
        listed = {info.key[len(self.base) :]: info.size for info in self.store.list(self.base)}
        stored = None
        if FINGERPRINT_NAME in listed:
            try:
                stored = json.loads(self.store.get_bytes(self.base + FINGERPRINT_NAME))
            except (ObjectNotFound, ValueError):
                stored = {"unreadable": True}
        if stored == self.fingerprint:
            return listed
        others = [name for name in listed if name != FINGERPRINT_NAME]
        if stored is not None or others:
            self.warn(
                f"{self.where} holds {len(others)} objects made by "
                f"{json.dumps(stored) if stored else 'an unknown producer (no fingerprint)'}, not by "
                f"{json.dumps(self.fingerprint)}; deleting them (manifest first) and extracting from scratch"
            )
            delete_partition(self.store, self.base.rstrip("/"))
            listed = {}
        # Written before any sample object, so an object is never in the store without its fingerprint.
        self.store.put_bytes(self.base + FINGERPRINT_NAME, json.dumps(self.fingerprint, indent=1).encode())
        return listed

    def objects_already_stored(self, listed: dict[str, int]) -> set[int]:
        done: set[int] = set()
        for name, size in listed.items():
            index = parse_sample_object_name(name)
            if index is None or index not in self.by_index:
                continue
            low, high = self._size_bounds(self.by_index[index].num_tokens)
            if low <= size <= high:
                done.add(index)
            else:  # cannot be a complete object for this sample: recompute and overwrite it
                self.warn(
                    f"{self.store.uri(self.base + name)} has {size} bytes, expected {low}..{high}; redoing it"
                )
        return done

    def _size_bounds(self, num_tokens: int) -> tuple[int, int]:
        tensor_bytes = num_tokens * self.num_layers * self.hidden_size * 2 + num_tokens * 5
        return tensor_bytes + 8, estimate_sample_nbytes(
            num_tokens, self.num_layers, self.hidden_size, self.metadata_nbytes
        )

    def verify_store(self, uploaded_sizes: dict[str, int], dropped: dict[int, str]) -> dict[str, int]:
        self.store.sync(self.base)  # before the manifest can be written: every object's name is durable
        listed = {info.key[len(self.base) :]: info.size for info in self.store.list(self.base)}
        expected = sorted(sample_object_name(i) for i in self.by_index if i not in dropped)
        missing = [name for name in expected if name not in listed]
        if missing:
            raise ExtractionIncomplete(
                f"{len(missing)} of {len(expected)} objects are missing from {self.where} after all uploads "
                f"were confirmed (first: {missing[0]}); something else deleted them. Rerun the range: "
                "finished objects are kept and only the gaps are redone"
            )
        for name in expected:
            uploaded = uploaded_sizes.get(name)
            if uploaded is not None and listed[name] != uploaded:
                raise ExtractionIncomplete(
                    f"{self.store.uri(self.base + name)} has {listed[name]} bytes but {uploaded} were "
                    "uploaded; something else overwrote it. Rerun the range"
                )
        return {name: listed[name] for name in expected}


# ------------------------------------------------------------------ step 3: finished files in staging


def _resubmit_staged(
    staging: StagingDirectory,
    partition: _StoredPartition,
    uploader: Uploader,
    uploads: _UploadRecord,
    in_store: set[int],
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> set[int]:
    """Upload the complete files an earlier run left behind; delete everything else in staging."""
    resubmitted: set[int] = set()
    removed: list[str] = []
    for path in staging.sample_files():
        index = parse_sample_object_name(path.name)
        if index is None or index not in partition.by_index or index in in_store:
            # Temp files of a killed writer, strays, or files uploaded just before a crash.
            path.unlink(missing_ok=True)
            removed.append(path.name)
            continue
        problem = staged_file_problem(
            path,
            partition.by_index[index],
            partition.fingerprint,
            partition.num_layers,
            partition.hidden_size,
        )
        if problem is not None:
            warn(f"staged {path.name} is unusable ({problem}); recomputing sample {index}")
            path.unlink(missing_ok=True)
            continue
        uploader.submit(path, partition.base + path.name, on_uploaded=uploads)
        resubmitted.add(index)
    if removed:
        log(f"staging: removed {len(removed)} leftover files that need no upload (e.g. {removed[0]})")
    return resubmitted


# ------------------------------------------------------------------------------ step 4: the gaps


class _GapExtraction:
    """Forward passes over the missing samples, one batch ahead of the writes.

    Batch N+1's forward is queued before batch N's host copy is waited for, so on a GPU the copy and
    the file writes of N overlap the forward of N+1; the host waits for the device once per batch.
    """

    def __init__(
        self,
        *,
        capture: HiddenStateCapture,
        partition: _StoredPartition,
        staging: StagingDirectory,
        uploader: Uploader,
        uploads: _UploadRecord,
        progress: _Progress,
        warn: Callable[[str], None],
        drop_non_finite: bool,
    ) -> None:
        self.capture = capture
        self.partition = partition
        self.progress = progress
        self.warn = warn
        self.drop_non_finite = drop_non_finite
        self.transfer = HostTransfer(capture.device)
        self.writes = _SampleWrites(
            staging=staging, partition=partition, uploader=uploader, uploads=uploads, progress=progress
        )
        self.pad_id = _pad_token_id(capture.model)
        self.dropped: dict[int, str] = {}
        self.computed_tokens = 0

    def run(self, missing: Sequence[TokenizedSample], batches: list[list[int]]) -> None:
        self.progress.start(len(missing))
        previous: tuple[list[TokenizedSample], PendingHostBatch] | None = None
        try:
            for batch in batches:
                for part, captured in self._forward([missing[i] for i in batch]):
                    pending = self.transfer.start(captured, [s.num_tokens for s in part])
                    del captured  # the transfer holds it until the copy is done
                    if previous is not None:
                        self._store(previous[0], previous[1].wait())
                    previous = (part, pending)
                self.progress.maybe_report()
            if previous is not None:
                self._store(previous[0], previous[1].wait())
            self.writes.drain(keep=0)
        finally:
            self.writes.close()

    def _forward(self, batch: list[TokenizedSample]) -> Iterator[tuple[list[TokenizedSample], torch.Tensor]]:
        """(samples, captured [B, T, K, H]) for the batch, or for its halves after an out-of-memory."""
        input_ids, attention_mask = pad_batch([s.input_ids for s in batch], self.pad_id)
        fault_point("extract_forward")  # crash tests: die here, mid-range, with earlier batches staged
        try:
            captured = self.capture(input_ids, attention_mask)
        except torch.cuda.OutOfMemoryError:
            if len(batch) == 1:
                raise torch.cuda.OutOfMemoryError(
                    f"sample {batch[0].sample_index} ({batch[0].num_tokens} tokens) does not fit on "
                    f"{self.progress.device} even alone; lower the maximum sample length when tokenizing or "
                    "use a larger device"
                ) from None
            torch.cuda.empty_cache()
            self.warn(
                f"out of memory on {self.progress.device} for {len(batch)} samples x {input_ids.shape[1]} "
                "tokens; splitting the batch (lower max_tokens_per_batch to avoid the retry)"
            )
            half = len(batch) // 2
            yield from self._forward(batch[:half])
            yield from self._forward(batch[half:])
            return
        self.computed_tokens += input_ids.numel()
        yield batch, captured

    def _store(self, part: list[TokenizedSample], host: HostBatch) -> None:
        ready: list[tuple[TokenizedSample, torch.Tensor]] = []
        for row, sample in enumerate(part):
            hidden: torch.Tensor | None = host.sample(row)
            if host.suspect[row]:
                hidden = self._settle_suspect(sample, host, row, alone=len(part) == 1)
                if hidden is None:
                    continue
            ready.append((sample, hidden))
        self.writes.submit(ready)
        self.progress.extracted += len(ready)
        self.progress.extracted_tokens += sum(sample.num_tokens for sample, _ in ready)

    def _settle_suspect(
        self, sample: TokenizedSample, host: HostBatch, row: int, alone: bool
    ) -> torch.Tensor | None:
        """A row the batch-wide check flagged: count exactly, retry alone, then fail or drop it."""
        bad = host.non_finite_count(row)
        if bad == 0:  # the cheap check over-reports only for values near float32's limit
            return host.sample(row)
        if not alone:
            input_ids, attention_mask = pad_batch([sample.input_ids], 0)
            captured = self.capture(input_ids, attention_mask)
            self.computed_tokens += input_ids.numel()
            single = self.transfer.start(captured, [sample.num_tokens]).wait()
            bad = single.non_finite_count(0)
            if bad == 0:
                self.warn(f"sample {sample.sample_index} was non-finite in a batch but finite alone")
                return single.sample(0)
        reason = f"{bad} non-finite hidden-state values (NaN/inf) even when run alone"
        if not self.drop_non_finite:
            raise NonFiniteHiddenStates(
                sample.sample_index,
                f"sample {sample.sample_index} of {self.partition.where}: {reason}; nothing "
                "was written for it. Check the target model's dtype and this sample's tokens.",
            )
        self.warn(f"dropping sample {sample.sample_index}: {reason}")
        self.dropped[sample.sample_index] = reason
        return None


@dataclass
class _PendingWrite:
    future: Future
    nbytes: list[int]  # reserved staging bytes per sample of the chunk


class _SampleWrites:
    """Sample files written in the background into staging, each handed to the uploader when complete.

    Staging space is reserved before a write starts, so staged bytes never exceed the budget
    (backpressure: the forward waits while the store is slower than the device). Samples go to the
    writer threads in chunks, not one by one: on a small machine the hand-offs between threads cost
    more CPU than writing a small file does."""

    def __init__(
        self,
        *,
        staging: StagingDirectory,
        partition: _StoredPartition,
        uploader: Uploader,
        uploads: _UploadRecord,
        progress: _Progress,
    ) -> None:
        self.staging = staging
        self.partition = partition
        self.uploader = uploader
        self.uploads = uploads
        self.progress = progress
        self.target_layer_ids = list(partition.fingerprint["target_layer_ids"])
        self.target_model = partition.fingerprint["target_model"]
        self.threads = writer_threads()
        self.pending: list[_PendingWrite] = []
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hs-writer")

    def submit(self, items: Sequence[tuple[TokenizedSample, torch.Tensor]]) -> None:
        """Write `(sample, hidden [T, K, H] bf16 on the host)` pairs, in chunks of up to `_CHUNK_BYTES`.

        A chunk starts as soon as the next sample's space cannot be reserved: its own reservations may
        be what fills the budget, and only its written, uploaded files can free it."""
        chunk: list[tuple[TokenizedSample, torch.Tensor]] = []
        reserved: list[int] = []
        chunk_bytes = 0
        try:
            for sample, hidden in items:
                nbytes = estimate_sample_nbytes(
                    sample.num_tokens,
                    self.partition.num_layers,
                    self.partition.hidden_size,
                    self.partition.metadata_nbytes,
                )
                if not self.uploader.try_reserve(nbytes):
                    if chunk:
                        self._start(chunk, reserved)
                        chunk, reserved, chunk_bytes = [], [], 0
                    self.progress.maybe_report(reason="staging full, waiting for uploads")
                    self.uploader.reserve(nbytes)  # backpressure: wait for uploads to free space
                chunk.append((sample, hidden))
                reserved.append(nbytes)
                chunk_bytes += hidden.numel() * hidden.element_size()
                if chunk_bytes >= _CHUNK_BYTES:
                    self._start(chunk, reserved)
                    chunk, reserved, chunk_bytes = [], [], 0
            if chunk:
                self._start(chunk, reserved)
        except BaseException:
            self.uploader.release(sum(reserved))  # reserved for a chunk that never started
            raise

    def _start(self, chunk: list[tuple[TokenizedSample, torch.Tensor]], reserved: list[int]) -> None:
        self.drain(keep=2 * self.threads - 1)
        future = self.executor.submit(self._write_and_submit, list(chunk), list(reserved))
        self.pending.append(_PendingWrite(future, list(reserved)))

    def _write_and_submit(
        self, chunk: list[tuple[TokenizedSample, torch.Tensor]], reserved: list[int]
    ) -> None:
        for position, ((sample, hidden), nbytes) in enumerate(zip(chunk, reserved, strict=True)):
            name = sample_object_name(sample.sample_index)
            path = self.staging.directory / name
            try:
                write_sample(
                    path,
                    sample_index=sample.sample_index,
                    input_ids=sample.input_ids,
                    loss_mask=sample.loss_mask,
                    hidden_states=hidden,
                    target_layer_ids=self.target_layer_ids,
                    target_model=self.target_model,
                    check_finite=False,  # the whole batch was checked on the device
                    durable=self.staging.files_need_fsync,  # staging.py: the store holds the durable copy
                )
            except BaseException:
                self.uploader.release(sum(reserved[position:]))  # this sample and those never started
                raise
            try:
                self.uploader.submit(
                    path, self.partition.base + name, reserved=nbytes, on_uploaded=self.uploads
                )
            except BaseException:
                self.uploader.release(sum(reserved[position + 1 :]))  # submit gave back this one's
                raise

    def drain(self, keep: int) -> None:
        """Wait until at most `keep` chunks are pending; re-raise the first failed one."""
        while self.pending:
            finished = [write for write in self.pending if write.future.done()]
            for write in finished:
                self.pending.remove(write)
                write.future.result()
            if len(self.pending) <= keep:
                return
            wait(
                [write.future for write in self.pending],
                timeout=max(self.progress.every_s, 0.05),
                return_when=FIRST_COMPLETED,
            )
            self.progress.maybe_report()

    def close(self) -> None:
        # On an error, files already being written finish (they are complete and get uploaded next run);
        # chunks not started yet are cancelled and give their reservations back.
        for write in self.pending:
            if write.future.cancel():
                self.uploader.release(sum(write.nbytes))
        self.executor.shutdown(wait=True)


def _pad_token_id(model: torch.nn.Module) -> int:
    # Pads are masked and sit after every real token, so any valid id works; prefer the model's own.
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        text = getattr(config, "text_config", None)
        pad = getattr(text, "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


def _wait_for_uploads(uploader: Uploader, progress: _Progress) -> None:
    while not uploader.wait_idle(timeout_s=max(progress.every_s, 0.05)):
        progress.maybe_report(reason="waiting for uploads")
    uploader.flush()  # raises if an upload failed for good


# ------------------------------------------------------------------------------------------ progress


class _Progress:
    """Counters of one run, reported as a log line and an `ExtractionProgress` every `every_s` seconds."""

    def __init__(
        self,
        device: str,
        samples_total: int,
        uploader: Uploader,
        uploads: _UploadRecord,
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
