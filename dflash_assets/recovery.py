"""Runs whose worker died without telling Dagster (SIGKILL, OOM kill, a lost node).

Dagster's default run launcher cannot check a local worker's health, so such a run stays STARTED
and keeps its `gpu` pool slot: the range could never run again. Each GPU-bound asset records its
worker as `host:pid` in a run tag; the reaper marks runs whose worker on this host is gone as failed
and frees their slots. The failed-range sensor calls it on every tick; `dflash-assets reap` runs it
by hand.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from dagster import AssetExecutionContext, DagsterInstance, DagsterRunStatus, RunsFilter

WORKER_TAG = "dflash/worker"


def record_worker(context: AssetExecutionContext) -> None:
    context.instance.add_run_tags(context.run_id, {WORKER_TAG: f"{socket.gethostname()}:{os.getpid()}"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a killed process whose parent died too can linger as a zombie until init reaps it
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def reap_dead_runs(instance: DagsterInstance, log: Callable[[str], None] = print) -> list[str]:
    """Mark in-progress runs whose recorded worker on this host no longer exists as failed; free their
    pool slots. Workers on other hosts are left alone: only their own host can tell."""
    host = socket.gethostname()
    reaped = []
    records = instance.get_run_records(
        filters=RunsFilter(
            statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.CANCELING]
        )
    )
    for record in records:
        run = record.dagster_run
        worker = run.tags.get(WORKER_TAG, "")
        worker_host, _, pid = worker.rpartition(":")
        if worker_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        message = f"run worker {worker} is gone (killed or its node lost); marking the run failed"
        instance.report_run_failed(run, message)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        log(f"{run.run_id}: {message}; pool slots freed")
        reaped.append(run.run_id)
    return reaped
