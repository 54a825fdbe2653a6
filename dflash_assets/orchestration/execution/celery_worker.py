"""`dflash-assets worker`: a node that takes steps from the broker's queues and runs them.

A node is a Celery worker of this code location: `--queue gpu` takes GPU steps (extraction,
training, regeneration), `--queue default` tokenisation. Each step runs in a fresh child process
of the worker (one step per process, so a step's memory and device are released when it ends),
with the node's own environment: its `DFLASH_DEVICES`, staging and cache directories, and its
credentials. The worker's main process imports what steps import (`step_imports.py`) once, so
each step starts without importing torch and transformers again, but never initialises CUDA: a
process forked after CUDA is initialised cannot use it. `--name` becomes `DFLASH_NODE`, which every
step records (metadata `node`, a compute-log line) and which names the Celery worker (`NAME@host`).

A step stops by itself when its run has ended elsewhere (its run worker died and was reaped, or
the run was terminated): nothing is left computing for a run nobody waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from dflash_assets import settings
from dflash_assets.orchestration.execution.executor import RUN_SETTINGS_TAG

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def node_device_count() -> int:
    """Devices a node's steps may lease: `DFLASH_DEVICES`, else the visible CUDA devices, else 1."""
    configured = settings.devices()
    if configured:
        return len(configured)
    # Counting CUDA devices in this process would initialise the driver before the worker forks its
    # step processes, which then cannot use CUDA. A short-lived child counts them instead.
    probe = "import torch; print(torch.cuda.device_count())"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        return max(1, int(done.stdout.strip().splitlines()[-1]))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 1


def execute_step(task, execute_step_args_packed: dict, executable_dict: dict) -> list[str]:
    """The Celery task: one Dagster step of a run, executed in this process (dagster_celery's
    `execute_plan` task, plus the node's name and the check that the run still waits for it)."""
    from celery.exceptions import Ignore
    from dagster import DagsterInstance, DagsterRunStatus
    from dagster._core.definitions.reconstruct import ReconstructableJob
    from dagster._core.events import EngineEventData
    from dagster._core.execution.api import create_execution_plan, execute_plan_iterator
    from dagster._grpc.types import ExecuteStepArgs
    from dagster._serdes import serialize_value, unpack_value
    from dagster_celery.core_execution_loop import DELEGATE_MARKER

    args = unpack_value(execute_step_args_packed, as_type=ExecuteStepArgs)
    node = settings.node_name()
    step_keys = ", ".join(args.step_keys_to_execute or [])
    assert args.instance_ref is not None, "dagster_celery always sends the instance"
    with DagsterInstance.from_ref(args.instance_ref) as instance:
        run = instance.get_run_by_id(args.run_id)
        if run is None or run.status != DagsterRunStatus.STARTED:
            # Queued for a run that has ended since (its run worker died and was reaped, or it was
            # terminated): nobody waits for this step any more.
            status = run.status.value if run else "unknown"
            print(f"node {node}: skipping step {step_keys} of run {args.run_id} ({status})", file=sys.stderr)
            raise Ignore()
        # How the run was launched shapes its training, whatever this node's environment says (this
        # process runs this one step and exits).
        settings.apply_run_settings(json.loads(run.tags.get(RUN_SETTINGS_TAG, "{}")))
        job = ReconstructableJob.from_dict(executable_dict)
        plan = create_execution_plan(
            job, run.run_config, step_keys_to_execute=args.step_keys_to_execute, known_state=args.known_state
        )
        step_key = plan.step_handle_for_single_step_plans().to_key()
        started = instance.report_engine_event(
            f"Executing step {step_keys} on node {node} (Celery worker {task.request.hostname}, "
            f"pid {os.getpid()})",
            run,
            EngineEventData(
                {"node": node, "Celery worker": task.request.hostname, "pid": str(os.getpid())},
                marker_end=DELEGATE_MARKER,
            ),
            step_key=step_key,
        )
        step_done = threading.Event()
        threading.Thread(
            target=_stop_when_run_ends,
            args=(args.instance_ref, args.run_id, step_key, node, step_done),
            name="dflash-run-watch",
            daemon=True,
        ).start()
        events = [started]
        try:
            for event in execute_plan_iterator(
                execution_plan=plan,
                job=job,
                dagster_run=run,
                instance=instance,
                retry_mode=args.retry_mode,
                run_config=run.run_config,
            ):
                events.append(event)
        finally:
            step_done.set()
    return [serialize_value(event) for event in events]


