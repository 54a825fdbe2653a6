"""Step 4 of `extract_range`: forward passes over the missing samples, one batch ahead of the host
copies, and the sample files they write into staging under the staging budget."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.fp8 import EncodedStates
from dflash_assets.extraction.host_transfer import HostBatch, HostTransfer, PendingHostBatch
from dflash_assets.extraction.monitor import ExtractionCounters, UploadRecord
from dflash_assets.extraction.resume import RangeInStore
from dflash_assets.extraction.sample_format import (
    NonFiniteHiddenStates,
    estimate_sample_nbytes,
    sample_object_name,
    write_sample,
)
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.staging import StagingDirectory
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.batching import pad_batch
from dflash_assets.target.devices import release_cached_memory

# Samples go to a writer thread in chunks of about this many bytes; at most two chunks per writer thread
# wait, which bounds the host memory that finished batches hold.
_CHUNK_BYTES = 32 * 2**20


def writer_threads() -> int:
    """Threads writing sample files. Each file is one `writev` from host memory into the page cache
    (the GIL is released meanwhile), so a few threads keep up with an H200 (~1 GB/s at the 8B shape);
    on a small machine one leaves the other cores to the forward and the uploads."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class GapExtraction:
    """Forward passes over the missing samples, one batch ahead of the writes.

    Batch N+1's forward is queued before batch N's host copy is waited for, so on a GPU the copy and
    the file writes of N overlap the forward of N+1; the host waits for the device once per batch.
    """

    def __init__(
        self,
        *,
        capture: HiddenStateCapture,
        partition: RangeInStore,
        staging: StagingDirectory,
        uploader: Uploader,
        uploads: UploadRecord,
        progress: ExtractionCounters,
        warn: Callable[[str], None],
        drop_non_finite: bool,
    ) -> None:
        self.capture = capture
        self.partition = partition
        self.progress = progress
        self.warn = warn
        self.drop_non_finite = drop_non_finite
        self.transfer = HostTransfer(capture.device, partition.hidden_state_dtype)
        self.writes = SampleWrites(
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
        captured = self._capture_or_none(input_ids, attention_mask)
        if captured is not None:
            self.computed_tokens += input_ids.numel()
            yield batch, captured
            return
        # Out of memory. The failed forward's traceback (and every tensor its frames held) went with the
        # `except` block in `_capture_or_none`; only now can the halves find that memory free.
        tokens = input_ids.shape[1]
        del input_ids, attention_mask
        if len(batch) == 1:
            raise torch.cuda.OutOfMemoryError(
                f"sample {batch[0].sample_index} ({batch[0].num_tokens} tokens) does not fit on "
                f"{self.progress.device} even alone; lower the maximum sample length when tokenizing or "
                "use a larger device"
            )
        release_cached_memory()
        self.warn(
            f"out of memory on {self.progress.device} for {len(batch)} samples x {tokens} "
            "tokens; splitting the batch (lower max_tokens_per_batch to avoid the retry)"
        )
        half = len(batch) // 2
        yield from self._forward(batch[:half])
        yield from self._forward(batch[half:])

    def _capture_or_none(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The batch's captured states, or None when it ran out of device memory. Nothing is retried in
        the handler: the retry runs after it, once the failed attempt is gone."""
        try:
            return self.capture(input_ids, attention_mask)
        except torch.cuda.OutOfMemoryError:
            return None

    def _store(self, part: list[TokenizedSample], host: HostBatch) -> None:
        ready: list[tuple[TokenizedSample, EncodedStates]] = []
        for row, sample in enumerate(part):
            hidden: EncodedStates | None = host.sample(row)
            if host.suspect[row]:
                hidden = self._settle_suspect(sample, host, row, alone=len(part) == 1)
                if hidden is None:
                    continue
            ready.append((sample, hidden))
        self.writes.submit(ready)
        self.progress.count(len(ready), sum(sample.num_tokens for sample, _ in ready))

    def _settle_suspect(
        self, sample: TokenizedSample, host: HostBatch, row: int, alone: bool
    ) -> EncodedStates | None:
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
class PendingWrite:
    future: Future
    nbytes: list[int]  # reserved staging bytes per sample of the chunk


class SampleWrites:
    """Sample files written in the background into staging, each handed to the uploader when complete.

    Staging space is reserved before a write starts, so staged bytes never exceed the budget
    (backpressure: the forward waits while the store is slower than the device). Samples go to the
    writer threads in chunks, not one by one: on a small machine the hand-offs between threads cost
    more CPU than writing a small file does."""

    def __init__(
        self,
        *,
        staging: StagingDirectory,
        partition: RangeInStore,
        uploader: Uploader,
        uploads: UploadRecord,
        progress: ExtractionCounters,
    ) -> None:
        self.staging = staging
        self.partition = partition
        self.uploader = uploader
        self.uploads = uploads
        self.progress = progress
        self.target_layer_ids = list(partition.fingerprint["target_layer_ids"])
        self.target_model = partition.fingerprint["target_model"]
        self.threads = writer_threads()
        self.pending: list[PendingWrite] = []
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hs-writer")

    def submit(self, items: Sequence[tuple[TokenizedSample, EncodedStates]]) -> None:
        """Write `(sample, states [T, K(+1), H] on the host, as stored)` pairs, in chunks of `_CHUNK_BYTES`.

        A chunk starts as soon as the next sample's space cannot be reserved: its own reservations may
        be what fills the budget, and only its written, uploaded files can free it."""
        chunk: list[tuple[TokenizedSample, EncodedStates]] = []
        reserved: list[int] = []
        chunk_bytes = 0
        try:
            for sample, hidden in items:
                nbytes = estimate_sample_nbytes(
                    sample.num_tokens,
                    self.partition.num_layers,
                    self.partition.hidden_size,
                    self.partition.metadata_nbytes,
                    self.partition.hidden_state_dtype,
                    self.partition.final_state,
                )
                if not self.uploader.try_reserve(nbytes):
                    if chunk:
                        self._start(chunk, reserved)
                        chunk, reserved, chunk_bytes = [], [], 0
                    self.progress.maybe_report(reason="staging full, waiting for uploads")
                    self.uploader.reserve(nbytes)  # backpressure: wait for uploads to free space
                chunk.append((sample, hidden))
                reserved.append(nbytes)
                chunk_bytes += hidden.nbytes
                if chunk_bytes >= _CHUNK_BYTES:
                    self._start(chunk, reserved)
                    chunk, reserved, chunk_bytes = [], [], 0
            if chunk:
                self._start(chunk, reserved)
        except BaseException:
            self.uploader.release(sum(reserved))  # reserved for a chunk that never started
            raise

    def _start(self, chunk: list[tuple[TokenizedSample, EncodedStates]], reserved: list[int]) -> None:
        self.drain(keep=2 * self.threads - 1)
        future = self.executor.submit(self._write_and_submit, list(chunk), list(reserved))
        self.pending.append(PendingWrite(future, list(reserved)))

    def _write_and_submit(
        self, chunk: list[tuple[TokenizedSample, EncodedStates]], reserved: list[int]
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
                    final_state=self.partition.final_state,  # the last slot of `hidden`
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
