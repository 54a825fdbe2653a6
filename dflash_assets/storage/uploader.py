"""Background uploads with bounded local staging: producers block instead of filling the disk.

A file's bytes count as staged from `reserve()` (before it is written) until the store confirms the
object and the local copy is deleted. The confirmation is the store's own answer to the upload (S3's
success answer to the PUT or the multipart completion, after which every read sees the object; a local
store's fsynced rename), holding the size it stored: no HEAD after each PUT. Only counters are kept, so
memory stays flat over hundreds of thousands of objects.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dflash_assets import settings
from dflash_assets.storage.store import ObjectInfo, ObjectStore, StoreError, source_will_be_deleted

log = logging.getLogger(__name__)
T = TypeVar("T")


class UploadError(StoreError):
    """An upload failed for good (after retries). The local file was kept."""


class _NotConfirmed(StoreError):
    transient = True


@dataclass
class UploaderStats:
    queued: int  # submitted, waiting for a worker
    in_flight: int  # being uploaded or waiting to retry
    uploaded: int
    uploaded_bytes: int
    failures: int
    retries: int
    staging_bytes: int
    peak_staging_bytes: int
    staging_budget_bytes: int


@dataclass
class _Job:
    path: Path
    key: str
    staged: int  # bytes this job holds in the staging budget until it finishes
    delete_after: bool
    on_uploaded: Callable[[ObjectInfo], None] | None


class Uploader:
    """Uploads files to a store from a pool of worker threads, at most `max_in_flight` at once.

    Use as a context manager: leaving the block normally waits for every upload (and raises
    UploadError if any failed); leaving it with an exception drops queued work and keeps its files.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        max_in_flight: int = int(settings.UPLOAD_MAX_IN_FLIGHT.default),
        staging_budget_bytes: int = int(settings.STAGING_MAX_BYTES.default),
        max_attempts: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_queued: int | None = None,
        seed: int | None = None,
    ):
        if max_in_flight < 1 or max_attempts < 1 or staging_budget_bytes < 1:
            raise ValueError("max_in_flight, max_attempts and staging_budget_bytes must be >= 1")
        self.store = store
        self.max_in_flight = max_in_flight
        # A remote store needs many requests in flight to hide its latency; a local one is bound by the
        # machine, where more threads than it can use only contend for the CPU and the GIL.
        hint = store.max_parallel_puts
        self.max_workers = max_in_flight if hint is None else max(1, min(max_in_flight, hint))
        self.staging_budget_bytes = staging_budget_bytes
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # Bounds the job queue by count as well as bytes, so even empty files cannot pile up.
        self.max_queued = max_queued if max_queued is not None else 4 * max_in_flight
        self._random = random.Random(seed)

        # One lock, two wait queues: workers wait for jobs; producers, flush() and wait_idle() wait for
        # room or completion. A new job wakes one worker, not every thread.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs_ready = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._workers: list[threading.Thread] = []
        self._idle_workers = 0
        self._closed = False
        self._cancelled = threading.Event()  # wakes workers sleeping in backoff on close(cancel=True)

        self._in_flight = 0
        self._uploaded = 0
        self._uploaded_bytes = 0
        self._failures = 0
        self._retries = 0
        self._staging_bytes = 0
        self._peak_staging_bytes = 0
        self._first_failure: str | None = None

    # -- staging budget

    def reserve(self, nbytes: int) -> None:
        """Block until `nbytes` fit in the staging budget, then count them as staged.

        Anything is admitted when nothing is staged, so a file larger than the budget still goes through.
        Raises UploadError if an upload has failed for good (its file stays on disk, so waiting for its
        bytes would wait forever)."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative number of bytes ({nbytes})")
        with self._cond:
            while True:
                self._raise_if_unusable()
                if self._staging_bytes == 0 or self._staging_bytes + nbytes <= self.staging_budget_bytes:
                    break
                self._cond.wait()
            self._add_staged(nbytes)

    def try_reserve(self, nbytes: int) -> bool:
        """`reserve` without waiting: count `nbytes` as staged and return True if they fit now."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative number of bytes ({nbytes})")
        with self._cond:
            self._raise_if_unusable()
            if self._staging_bytes and self._staging_bytes + nbytes > self.staging_budget_bytes:
                return False
            self._add_staged(nbytes)
            return True

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose file was never written (or was removed by the caller)."""
        with self._cond:
            self._add_staged(-nbytes)

    def _add_staged(self, delta: int) -> None:
        self._staging_bytes += delta
        if self._staging_bytes < 0:
            self._staging_bytes = 0
            log.warning("uploader: released more staging bytes than were reserved; reset to 0")
        self._peak_staging_bytes = max(self._peak_staging_bytes, self._staging_bytes)
        if delta < 0:
            self._cond.notify_all()

    # -- submitting

    def submit(
        self,
        path: Path,
        key: str,
        *,
        reserved: int | None = None,
        delete_after: bool = True,
        on_uploaded: Callable[[ObjectInfo], None] | None = None,
    ) -> None:
        """Upload the complete file `path` to `key` in the background.

        `reserved` is what the producer reserved before writing it (None: reserve the file's size now,
        blocking). The staged amount is corrected to the real file size, so staging_bytes stays true to
        the disk. Blocks while the queue is full. Raises UploadError if an earlier upload failed for good.
        """
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as err:
            if reserved is not None:
                self.release(reserved)
            raise UploadError(f"cannot upload {path} to {key!r}: the file is not readable ({err})") from err
        if reserved is None:
            self.reserve(size)
            reserved = size
        job = _Job(path, key, size, delete_after, on_uploaded)
        with self._cond:
            self._add_staged(size - reserved)
            try:
                while True:
                    self._raise_if_unusable()
                    if len(self._queue) < self.max_queued:
                        break
                    self._cond.wait()
            except BaseException:
                self._add_staged(-size)
                raise
            self._queue.append(job)
            self._start_worker_if_needed()
            self._jobs_ready.notify()

    def upload_then_commit(
        self,
        files: Mapping[str, Path],
        prefix: str,
        commit: Callable[[dict[str, int]], T],
        *,
        delete_after: bool = True,
    ) -> T:
        """Upload `files` (name -> local file) under `prefix`, wait until the store has confirmed every
        one, then call `commit(sizes)` (name -> bytes), which writes the marker that makes the whole
        directory count: a partition's manifest, a checkpoint's `_complete.json`, an export's
        `config.json`. A reader that finds the marker finds every file; a failed upload raises before it.
        """
        sizes = {name: Path(path).stat().st_size for name, path in files.items()}
        base = prefix.rstrip("/")
        for name, path in files.items():
            self.submit(path, f"{base}/{name}", delete_after=delete_after)
        self.flush()  # raises UploadError if any failed for good: no marker then
        return commit(sizes)

    def _start_worker_if_needed(self) -> None:
        if self._idle_workers < len(self._queue) and len(self._workers) < self.max_workers:
            worker = threading.Thread(target=self._work, name=f"uploader-{len(self._workers)}", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _raise_if_unusable(self) -> None:
        if self._first_failure is not None:
            raise UploadError(self._failure_message())
        if self._closed:
            raise UploadError(f"uploader to {self.store.description} is closed")

    def _failure_message(self) -> str:
        return (
            f"{self._failures} upload(s) to {self.store.description} failed for good; first: "
            f"{self._first_failure}. The local files were kept; fix the cause and rerun"
        )

    # -- waiting

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is queued or uploading (or an upload failed for good), at most `timeout_s`;
        True if that is so. Unlike `flush`, raises nothing: the caller decides when to look at failures."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._queue or self._in_flight) or self._first_failure is not None, timeout_s
            )

    def flush(self) -> None:
        """Wait until everything submitted is uploaded or failed; raise UploadError if any failed."""
        with self._cond:
            while self._queue or self._in_flight:
                self._cond.wait()
            if self._first_failure is not None:
                raise UploadError(self._failure_message())

    def close(self, *, cancel: bool = False) -> None:
        """Stop the workers. Without `cancel`, waits for queued uploads first; with it, drops queued
        jobs (their files stay, their staging bytes are released) and cuts retry waits short."""
        with self._cond:
            self._closed = True
            if cancel:
                self._cancelled.set()
                while self._queue:
                    self._add_staged(-self._queue.popleft().staged)
            self._cond.notify_all()
            self._jobs_ready.notify_all()
            workers = list(self._workers)
        for worker in workers:
            worker.join()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self.flush()
            finally:
                self.close()
        else:
            self.close(cancel=True)

    @property
    def stats(self) -> UploaderStats:
        with self._cond:
            return UploaderStats(
                queued=len(self._queue),
                in_flight=self._in_flight,
                uploaded=self._uploaded,
                uploaded_bytes=self._uploaded_bytes,
                failures=self._failures,
                retries=self._retries,
                staging_bytes=self._staging_bytes,
                peak_staging_bytes=self._peak_staging_bytes,
                staging_budget_bytes=self.staging_budget_bytes,
            )

    # -- workers

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle_workers += 1
                while not self._queue and not self._closed:
                    self._jobs_ready.wait()
                self._idle_workers -= 1
                if not self._queue:  # closed and drained
                    return
                job = self._queue.popleft()
                self._in_flight += 1
                self._cond.notify_all()  # a submit() may be waiting for queue room
            try:
                self._upload(job)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _upload(self, job: _Job) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                info = self._put_confirmed(job)
                break
            except Exception as err:
                transient = getattr(err, "transient", False)
                if not transient or attempt >= self.max_attempts or self._cancelled.is_set():
                    self._record_failure(job, err, attempt)
                    return
                delay = self._backoff(attempt)
                log.warning(
                    "upload of %r to %s failed (attempt %d/%d), retrying in %.1fs: %s",
                    job.key,
                    self.store.description,
                    attempt,
                    self.max_attempts,
                    delay,
                    err,
                )
                with self._cond:
                    self._retries += 1
                if self._cancelled.wait(delay):
                    self._record_failure(job, err, attempt)
                    return
        try:
            # Only now that the store has the whole object is the local copy expendable.
            if job.delete_after:
                job.path.unlink(missing_ok=True)
            if job.on_uploaded is not None:
                job.on_uploaded(info)
        except Exception as err:
            self._record_failure(job, err, attempt, uploaded=True)
            return
        with self._cond:
            self._uploaded += 1
            self._uploaded_bytes += info.size
            self._add_staged(-job.staged)

    def _put_confirmed(self, job: _Job) -> ObjectInfo:
        size = job.path.stat().st_size
        if job.delete_after:
            # This uploader deletes the file once confirmed and nobody rewrites it: a local store may link
            # it into place instead of copying the bytes.
            with source_will_be_deleted():
                confirmed = self.store.put_file(job.key, job.path)
        else:
            confirmed = self.store.put_file(job.key, job.path)
        if confirmed.size != size:
            raise _NotConfirmed(f"store stored {confirmed.size} bytes for {job.key!r} of {size} uploaded")
        return confirmed

    def _backoff(self, attempt: int) -> float:
        # Jitter spreads the retries of many workers that hit the same throttled endpoint at once.
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        with self._cond:
            return self._random.uniform(ceiling / 2, ceiling)

    def _record_failure(
        self, job: _Job, err: BaseException, attempts: int, *, uploaded: bool = False
    ) -> None:
        stage = "after upload" if uploaded else f"after {attempts} attempt(s)"
        message = f"{job.key!r} from {job.path} {stage}: {type(err).__name__}: {err}"
        log.error("upload to %s failed: %s", self.store.description, message)
        with self._cond:
            self._failures += 1
            if self._first_failure is None:
                self._first_failure = message
            # The failed file stays on disk, so its bytes stay staged (unless it is already gone).
            if uploaded and job.delete_after:
                self._add_staged(-job.staged)
            self._cond.notify_all()
