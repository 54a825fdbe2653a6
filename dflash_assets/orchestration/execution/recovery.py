"""Runs whose worker died without telling Dagster (SIGKILL of the process group, OOM kill, lost node).

Such a run stays STARTED: the UI shows it running forever and the run queue counts it against the
`gpu` pool. Dagster's default run launcher cannot check a local worker's health, so the run worker
records itself (`dflash/run_worker` = `host@pid:start`, written by the executor in the run worker
process, see `executor.py`), and the reaper marks runs whose recorded worker on this host is gone as
failed. `start` is the process's start time in clock ticks since boot, so a recycled pid never makes
a dead run look alive. Runs without the tag, or whose worker lives on another host, are never touched.

The reaper runs at the start of every run (so a rerun from the shell cleans up after a killed one),
on every tick of the failed-range sensor, and by hand as `dflash-assets reap`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import MAX_RETRIES_TAG, PARTITION_NAME_TAG

RUN_WORKER_TAG = "dflash/run_worker"
SUPERSEDED_BY_TAG = "dflash/superseded_by"
_IN_PROGRESS = [DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


def _process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot.

    None where there is no procfs (the pid alone is then the identity) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    # fields[0] is field 3 (state); field 22 is therefore fields[19]. A zombie is not alive.
    if fields[0] == "Z":
        return -1
    return int(fields[19])


@dataclass(frozen=True)
class RunWorker:
    """The process that executes a run (the `dagster asset materialize` process, or the
    `dagster api execute_run` process a launcher started) -- not a step's child process."""

    host: str
    pid: int
    start_ticks: int | None

    @classmethod
    def current(cls) -> RunWorker:
        return cls(socket.gethostname(), os.getpid(), _process_start_ticks(os.getpid()))

    @classmethod
    def parse(cls, tag: str) -> RunWorker | None:
        host, sep, rest = tag.rpartition("@")
        if not sep:
            return None
        pid, _, start = rest.partition(":")
        if not pid.isdigit() or (start and not start.isdigit()):
            return None
        return cls(host, int(pid), int(start) if start else None)

    @property
    def tag(self) -> str:
        return f"{self.host}@{self.pid}" + (f":{self.start_ticks}" if self.start_ticks is not None else "")

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def is_alive(self) -> bool:
        """Only meaningful on this host. A pid reused by another process counts as dead."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by another user
        started = _process_start_ticks(self.pid)
        if started == -1:
            return False  # zombie: killed, not yet collected by its parent
        if self.start_ticks is None or started is None:
            return True
        return started == self.start_ticks


def record_run_worker(instance: DagsterInstance, run_id: str) -> RunWorker:
    worker = RunWorker.current()
    instance.add_run_tags(run_id, {RUN_WORKER_TAG: worker.tag})
    return worker


def run_worker_of(run: DagsterRun) -> RunWorker | None:
    return RunWorker.parse(run.tags.get(RUN_WORKER_TAG, ""))


def _same_work(dead: DagsterRun, rerun: DagsterRun | None) -> bool:
    if rerun is None or dead.tags.get(PARTITION_NAME_TAG) != rerun.tags.get(PARTITION_NAME_TAG):
        return False
    if not dead.asset_selection:  # a whole-job run: only another whole-job run does all its work
        return not rerun.asset_selection
    return set(dead.asset_selection) <= set(rerun.asset_selection or ())


def reap_dead_runs(
    instance: DagsterInstance,
    log: Callable[[str], None] = print,
    rerun: DagsterRun | None = None,
) -> list[str]:
    """Mark in-progress runs whose recorded worker on this host is gone as failed (a worker crash,
    which Dagster's run retries may re-launch) and free any pool slots they held.

    `rerun`: the run doing the reaping. A dead run doing the same range and assets is superseded by
    it, so it is marked not to be retried: one failure, one re-launch (the rerun itself).
    """
    reaped = []
    for record in instance.get_run_records(filters=RunsFilter(statuses=_IN_PROGRESS)):
        run = record.dagster_run
        worker = run_worker_of(run)
        if worker is None or not worker.on_this_host() or worker.is_alive():
            continue
        current = instance.get_run_by_id(run.run_id)  # it may have finished since the listing
        if current is None or current.status not in _IN_PROGRESS:
            continue
        message = f"run worker {worker.tag} is gone (killed, or out of memory); marking the run failed"
        if _same_work(current, rerun):
            assert rerun is not None
            instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0", SUPERSEDED_BY_TAG: rerun.run_id})
            message += f"; superseded by run {rerun.run_id}"
        crashed = JobFailureData(error=None, failure_reason=RunFailureReason.UNEXPECTED_TERMINATION)
        instance.report_run_failed(current, message, crashed)
        # Op-granularity pools hold slots per step; a dead run must not keep them.
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        log(f"{run.run_id}: {message}")
        reaped.append(run.run_id)
    return reaped
