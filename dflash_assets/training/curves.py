"""Training curves: per-step and per-evaluation scalars as TensorBoard event files in the store, beside
the run's checkpoints (`checkpoints/<run>/tensorboard/`), and to W&B or MLflow when installed and set up.

`tensorboard --logdir` on a copy of that prefix shows the whole run: each process (the first one and
every resume) writes its own event files, and a resumed one starts with a `SessionLog.START` at the step
after its checkpoint, so TensorBoard drops the steps an interrupted process logged past it (they are
trained again). Files are uploaded through the run's uploader (so an S3 store works like a local one):
every `upload_every_s` and at the end. A file is never uploaded while it is being appended to: what goes
up is a copy. At each checkpoint the file is closed, uploaded a last time and a new one begun, so a
days-long run re-uploads at most one checkpoint interval's worth of events a minute.

The event files are written here in TensorBoard's record format (TFRecord framing with masked CRC32C,
`Event`/`Summary` protobuf messages encoded by hand), so training needs neither TensorFlow nor the
`tensorboard` package; the tests read them back with TensorBoard's own loader.

Scalars (tags): `train/loss`, `train/ce`, `train/expected_tau` (DFlash2 also `train/selector_ce`,
`train/selector_recall`), `train/lr`, `train/grad_norm`, `train/tokens_per_s`, `train/sequences_per_step`
at every optimiser step; `eval/loss`, `eval/ce`, `eval/tau_teacher_forced`, `eval/tau_measured` at every
evaluation (step 0 is the untrained drafter).

Optional trackers, used only when their package is importable and its usual variable is set (nothing
here reads or logs their credentials): W&B with `WANDB_PROJECT` (`wandb` reads `WANDB_API_KEY` /
`WANDB_MODE` itself; the run resumes under the id `dflash-<run>`), MLflow with `MLFLOW_TRACKING_URI`
(`MLFLOW_EXPERIMENT_NAME` picks the experiment; a resumed run continues the MLflow run tagged with the
same `dflash_run`). A tracker that fails is warned about once and turned off: curves must never stop a
training run.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import shutil
import socket
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader

EVENT_FILE_PREFIX = "events.out.tfevents."  # TensorBoard reads the files whose names contain "tfevents"

# --------------------------------------------------------------------------------------------------
# TensorBoard's event file format
# --------------------------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One record: length (uint64), its masked CRC32C, the data, the data's masked CRC32C."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf encodes it
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, field: bytes) -> bytes:
    """An `Event`: wall_time (1, double), step (2, int64; omitted at 0, as protobuf does) and one field
    of its `what` oneof."""
    step_field = _varint(2 << 3) + _varint(step) if step else b""
    return _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + step_field + field


def file_version_event(wall_time: float) -> bytes:
    return _event(wall_time, 0, _field_bytes(3, b"brain.Event:2"))


def session_start_event(wall_time: float, step: int) -> bytes:
    """`SessionLog{status: START}` at `step`: readers drop earlier files' events at steps >= `step`."""
    return _event(wall_time, step, _field_bytes(7, _varint(1 << 3) + _varint(1)))


def scalars_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """A `Summary` of `Value{tag, simple_value}` entries (TensorBoard's scalar dashboard reads these)."""
    values = b"".join(
        _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
        for tag, value in scalars.items()
    )
    return _event(wall_time, step, _field_bytes(5, values))


def text_event(wall_time: float, step: int, tag: str, text: str) -> bytes:
    """A `Summary` with one `Value{tag, metadata: text plugin, tensor: DT_STRING scalar}`: TensorBoard's
    text dashboard shows it (e.g. which node and device each rank ran on)."""
    plugin = _field_bytes(1, _field_bytes(1, b"text"))  # SummaryMetadata.plugin_data.plugin_name
    tensor = _varint(1 << 3) + _varint(7) + _field_bytes(2, b"") + _field_bytes(8, text.encode())
    value = _field_bytes(1, tag.encode()) + _field_bytes(9, plugin) + _field_bytes(8, tensor)
    return _event(wall_time, step, _field_bytes(5, _field_bytes(1, value)))


