"""A step's side of a target split over several devices (`DFLASH_TARGET_TP` > 1): its ranks launched with
torch.distributed's launcher (`target/launcher.py`: torchrun that dies with this process), followed until
they end.

The step waits until the host has as many free devices as the target spans (saying whom it waits for),
serves a `torch.distributed.TCPStore` that rank 0 reports to (`target/ranks.py`), replays the reports into
Dagster as they come, and ends when the launcher does: with rank 0's outcome, or with a message naming what
failed. No rank is ever restarted: a rank that dies ends them all, and the range's next run resumes from
what the store and staging hold. A step that is stopped stops its launcher, whose ranks die with it; a
step killed outright takes them along too (the launcher and every rank die with their parent).

`run_target_ranks` runs a stage to its end on rank 0 (a range's capture); `serve_target_ranks` keeps the
ranks up as a server the step sends requests to (regeneration's batches).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from dflash_assets import settings
from dflash_assets.orchestration.execution.launched import (
    STOP_GRACE_S,
    LauncherOutput,
    stop_launcher,
    wait_for_free_devices,
)
from dflash_assets.target.ranks import EVENTS_QUEUE, REPLIES_QUEUE, REQUESTS_QUEUE, TargetRankJob

POLL_S = 0.1


class TargetRanksFailed(RuntimeError):
    """The ranks of a split target ended without an outcome: the message says which and how."""


class Reports(Protocol):
    """What the step does with rank 0's reports (the asset implements it)."""

    def log(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...

    def progress(self, snapshot: dict[str, Any]) -> None: ...

    def status(self, text: str) -> None: ...


class _StepStore:
    """The TCPStore rank 0 reports to (and a server's requests and replies go through), served here."""

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.endpoint = f"{host}:{self._store.port}"

    def events(self) -> Iterator[dict[str, Any]]:
        while self._store.queue_len(EVENTS_QUEUE) > 0:
            yield json.loads(self._store.queue_pop(EVENTS_QUEUE, block=False))

    def request(self, body: dict[str, Any]) -> None:
        self._store.queue_push(REQUESTS_QUEUE, json.dumps(body))

    def reply(self) -> dict[str, Any] | None:
        if self._store.queue_len(REPLIES_QUEUE) > 0:
            return json.loads(self._store.queue_pop(REPLIES_QUEUE, block=False))
        return None


def wait_for_devices(job: TargetRankJob, reports: Reports) -> None:
    """Return once `job.tp` of the host's devices are free; a host that could never offer them fails."""
    if len(job.devices) < job.tp:
        raise TargetRanksFailed(
            f"{settings.TARGET_TP.name}={job.tp} asks for {job.tp} devices and this host offers "
            f"{len(job.devices)} ({', '.join(job.devices)}): lower it, or list more devices in "
            f"{settings.DEVICES.name} (a CPU-only machine simulates them: DFLASH_DEVICES=cpu:0,cpu:1)"
        )
    wait_for_free_devices(job.devices, job.lock_dir, job.tp, where="", status=reports.status, log=reports.log)


class _Ranks:
    """One launch of a split target's ranks, followed: their reports replayed, their end noticed."""

    def __init__(self, job: TargetRankJob, reports: Reports, launch_dir: Path) -> None:
        from dflash_assets.target.launcher import launcher_command

        self.reports = reports
        self.store = _StepStore("127.0.0.1", job.timeout_s)
        self.job = replace(job, step=self.store.endpoint)
        launch_dir.mkdir(parents=True, exist_ok=True)
        job_file = launch_dir / "job.json"
        job_file.write_text(self.job.to_json())
        env = dict(os.environ)
        # torchrun would set 1 with a warning; a rank gets its share of the cores instead.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.tp)))
        reports.log(f"launching {job.tp} target ranks ({job.stage}) with torch.distributed's launcher")
        self.process = subprocess.Popen(
            launcher_command(job_file), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.tail = LauncherOutput(self.process.stdout, "target-launcher")
        self.outcome: dict[str, Any] | None = None
        self.failure: str | None = None  # the first error a rank reported, as it said it (it names itself)

    def pump(self) -> None:
        """Replay what the ranks reported since the last call (rank 0's logs, any rank's error)."""
        for event in self.store.events():
            kind, body = event.get("kind"), event.get("body")
            if kind == "log":
                self.reports.log(body)
            elif kind == "warn":
                self.reports.warn(body)
            elif kind == "progress":
                self.reports.progress(body)
            elif kind == "outcome":
                self.outcome = body
            elif kind in ("fatal", "error") and self.failure is None:
                self.failure = body

    def alive(self) -> bool:
        return self.process.poll() is None

    def finish(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the launcher to end by itself, then stop it; replay what is left."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        stop_launcher(self.process)
        self.tail.join()
        self.pump()

    def failure_message(self) -> str:
        code = self.process.returncode
        how = "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
        first = _root_cause(list(self.tail.lines))
        parts = [f"the {self.job.tp} target ranks ({self.job.stage}) failed"]
        if first:
            parts.append(f"{first} ended first")
        if self.failure:
            parts.append(f"the ranks reported: {self.failure[:300]}")
        if not first and not self.failure:
            parts.append(f"the launcher ended with {how}; see the step's stderr for each rank's output")
        return (
            "; ".join(parts)
            + ". Materialise the range again: it resumes from what the store and staging hold."
        )


def _root_cause(lines: list[str]) -> str:
    """torchrun's "Root Cause (first observed failure)" as `rank N (exitcode ...)`, or empty."""
    try:
        start = max(i for i, line in enumerate(lines) if "Root Cause" in line)
    except ValueError:
        return ""
    fields = {}
    for line in lines[start + 1 :]:
        name, _, value = line.partition(":")
        if name.strip() in ("rank", "exitcode") and name.strip() not in fields:
            fields[name.strip()] = value.strip()
    if "rank" not in fields:
        return ""
    rank = fields["rank"].split(" ")[0]
    return f"rank {rank} (exitcode {fields['exitcode']})" if "exitcode" in fields else f"rank {rank}"


def _launch_dir() -> Path:
    return settings.cache_dir() / "target-launch" / uuid.uuid4().hex[:12]


def run_target_ranks(job: TargetRankJob, reports: Reports) -> dict[str, Any]:
    """Launch the ranks, replay rank 0's reports until the launcher ends, return rank 0's outcome."""
    wait_for_devices(job, reports)
    launch_dir = _launch_dir()
    try:
        ranks = _Ranks(job, reports, launch_dir)
        try:
            while ranks.alive() and ranks.failure is None:
                ranks.pump()
                time.sleep(POLL_S)
            ranks.finish(grace_s=STOP_GRACE_S if ranks.failure is None else 5.0)
        finally:
            stop_launcher(ranks.process)
        if ranks.outcome is None or ranks.process.returncode != 0:
            raise TargetRanksFailed(ranks.failure_message())
        return ranks.outcome
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


class RankServer:
    """The step's end of ranks serving requests: `call(request)` sends one to rank 0 and waits for its
    reply, replaying reports meanwhile; a launcher that ends, or a reply later than `reply_timeout_s`,
    fails the call."""

    def __init__(self, ranks: _Ranks, reply_timeout_s: float) -> None:
        self._ranks = ranks
        self.reply_timeout_s = reply_timeout_s
        self.devices: list[str] = []  # the ranks' devices, once they are ready

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        ranks = self._ranks
        ranks.store.request(request)
        deadline = time.monotonic() + self.reply_timeout_s
        while True:
            reply = ranks.store.reply()
            if reply is not None:
                return reply
            ranks.pump()
            if not ranks.alive() or ranks.failure is not None:
                ranks.finish(grace_s=5.0)
                raise TargetRanksFailed(ranks.failure_message())
            if time.monotonic() > deadline:
                raise TargetRanksFailed(
                    f"rank 0 of the split target gave no reply within {self.reply_timeout_s:.0f} s "
                    f"({settings.TARGET_TP_TIMEOUT_S.name})"
                )
            time.sleep(0.005)

    def wait_ready(self) -> None:
        """Rank 0's first reply: the target is loaded on every rank (or the launch failed)."""
        self.devices = list(self.call({"kind": "ready"})["devices"])


@contextlib.contextmanager
def serve_target_ranks(job: TargetRankJob, reports: Reports, reply_timeout_s: float) -> Iterator[RankServer]:
    """The ranks up as a server for the `with` block; stopped at its end (a `stop` request, then the
    launcher's end)."""
    wait_for_devices(job, reports)
    launch_dir = _launch_dir()
    try:
        ranks = _Ranks(job, reports, launch_dir)
        server = RankServer(ranks, reply_timeout_s)
        try:
            server.wait_ready()
            yield server
            if ranks.alive():
                ranks.store.request({"kind": "stop"})
                ranks.finish()
        finally:
            stop_launcher(ranks.process)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)