def _stop_when_run_ends(
    instance_ref, run_id: str, step_key: str, node: str, step_done: threading.Event
) -> None:
    from dagster import DagsterInstance, DagsterRunStatus

    with DagsterInstance.from_ref(instance_ref) as instance:
        while not step_done.wait(settings.CELERY_RUN_CHECK_S.get_float()):
            try:
                run = instance.get_run_by_id(run_id)
            except Exception:  # the instance unreachable for a moment is no reason to stop
                continue
            if step_done.is_set() or (run is not None and run.status == DagsterRunStatus.STARTED):
                continue
            status = run.status.value if run else "deleted"
            message = f"node {node}: run {run_id} is {status}; stopping its step {step_key}"
            print(message, file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                instance.report_engine_event(message, run, step_key=step_key)
            os.kill(os.getpid(), signal.SIGKILL)


def _create_instance_tables(attempts: int = 5) -> None:
    """Open the node's Dagster instance once before taking steps, so its tables exist before any run.

    Dagster creates an instance's tables on first use. On a fresh PostgreSQL database several
    processes doing that at once collide (`relation "instance_info" already exists`), which fails
    every run but one of a batch launched at once. Nodes start before the runs they serve, so they
    make the tables first. Two nodes started together may still collide: the loser tries again.
    Without `DAGSTER_HOME` there is nothing to prepare (each step gets its instance from its run).
    """
    if not os.environ.get("DAGSTER_HOME"):
        return
    import time

    from dagster import DagsterInstance

    for attempt in range(1, attempts + 1):
        try:
            with DagsterInstance.get():
                return
        except Exception as error:  # the database's own error types vary by storage
            if attempt == attempts:
                raise
            reason = type(error).__name__
            print(f"the Dagster instance is not ready ({reason}); trying again", file=sys.stderr)
            time.sleep(attempt)


def worker_argv(queues: Sequence[str], name: str, concurrency: int, loglevel: str = "INFO") -> list[str]:
    """`celery worker` arguments: no broker URL among them (the app reads it from the environment)."""
    hostname = name if "@" in name else f"{name}@%h"
    return [
        "worker",
        f"--hostname={hostname}",
        f"--queues={','.join(queues)}",
        f"--concurrency={concurrency}",
        "--pool=prefork",
        "--max-tasks-per-child=1",  # one step per process
        "--prefetch-multiplier=1",
        "--without-gossip",
        "--without-mingle",
        f"--loglevel={loglevel}",
    ]


def run_worker(queues: Sequence[str], name: str, concurrency: int | None = None) -> int:
    """Start this node's Celery worker (returns when it shuts down)."""
    from dflash_assets.orchestration.execution.celery_app import TASK_NAME, node_app

    if not queues:
        raise ValueError("a worker needs at least one --queue (gpu, default)")
    if not _NODE_NAME.match(name):
        raise ValueError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (it names the node)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    settings.NODE.export(name)  # the step processes' node name
    app = node_app(queues)
    app.task(bind=True, name=TASK_NAME)(execute_step)
    from dflash_assets.orchestration.execution.celery_training import JOIN_TASK_NAME, join_training

    app.task(bind=True, name=JOIN_TASK_NAME)(join_training)
    import dflash_assets.definitions  # noqa: F401  a code location that does not load fails here, once
    import dflash_assets.orchestration.execution.step_imports  # noqa: F401  once for every step process (no CUDA initialised)

    _create_instance_tables()

    processes = concurrency or node_device_count()
    print(
        f"node {name}: queues {', '.join(queues)}, {processes} step process(es) at a time, "
        f"devices {settings.DEVICES.get() or 'all visible'}, staging {settings.staging_dir()}",
        file=sys.stderr,
        flush=True,
    )
    app.worker_main(worker_argv(queues, name, processes))
    return 0