class EventFileWriter:
    """Appends scalar (and text) events to one TensorBoard event file."""

    def __init__(self, path: Path, *, purge_from_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 (closed by close())
        self._write(file_version_event(time.time()))
        if purge_from_step is not None:
            self._write(session_start_event(time.time(), purge_from_step))
        self.flush()

    def _write(self, event: bytes) -> None:
        self._file.write(tfrecord(event))

    def add_scalars(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        if scalars:
            self._write(scalars_event(time.time() if wall_time is None else wall_time, step, scalars))

    def add_text(self, step: int, tag: str, text: str) -> None:
        self._write(text_event(time.time(), step, tag, text))

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def event_file_name(after: list[str] | None = None, wall_time: float | None = None) -> str:
    """`events.out.tfevents.<unix time>.<host>.<pid>.1`, TensorBoard's own pattern. TensorBoard reads a
    directory's files in name order, so the time is made later than every file in `after` (a resume
    within the same second as the interrupted process still sorts after it)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
    stamp = int(time.time() if wall_time is None else wall_time)
    for name in after or []:
        earlier = name.rsplit("/", 1)[-1].removeprefix(EVENT_FILE_PREFIX).split(".")[0]
        if earlier.isdigit():
            stamp = max(stamp, int(earlier) + 1)
    return f"{EVENT_FILE_PREFIX}{stamp:010d}.{host}.{os.getpid()}.1"


# --------------------------------------------------------------------------------------------------
# The run's curves
# --------------------------------------------------------------------------------------------------


def _finite(scalars: Mapping[str, Any]) -> dict[str, float]:
    """Numbers only; NaN and inf stay (a skipped non-finite step shows as a gap), None is dropped."""
    return {tag: float(value) for tag, value in scalars.items() if isinstance(value, int | float)}


class TrainingCurves:
    """Writes one training process's scalars to TensorBoard (and the optional trackers) and keeps the
    event files in the store under `checkpoints/<run>/tensorboard/`."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,  # e.g. "checkpoints/<run>/tensorboard"
        local_dir: Path,
        uploader: Uploader,
        *,
        run: str,
        upload_every_s: float = 60.0,
        start_step: int = 0,
        config: Mapping[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.prefix, self.uploader = store, prefix.rstrip("/"), uploader
        self.upload_every_s = upload_every_s
        self.log = log or (lambda message: None)
        self.local_dir = Path(local_dir)
        self._keys = [info.key for info in store.list(f"{self.prefix}/{EVENT_FILE_PREFIX}")]
        # A resumed run trains the steps after its checkpoint again: readers drop what the interrupted
        # process logged from there on (its first file says so). So does a run that starts over at step
        # 0 beside the files of an attempt that never reached a checkpoint.
        self._purge_from = start_step + 1 if start_step > 0 or self._keys else None
        self.writer: EventFileWriter | None = None  # begun at the first event, so no file is empty
        self.key = ""
        self._last_upload = time.monotonic()
        self._uploads = 0
        self.trackers = optional_trackers(run, dict(config or {}), self.log)

    def log_step(
        self, step: int, scalars: Mapping[str, Any], tagged: Mapping[str, Any] | None = None
    ) -> None:
        """One step's `train/*` scalars, with `tagged` ones under their own tags (e.g. `ranks/...`)."""
        self._log(step, {**{f"train/{tag}": value for tag, value in scalars.items()}, **(tagged or {})})

    def log_eval(self, step: int, scalars: Mapping[str, Any]) -> None:
        self._log(step, {f"eval/{tag}": value for tag, value in scalars.items()})

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text entry (TensorBoard's text dashboard), e.g. the ranks' nodes and devices."""
        self._writer_for_event().add_text(step, tag, text)

    def _writer_for_event(self) -> EventFileWriter:
        if self.writer is None:
            name = event_file_name(self._keys)
            self.writer = EventFileWriter(self.local_dir / name, purge_from_step=self._purge_from)
            self.key, self._purge_from = f"{self.prefix}/{name}", None
            self._keys.append(self.key)
        return self.writer

    def _log(self, step: int, scalars: Mapping[str, Any]) -> None:
        numbers = _finite(scalars)
        self._writer_for_event().add_scalars(step, numbers)
        for tracker in list(self.trackers):
            try:
                tracker.log(step, {tag: value for tag, value in numbers.items() if math.isfinite(value)})
            except Exception as error:  # a tracker must never stop training
                self.log(f"WARNING: {tracker.name} reporting failed ({error}); it is turned off for this run")
                self.trackers.remove(tracker)
        if time.monotonic() - self._last_upload >= self.upload_every_s:
            self.upload()

    def upload(self) -> None:
        """Upload the current event file as it is now (in the background, through the uploader): a copy,
        since it is still being appended to."""
        if self.writer is None:
            return
        self.writer.flush()
        self._last_upload = time.monotonic()
        self._uploads += 1
        snapshot = self.writer.path.with_name(f".upload-{self._uploads}-{self.writer.path.name}")
        shutil.copyfile(self.writer.path, snapshot)
        self.uploader.submit(snapshot, self.key, delete_after=True)

    def rotate(self) -> None:
        """End the current file: closed, uploaded a last time (and then deleted here); the next event
        begins a new one. Done at each checkpoint."""
        if self.writer is None:
            return
        self.writer.close()
        self._last_upload = time.monotonic()
        self.uploader.submit(self.writer.path, self.key, delete_after=True)
        self.writer = None

    def close(self, *, failed: bool = False) -> None:
        """Final upload (waits for it), then close the optional trackers. After a failed run the curves
        so far are still uploaded, but an upload error is only logged: the run's own error matters."""
        try:
            self.rotate()
            self.uploader.flush()
        except Exception as error:
            if not failed:
                raise
            self.log(f"WARNING: the training curves could not be uploaded to {self.store.uri(self.key)}: "
                     f"{error}")  # fmt: skip
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as error:
                self.log(f"WARNING: closing {tracker.name} failed ({error})")
        self.trackers = []


# --------------------------------------------------------------------------------------------------
# Optional trackers
# --------------------------------------------------------------------------------------------------


class _WandbTracker:
    name = "W&B"

    def __init__(self, run: str, config: dict[str, Any]) -> None:
        wandb = importlib.import_module("wandb")
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"dflash-{run}")
        self._run = wandb.init(
            project=os.environ["WANDB_PROJECT"], name=run, id=run_id, resume="allow", config=config
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _MlflowTracker:
    name = "MLflow"
    RUN_TAG = "dflash_run"

    def __init__(self, run: str, config: dict[str, Any]) -> None:
        mlflow = importlib.import_module("mlflow")
        self._mlflow = mlflow
        existing = mlflow.search_runs(
            filter_string=f"tags.{self.RUN_TAG} = '{run}'", max_results=1, output_format="list"
        )
        run_id = existing[0].info.run_id if existing else None
        mlflow.start_run(run_id=run_id, run_name=None if run_id else run, tags={self.RUN_TAG: run})
        if run_id is None:
            mlflow.log_params({key: str(value)[:250] for key, value in config.items()})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


_TRACKERS: dict[str, tuple[str, str, type]] = {
    # package -> (the variable that says the user set it up, what to install, the adapter)
    "wandb": ("WANDB_PROJECT", "wandb", _WandbTracker),
    "mlflow": ("MLFLOW_TRACKING_URI", "mlflow", _MlflowTracker),
}


def optional_trackers(run: str, config: dict[str, Any], log: Callable[[str], None]) -> list[Any]:
    """The trackers the environment asks for and can serve; a configured one that is not installed, or
    fails to start, is named in a warning and skipped."""
    trackers = []
    for package, (variable, install, adapter) in _TRACKERS.items():
        if not os.environ.get(variable, "").strip():
            continue
        if importlib.util.find_spec(package) is None:
            log(f"WARNING: {variable} is set but {package} is not installed (pip install {install}); "
                f"training curves go to TensorBoard only")  # fmt: skip
            continue
        try:
            trackers.append(adapter(run, config))
            log(f"training curves also go to {adapter.name} ({variable})")
        except Exception as error:
            log(f"WARNING: {adapter.name} could not start ({error}); training curves go to TensorBoard only")
    return trackers
