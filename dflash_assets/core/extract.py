"""Extracting one sample range: capture, write one object per sample, upload, resume exactly once.

Resumable by construction: a sample is done when its object is in the store (one listing tells), a
file under its final name in staging is complete (written atomically) and only needs uploading, and
everything else is recomputed. A fingerprint of what produced the objects keeps runs from mixing.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from safetensors import safe_open

from dflash_assets.core.batching import pad_batch, padding_fraction, plan_batches
from dflash_assets.core.capture import HiddenStateCapture
from dflash_assets.core.faults import fault_point
from dflash_assets.core.manifest import delete_partition
from dflash_assets.core.sample_format import (
    SAMPLE_FORMAT,
    CorruptSampleError,
    NonFiniteHiddenStates,
    estimate_sample_nbytes,
    parse_sample_object_name,
    read_sample_metadata,
    sample_object_name,
    write_sample,
)
from dflash_assets.core.samples import TokenizedSample
from dflash_assets.core.store import ObjectNotFound, ObjectStore, StoreError
from dflash_assets.core.uploader import Uploader

FINGERPRINT_NAME = "_fingerprint.json"
_LOCK_NAME = ".extract.lock"
# Files being written at once in the background; bounds host memory held by finished batches.
_WRITER_THREADS = 2
_MAX_PENDING_WRITES = 8


class ExtractionIncomplete(StoreError):
    """After the uploads finished, the store still lacks objects this range needs."""


class PartitionBusy(RuntimeError):
    """Another process on this host is extracting the same range into the same staging directory."""


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
    """
    started = time.monotonic()
    base = prefix.strip("/") + "/"
    by_index = _index_samples(samples)
    capture = HiddenStateCapture(model, target_layer_ids)
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = extraction_fingerprint(target_model_name, capture.target_layer_ids, capture.hidden_size)
    run = _Run(
        store=store,
        base=base,
        staging_dir=staging_dir,
        uploader=uploader,
        capture=capture,
        fingerprint=fingerprint,
        target_model_name=target_model_name,
        by_index=by_index,
        device=str(device),
        log=log,
        warn=warn or (lambda message: log(f"WARNING: {message}")),
        progress_every_s=progress_every_s,
        drop_non_finite=drop_non_finite,
        on_progress=on_progress,
    )
    with _staging_lock(staging_dir):
        listed = run.reconcile_fingerprint()
        run.reconcile_staging_fingerprint()
        in_store = run.objects_already_stored(listed)
        from_staging = run.resubmit_staged(in_store)
        missing = [
            s for s in samples if s.sample_index not in in_store and s.sample_index not in from_staging
        ]
        log(
            f"{run.where}: {len(samples)} samples; {len(in_store)} already stored, "
            f"{len(from_staging)} finished in staging (uploading), {len(missing)} to extract on {device} "
            f"(layers {capture.target_layer_ids})"
        )
        if capture.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(capture.device)
        extract_started = time.monotonic()
        batches = plan_batches([s.num_tokens for s in missing], max_tokens_per_batch, max_batch_size)
        run.extract(missing, batches)
        run.wait_for_uploads()
        extract_seconds = time.monotonic() - extract_started
        objects = run.verify_store()
        run.report_progress("done")

    stats = uploader.stats
    tokens_now = sum(s.num_tokens for s in missing if s.sample_index not in run.dropped)
    extracted_now = len(missing) - len(run.dropped)
    result = ExtractionResult(
        objects=objects,
        samples=len(objects),
        tokens=sum(by_index[parse_sample_object_name(name)].num_tokens for name in objects),
        bytes_stored=sum(objects.values()),
        extracted_now=extracted_now,
        reused_from_store=len(in_store),
        reused_from_staging=len(from_staging),
        computed_tokens=run.computed_tokens,
        padding_fraction=padding_fraction(batches, [s.num_tokens for s in missing]),
        duration_s=time.monotonic() - started,
        samples_per_s=extracted_now / extract_seconds if extracted_now else 0.0,
        tokens_per_s=tokens_now / extract_seconds if extracted_now else 0.0,
        peak_staging_bytes=stats.peak_staging_bytes,
        device=str(device),
        fingerprint=fingerprint,
        dropped=dict(run.dropped),
        peak_device_memory_bytes=(
            torch.cuda.max_memory_allocated(capture.device) if capture.device.type == "cuda" else None
        ),
    )
    log(
        f"{run.where}: done: {result.samples} objects ({_human_bytes(result.bytes_stored)}), "
        f"{result.extracted_now} extracted now, {result.reused_from_store} reused from the store, "
        f"{result.reused_from_staging} uploaded from staging; {result.samples_per_s:.1f} samples/s, "
        f"{result.tokens_per_s:,.0f} tokens/s, padding {result.padding_fraction:.1%}, "
        f"peak staging {_human_bytes(result.peak_staging_bytes)}"
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


@contextlib.contextmanager
def _staging_lock(staging_dir: Path) -> Iterator[None]:
    """Two processes extracting one range into one staging directory would race on its files.

    On success the staging directory is removed (it is empty by then); after a failure it stays, with
    whatever finished files the next run will upload.
    """
    path = staging_dir / _LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise PartitionBusy(
                f"{staging_dir} is in use by {holder}: this range is already being extracted on this host; "
                "wait for that run to finish (or stop it) before starting another"
            ) from None
        # A finishing run unlinks the lock file; a lock on the unlinked file would guard nothing.
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield
        (staging_dir / FINGERPRINT_NAME).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: leave it
            staging_dir.rmdir()
    finally:
        os.close(fd)  # closing drops the flock


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _size_bounds(num_tokens: int, num_layers: int, hidden_size: int, metadata_nbytes: int) -> tuple[int, int]:
    tensor_bytes = num_tokens * num_layers * hidden_size * 2 + num_tokens * 5
    return tensor_bytes + 8, estimate_sample_nbytes(num_tokens, num_layers, hidden_size, metadata_nbytes)


@dataclass
class _PendingWrite:
    future: Future
    nbytes: int


class _Run:
    """The state of one `extract_range` call; each method is one step of the docstring above."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        base: str,
        staging_dir: Path,
        uploader: Uploader,
        capture: HiddenStateCapture,
        fingerprint: dict[str, Any],
        target_model_name: str,
        by_index: dict[int, TokenizedSample],
        device: str,
        log: Callable[[str], None],
        warn: Callable[[str], None],
        progress_every_s: float,
        drop_non_finite: bool,
        on_progress: Callable[[ExtractionProgress], None] | None = None,
    ) -> None:
        self.store = store
        self.base = base
        self.staging_dir = staging_dir
        self.uploader = uploader
        self.capture = capture
        self.fingerprint = fingerprint
        self.target_model_name = target_model_name
        self.by_index = by_index
        self.device = device
        self.log = log
        self.warn = warn
        self.progress_every_s = progress_every_s
        self.drop_non_finite = drop_non_finite
        self.on_progress = on_progress
        self.num_layers = len(capture.target_layer_ids)
        self.hidden_size = capture.hidden_size
        self.metadata_nbytes = len(target_model_name.encode())
        self.where = store.uri(base.rstrip("/"))
        self.uploaded_sizes: dict[str, int] = {}
        self._uploaded_lock = threading.Lock()
        self.dropped: dict[int, str] = {}
        self.computed_tokens = 0
        self.extracted = 0
        self.extracted_tokens = 0
        self.total_to_extract = 0
        self.already_done = 0
        self._extract_started = time.monotonic()
        self._last_progress = time.monotonic()

    # -- step 1: fingerprint

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

    def reconcile_staging_fingerprint(self) -> None:
        path = self.staging_dir / FINGERPRINT_NAME
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            stored = None
        except (OSError, ValueError):
            stored = {"unreadable": True}
        if stored == self.fingerprint:
            return
        leftovers = [p for p in self.staging_dir.iterdir() if p.is_file() and p.name not in (_LOCK_NAME,)]
        if leftovers and stored is not None:
            self.warn(
                f"staging {self.staging_dir} holds {len(leftovers)} files made by "
                f"{json.dumps(stored)}; deleting them"
            )
        elif leftovers:
            self.warn(
                f"staging {self.staging_dir} holds {len(leftovers)} files without a fingerprint; "
                "deleting them"
            )
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        temp = path.with_name(f".{FINGERPRINT_NAME}.tmp-{os.getpid()}")
        temp.write_text(json.dumps(self.fingerprint, indent=1))
        os.replace(temp, path)

    # -- step 2: what the store already has

    def objects_already_stored(self, listed: dict[str, int]) -> set[int]:
        done: set[int] = set()
        for name, size in listed.items():
            index = parse_sample_object_name(name)
            if index is None or index not in self.by_index:
                continue
            low, high = _size_bounds(
                self.by_index[index].num_tokens, self.num_layers, self.hidden_size, self.metadata_nbytes
            )
            if low <= size <= high:
                done.add(index)
            else:  # cannot be a complete object for this sample: recompute and overwrite it
                self.warn(
                    f"{self.store.uri(self.base + name)} has {size} bytes, expected {low}..{high}; redoing it"
                )
        return done

    # -- step 3: files finished by an earlier run that never got uploaded

    def resubmit_staged(self, in_store: set[int]) -> set[int]:
        resubmitted: set[int] = set()
        removed: list[str] = []
        for path in sorted(self.staging_dir.iterdir()):
            if not path.is_file() or path.name in (FINGERPRINT_NAME, _LOCK_NAME):
                continue
            index = parse_sample_object_name(path.name)
            if index is None or index not in self.by_index or index in in_store:
                # Temp files of a killed writer, strays, or files uploaded just before a crash.
                path.unlink(missing_ok=True)
                removed.append(path.name)
                continue
            problem = self._staged_file_problem(path, index)
            if problem is not None:
                self.warn(f"staged {path.name} is unusable ({problem}); recomputing sample {index}")
                path.unlink(missing_ok=True)
                continue
            self.uploader.submit(path, self.base + path.name, on_uploaded=self._record_upload)
            resubmitted.add(index)
        if removed:
            self.log(
                f"staging: removed {len(removed)} leftover files that need no upload (e.g. {removed[0]})"
            )
        return resubmitted

    def _staged_file_problem(self, path: Path, index: int) -> str | None:
        try:
            metadata = read_sample_metadata(path)
        except (CorruptSampleError, OSError) as error:
            return str(error)
        sample = self.by_index[index]
        if metadata.get("sample_index") != str(index):
            return f"its metadata says sample {metadata.get('sample_index')}"
        made_by = {
            "format": metadata.get("format"),
            "target_model": metadata.get("target_model"),
            "target_layer_ids": json.loads(metadata.get("target_layer_ids", "null")),
            "hidden_size": int(metadata.get("hidden_size", -1)),
        }
        if made_by != self.fingerprint:
            return f"made by {made_by}"
        try:
            with safe_open(str(path), framework="pt") as handle:
                input_ids = handle.get_tensor("input_ids").tolist()
                loss_mask = handle.get_tensor("loss_mask").tolist()
                shape = list(handle.get_slice("hidden_states").get_shape())
        except Exception as error:  # safetensors raises its own error types for damaged files
            return f"unreadable ({error})"
        if input_ids != list(sample.input_ids) or loss_mask != list(sample.loss_mask):
            return "its tokens differ from the tokenized sample (the tokenized range changed)"
        if shape != [sample.num_tokens, self.num_layers, self.hidden_size]:
            return f"hidden_states shape {shape}"
        return None

    def _record_upload(self, info: Any) -> None:
        # Called from uploader worker threads.
        with self._uploaded_lock:
            self.uploaded_sizes[info.key[len(self.base) :]] = info.size

    # -- step 4: extract the gaps

    def extract(self, missing: Sequence[TokenizedSample], batches: list[list[int]]) -> None:
        self.total_to_extract = len(missing)
        self.already_done = len(self.by_index) - len(missing)
        self._extract_started = time.monotonic()
        pad_id = _pad_token_id(self.capture.model)
        pending: list[_PendingWrite] = []
        executor = ThreadPoolExecutor(max_workers=_WRITER_THREADS, thread_name_prefix="hs-writer")
        try:
            for batch in batches:
                for sample, hidden in self._capture_batch([missing[i] for i in batch], pad_id):
                    if hidden is None:
                        continue
                    self._drain(pending, keep=_MAX_PENDING_WRITES - 1)
                    pending.append(self._write_in_background(executor, sample, hidden))
                    self.extracted += 1
                    self.extracted_tokens += sample.num_tokens
                self._maybe_log_progress()
            self._drain(pending, keep=0)
        finally:
            # On an error, files already being written finish (they are complete and get uploaded next
            # run); writes not started yet are cancelled and give their reservation back.
            for write in pending:
                if write.future.cancel():
                    self.uploader.release(write.nbytes)
            executor.shutdown(wait=True)

    def _capture_batch(
        self, batch: list[TokenizedSample], pad_id: int
    ) -> Iterator[tuple[TokenizedSample, torch.Tensor | None]]:
        """(sample, bf16 CPU hidden states [T, K, H]) per sample; halves the batch on out-of-memory."""
        input_ids, attention_mask = pad_batch([s.input_ids for s in batch], pad_id)
        fault_point("extract_forward")  # crash tests: die here, mid-range, with earlier batches staged
        try:
            captured = self.capture(input_ids, attention_mask)
        except torch.cuda.OutOfMemoryError:
            if len(batch) == 1:
                raise torch.cuda.OutOfMemoryError(
                    f"sample {batch[0].sample_index} ({batch[0].num_tokens} tokens) does not fit on "
                    f"{self.device} even alone; lower the maximum sample length when tokenizing or use a "
                    "larger device"
                ) from None
            torch.cuda.empty_cache()
            self.warn(
                f"out of memory on {self.device} for {len(batch)} samples x {input_ids.shape[1]} "
                "tokens; splitting the batch (lower max_tokens_per_batch to avoid the retry)"
            )
            half = len(batch) // 2
            yield from self._capture_batch(batch[:half], pad_id)
            yield from self._capture_batch(batch[half:], pad_id)
            return
        self.computed_tokens += input_ids.numel()
        for row, sample in enumerate(batch):
            hidden = captured[row, : sample.num_tokens]
            if not bool(torch.isfinite(hidden).all()):
                hidden = self._retry_non_finite(sample, alone=len(batch) == 1, hidden=hidden)
                if hidden is None:
                    continue
            # Cast on the device first: half the bytes cross to the host.
            yield sample, hidden.to(dtype=torch.bfloat16).cpu()
        del captured

    def _retry_non_finite(
        self, sample: TokenizedSample, alone: bool, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        if not alone:
            input_ids, attention_mask = pad_batch([sample.input_ids], 0)
            hidden = self.capture(input_ids, attention_mask)[0]
            self.computed_tokens += input_ids.numel()
            if bool(torch.isfinite(hidden).all()):
                self.warn(f"sample {sample.sample_index} was non-finite in a batch but finite alone")
                return hidden
        bad = int((~torch.isfinite(hidden)).sum())
        reason = f"{bad} non-finite hidden-state values (NaN/inf) even when run alone"
        if not self.drop_non_finite:
            raise NonFiniteHiddenStates(
                sample.sample_index,
                f"sample {sample.sample_index} of {self.where}: {reason}; nothing "
                "was written for it. Check the target model's dtype and this sample's tokens.",
            )
        self.warn(f"dropping sample {sample.sample_index}: {reason}")
        self.dropped[sample.sample_index] = reason
        return None

    def _write_in_background(
        self, executor: ThreadPoolExecutor, sample: TokenizedSample, hidden: torch.Tensor
    ) -> _PendingWrite:
        nbytes = estimate_sample_nbytes(
            sample.num_tokens, self.num_layers, self.hidden_size, self.metadata_nbytes
        )
        stats = self.uploader.stats
        if stats.staging_bytes and stats.staging_bytes + nbytes > stats.staging_budget_bytes:
            self._maybe_log_progress(reason="staging full, waiting for uploads")
        # Reserved before writing, so staged bytes on disk never exceed the budget (backpressure).
        self.uploader.reserve(nbytes)
        return _PendingWrite(executor.submit(self._write_and_submit, sample, hidden, nbytes), nbytes)

    def _write_and_submit(self, sample: TokenizedSample, hidden: torch.Tensor, nbytes: int) -> None:
        name = sample_object_name(sample.sample_index)
        path = self.staging_dir / name
        try:
            write_sample(
                path,
                sample_index=sample.sample_index,
                input_ids=sample.input_ids,
                loss_mask=sample.loss_mask,
                hidden_states=hidden,
                target_layer_ids=self.capture.target_layer_ids,
                target_model=self.target_model_name,
            )
        except BaseException:
            self.uploader.release(nbytes)
            raise
        self.uploader.submit(path, self.base + name, reserved=nbytes, on_uploaded=self._record_upload)

    def _drain(self, pending: list[_PendingWrite], keep: int) -> None:
        """Wait until at most `keep` writes are pending; re-raise the first failed one."""
        while pending:
            finished = [write for write in pending if write.future.done()]
            for write in finished:
                pending.remove(write)
                write.future.result()
            if len(pending) <= keep:
                return
            wait(
                [write.future for write in pending],
                timeout=max(self.progress_every_s, 0.05),
                return_when=FIRST_COMPLETED,
            )
            self._maybe_log_progress()

    # -- step 5: wait and verify

    def wait_for_uploads(self) -> None:
        while True:
            stats = self.uploader.stats
            if stats.queued + stats.in_flight == 0 or stats.failures:
                break
            time.sleep(0.1)
            self._maybe_log_progress(reason="waiting for uploads")
        self.uploader.flush()

    def verify_store(self) -> dict[str, int]:
        listed = {info.key[len(self.base) :]: info.size for info in self.store.list(self.base)}
        expected = sorted(sample_object_name(i) for i in self.by_index if i not in self.dropped)
        missing = [name for name in expected if name not in listed]
        if missing:
            raise ExtractionIncomplete(
                f"{len(missing)} of {len(expected)} objects are missing from {self.where} after all uploads "
                f"were confirmed (first: {missing[0]}); something else deleted them. Rerun the range: "
                "finished objects are kept and only the gaps are redone"
            )
        for name in expected:
            uploaded = self.uploaded_sizes.get(name)
            if uploaded is not None and listed[name] != uploaded:
                raise ExtractionIncomplete(
                    f"{self.store.uri(self.base + name)} has {listed[name]} bytes but {uploaded} were "
                    "uploaded; something else overwrote it. Rerun the range"
                )
        return {name: listed[name] for name in expected}

    # -- progress

    def progress(self, reason: str | None = None) -> ExtractionProgress:
        elapsed = max(time.monotonic() - self._extract_started, 1e-9)
        rate = self.extracted / elapsed
        remaining = self.total_to_extract - self.extracted
        stats = self.uploader.stats
        with self._uploaded_lock:
            uploaded = len(self.uploaded_sizes)
        return ExtractionProgress(
            device=self.device,
            samples_total=len(self.by_index),
            samples_done=self.already_done + self.extracted,
            extracted_this_run=self.extracted,
            uploaded_this_run=uploaded,
            samples_per_s=rate,
            tokens_per_s=self.extracted_tokens / elapsed,
            eta_s=remaining / rate if rate > 0 else (0.0 if remaining == 0 else None),
            staging_bytes=stats.staging_bytes,
            staging_budget_bytes=stats.staging_budget_bytes,
            uploads_in_flight=stats.queued + stats.in_flight,
            uploaded_bytes=stats.uploaded_bytes,
            reason=reason,
        )

    def report_progress(self, reason: str | None = None) -> None:
        """One progress line (and `on_progress` snapshot) now, whatever the interval."""
        self._last_progress = time.monotonic()
        progress = self.progress(reason)
        eta = f"{progress.eta_s:,.0f} s" if progress.eta_s is not None else "unknown"
        self.log(
            f"{self.device}: {progress.samples_done}/{progress.samples_total} samples extracted "
            f"({progress.extracted_this_run} this run, {progress.uploaded_this_run} uploaded this run) | "
            f"{progress.samples_per_s:.2f} samples/s, {progress.tokens_per_s:,.0f} tokens/s | ETA {eta} | "
            f"staging {_human_bytes(progress.staging_bytes)} / {_human_bytes(progress.staging_budget_bytes)}"
            f" | uploads in flight {progress.uploads_in_flight}, uploaded "
            f"{_human_bytes(progress.uploaded_bytes)}" + (f" | {reason}" if reason else "")
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def _maybe_log_progress(self, reason: str | None = None) -> None:
        if time.monotonic() - self._last_progress >= self.progress_every_s:
            self.report_progress(reason)


def _pad_token_id(model: torch.nn.Module) -> int:
    # Pads are masked and sit after every real token, so any valid id works; prefer the model's own.
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        text = getattr(config, "text_config", None)
        pad = getattr(text, "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0
