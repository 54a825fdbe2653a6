"""Training curves: TensorBoard reads every step's scalars and every evaluation's from the store, a resumed
run continues the same curves, and the optional trackers get the same numbers without ever stopping a run."""

from __future__ import annotations

import importlib.machinery
import math
import struct
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectStore
from dflash_assets.training.curves import EventFileWriter, crc32c, event_file_name, tfrecord
from dflash_assets.training.data import OfflineData, OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import TrainResult, train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    write_hidden_state_partition,
)

STEP_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/sequences_per_step"}
EVAL_TAGS = {"eval/loss", "eval/tau_teacher_forced", "eval/tau_measured"}


class Killed(Exception):
    pass


def settings(**overrides: object) -> TrainSettings:
    fields = {
        "mode": "online",
        "max_steps": 6,
        "lr": 3e-3,
        "num_anchors": 8,
        "global_batch_size": 4,
        "eval_samples": 2,
        "spec_eval_prompts": 1,
        "spec_eval_max_new_tokens": 8,
        "log_every_steps": 1,
        "checkpoint_every_steps": 3,
        "checkpoint_every_minutes": None,
    }
    return TrainSettings(**{**fields, **overrides})


def copy_of_the_run(store: ObjectStore, run: str, directory: Path) -> Path:
    """What `aws s3 cp --recursive s3://.../checkpoints/<run>/tensorboard ./tb` gives a user."""
    prefix = f"checkpoints/{run}/tensorboard/"
    for info in store.list(prefix):
        (directory / info.key[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
        (directory / info.key[len(prefix) :]).write_bytes(store.get_bytes(info.key))
    return directory


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard's own loader reads the directory."""
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def scalar_steps(logdir: Path, tag: str) -> list[int]:
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(tag)]


def test_tensorboard_reads_each_steps_scalars_and_each_evaluations_from_the_store(
    config: DrafterConfig, capture: HiddenStateCapture, samples: list[TokenizedSample], tmp_path: Path
) -> None:
    store = open_store(str(tmp_path / "store"))
    result = train_drafter(
        config, settings(), OnlineData(samples, capture), store=store, run="curves", work_dir=tmp_path / "w"
    )
    curves = scalars(copy_of_the_run(store, "curves", tmp_path / "copy"))

    assert set(curves) >= STEP_TAGS | EVAL_TAGS
    for tag in STEP_TAGS:
        assert sorted(curves[tag]) == list(range(1, result.steps + 1)), tag
    assert all(math.isfinite(value) and value > 0 for value in curves["train/loss"].values())
    assert set(curves["train/sequences_per_step"].values()) <= {4.0, 2.0}  # 10 training samples, 4 a step
    assert curves["train/lr"][1] > curves["train/lr"][3] > curves["train/lr"][6]  # the cosine down
    assert curves["train/grad_norm"][1] > 0 and curves["train/tokens_per_s"][1] > 0
    # Evaluations: the untrained drafter (step 0), each checkpoint, the end.
    assert sorted(curves["eval/loss"]) == [0, 3, 6]
    assert curves["eval/loss"][6] == pytest.approx(result.eval["loss"], rel=1e-6)
    assert curves["eval/tau_measured"][6] == pytest.approx(result.acceptance_length_tau, rel=1e-6)
    # The held-out prompts are all short here: their bucket's tau is the whole tau, with its prompt count.
    assert curves["eval/tau_measured_under_2k"][6] == pytest.approx(result.acceptance_length_tau, rel=1e-6)
    assert curves["eval/prompts_under_2k"][6] == 1.0 and "eval/tau_measured_2k_8k" not in curves
    assert curves["eval/tau_teacher_forced"][0] >= 1.0
    assert list((tmp_path / "w" / "tensorboard").iterdir()) == []  # local copies gone once uploaded


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_a_resumed_run_continues_the_same_curves_in_an_s3_store(
    s3_store_url: str,
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    target_dir: Path,
    tmp_path: Path,
) -> None:
    store = open_store(s3_store_url)
    objects = write_hidden_state_partition(
        store, "00000000-00000099", samples, capture, str(target_dir), tmp_path / "scratch"
    )
    offline = settings(mode="offline", max_steps=7, checkpoint_every_steps=2, spec_eval_prompts=0)

    def data(cache: str) -> OfflineData:
        return OfflineData(store, objects, tmp_path / cache, num_tokens=[s.num_tokens for s in samples])

    def run(name: str, cache: str, log=None) -> TrainResult:
        return train_drafter(
            config, offline, data(cache), store=store, run=name, work_dir=tmp_path / cache, log=log
        )

    run("straight", "a")  # the same run, never interrupted

    def kill_at_step_5(line: str) -> None:
        if line.startswith("step 5/"):
            raise Killed(line)

    with pytest.raises(Killed):
        run("resumed", "b", kill_at_step_5)
    interrupted = copy_of_the_run(store, "resumed", tmp_path / "interrupted")
    assert scalar_steps(interrupted, "train/loss") == [1, 2, 3, 4, 5]  # a failed run's curves still land
    resumed = run("resumed", "c")
    assert resumed.resumed_from_step == 4

    logdir = copy_of_the_run(store, "resumed", tmp_path / "copy")
    # Event files: per process, a new one at each checkpoint; names in the order they were begun.
    files = sorted(path.name for path in logdir.iterdir())
    assert len(files) == 5 and len({name.split(".")[3] for name in files}) == 5  # 0-2, 2-4, 4-5 | 5-6, 6-7
    # Step 5 was logged by the interrupted process and trained again after the resume: shown once.
    assert scalar_steps(logdir, "train/loss") == list(range(1, 8))
    expected = scalars(copy_of_the_run(store, "straight", tmp_path / "straight"))
    got = scalars(logdir)
    for tag in ("train/loss", "train/grad_norm", "train/lr"):
        assert got[tag] == pytest.approx(expected[tag], rel=1e-5), tag
    assert sorted(got["eval/loss"]) == [0, 2, 4, 6, 7]


def test_event_files_are_tensorboards_record_format_nan_included(tmp_path: Path) -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    writer = EventFileWriter(tmp_path / "events.out.tfevents.1.host.1.1", purge_from_step=3)
    writer.add_scalars(3, {"train/loss": 2.5, "train/lr": 1e-4}, wall_time=100.0)
    writer.add_scalars(4, {"train/loss": float("nan")}, wall_time=101.0)
    writer.close()

    events = list(LegacyEventFileLoader(str(writer.path)).Load())  # the raw events; both CRCs checked
    assert events[0].file_version == "brain.Event:2"
    assert events[1].session_log.status == events[1].session_log.START and events[1].step == 3
    assert [(e.step, e.wall_time) for e in events[2:]] == [(3, 100.0), (4, 101.0)]
    values = {v.tag: v.simple_value for v in events[2].summary.value}
    assert values == {"train/loss": 2.5, "train/lr": pytest.approx(1e-4)}
    assert math.isnan(events[3].summary.value[0].simple_value)

    data = writer.path.read_bytes()  # a flipped byte is caught by the reader's checksum
    corrupt = tmp_path / "events.out.tfevents.2.host.1.1"
    corrupt.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    assert len(list(LegacyEventFileLoader(str(corrupt)).Load())) < len(events)
    # Byte for byte what protobuf itself encodes for those events, framed as TFRecords.
    assert data == b"".join(tfrecord(event.SerializeToString()) for event in events)
    assert struct.unpack("<Q", data[:8])[0] == len(events[0].SerializeToString())


def test_a_new_event_file_sorts_after_every_file_of_the_run_even_within_the_same_second() -> None:
    first = event_file_name(wall_time=1_700_000_000.2)
    second = event_file_name([f"checkpoints/r/tensorboard/{first}"], wall_time=1_700_000_000.7)
    third = event_file_name([first, second], wall_time=1_600_000_000)  # a clock set back
    assert sorted([third, second, first]) == [first, second, third]
    assert first.startswith("events.out.tfevents.1700000000.") and "tfevents" in third


class FakeWandb(types.ModuleType):
    """The part of `wandb` the tracker uses; records what it is given."""

    def __init__(self, fail_on_log: bool = False) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = False
        self.fail_on_log = fail_on_log

    def init(self, **kwargs: object) -> FakeWandb:
        self.inits.append(kwargs)
        return self

    def log(self, data: dict, step: int) -> None:
        if self.fail_on_log:
            raise ConnectionError("wandb.ai unreachable")
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


def test_wandb_gets_the_same_scalars_when_installed_and_configured(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "drafters")
    lines: list[str] = []
    store = open_store(str(tmp_path / "store"))
    result = train_drafter(
        config,
        settings(max_steps=3, eval_samples=0, spec_eval_prompts=0),
        OnlineData(samples, capture),
        store=store,
        run="wb-1",
        work_dir=tmp_path / "w",
        log=lines.append,
    )
    assert fake.inits[0]["project"] == "drafters" and fake.inits[0]["id"] == "dflash-wb-1"
    assert fake.inits[0]["resume"] == "allow" and fake.inits[0]["config"]["lr"] == 3e-3
    steps = [step for step, data in fake.logged if "train/loss" in data]
    assert steps == [1, 2, 3] == list(range(1, result.steps + 1))
    board = scalars(copy_of_the_run(store, "wb-1", tmp_path / "copy"))["train/loss"]
    assert [data["train/loss"] for _, data in fake.logged] == pytest.approx([board[s] for s in steps])
    assert fake.finished and any("also go to W&B (WANDB_PROJECT)" in line for line in lines)


def test_a_failing_or_missing_tracker_is_named_once_and_training_goes_on(
    config: DrafterConfig,
    capture: HiddenStateCapture,
    samples: list[TokenizedSample],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail_on_log=True))
    monkeypatch.setenv("WANDB_PROJECT", "drafters")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed here, whatever the machine has
    lines: list[str] = []
    store = open_store(str(tmp_path / "store"))
    result = train_drafter(
        config,
        settings(max_steps=3, eval_samples=0, spec_eval_prompts=0),
        OnlineData(samples, capture),
        store=store,
        run="wb-2",
        work_dir=tmp_path / "w",
        log=lines.append,
    )
    assert result.steps == 3
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert any("W&B reporting failed (wandb.ai unreachable)" in line for line in warnings)
    assert any("MLFLOW_TRACKING_URI is set but mlflow is not installed" in line for line in warnings)
    assert len(warnings) == 2
    assert scalar_steps(copy_of_the_run(store, "wb-2", tmp_path / "copy"), "train/loss") == [1, 2, 3]
