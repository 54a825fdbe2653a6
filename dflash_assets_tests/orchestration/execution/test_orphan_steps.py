"""A step never outlives its run worker: killed alone (the `dagster asset materialize` process,
its step child spared) or with its whole process group, the step stops within seconds, its device
lease is free at once, and the same command run again finishes the range."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_assets.orchestration.execution.orphans import RUN_WORKER_ENV
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets.target.devices import lease_device
from dflash_assets_tests.conftest import open_instance
from dflash_assets_tests.support.celery_nodes import gone_within, process_alive, process_children
from dflash_assets_tests.support.cli import dagster, materialize_args, run_cli
from dflash_assets_tests.support.ranges import SAMPLES_PER_RANGE

KEY = "00000000-00000023"  # the first of conftest's `demo_ranges`, whose tokenized range is copied


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _step_process(run_worker: int) -> int | None:
    """The multiprocess executor's step process: a child of the forkserver the run worker started
    (not of multiprocessing's resource tracker, its other child)."""
    for pid in process_children(run_worker):
        cmdline = _cmdline(pid)
        if cmdline is not None and b"multiprocessing.forkserver" in cmdline:
            # Forked, not exec'd: a step has the forkserver's command line. While it preloads, the
            # forkserver may run short-lived programs of its own (a library probing the system), which
            # carry that command line too from their fork to their exec: a step is one still there a
            # second later.
            steps = [child for child in process_children(pid) if _cmdline(child) == cmdline]
            if steps:
                time.sleep(1.0)
                steps = [child for child in steps if _cmdline(child) == cmdline]
            if steps:
                # it preloaded what steps import: torch is mapped before any step asked for it
                assert "libtorch" in Path(f"/proc/{pid}/maps").read_text()
                # and it forks from one thread: forking a process with threads can deadlock the child
                assert len(list(Path(f"/proc/{pid}/task").iterdir())) == 1
            return steps[0] if steps else None
    return None


@pytest.mark.parametrize("kill", ["the run worker alone", "the whole process group"])
def test_a_step_stops_within_seconds_when_its_run_worker_is_killed(
    kill, dflash_env, s3_store_url, faulty_proxy, demo_ranges
):
    # os.environ: dflash_env's homes and the AWS variables pointing at moto, both set by fixtures.
    samples = str(SAMPLES_PER_RANGE)
    env = {**os.environ, "DFLASH_STORE_URL": s3_store_url, "DFLASH_SAMPLES_PER_PARTITION": samples}
    assert demo_ranges.keys[0] == KEY
    demo_ranges.copy_to(open_store(s3_store_url), prefixes=("tokenized-completions",))
    slow = faulty_proxy()
    slow.throttle(latency_s=0.5)  # the step would run on for many seconds
    slow_env = {**env, "AWS_ENDPOINT_URL_S3": slow.endpoint_url, "DFLASH_UPLOAD_MAX_IN_FLIGHT": "1"}
    run = dagster(materialize_args("hidden_state_partitions", KEY), slow_env)
    store = open_store(s3_store_url)
    deadline = time.monotonic() + 180
    step = None
    while step is None or not list(store.list(f"hidden-states/{KEY}/hs_")):
        assert run.poll() is None, run.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the step never started uploading"
        step = step or _step_process(run.pid)
        time.sleep(0.05)

    if kill == "the run worker alone":
        os.kill(run.pid, signal.SIGKILL)
    else:
        os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    assert gone_within(step, 5.0), f"step process {step} outlived its run worker"
    lock_dir = Path(env["DFLASH_CACHE_DIR"]) / "device-leases"
    with lease_device(["cpu"], lock_dir=lock_dir, timeout_s=1.0) as device:  # free at once
        assert device == "cpu"
    assert read_manifest(store, f"hidden-states/{KEY}") is None

    code, output = run_cli(materialize_args("hidden_state_partitions", KEY), env)
    assert code == 0, output[-4000:]
    assert read_manifest(store, f"hidden-states/{KEY}") is not None
    with open_instance(env["DAGSTER_HOME"]) as instance:
        runs = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == KEY]
        killed, rerun = runs[1], runs[0]  # newest first
        assert killed.is_failure and rerun.is_success


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from dflash_assets.orchestration.execution import orphans
    if sys.argv[1] == "arm":
        orphans.arm(os.getppid(), use_prctl=sys.argv[2] == "prctl")
    else:
        print(orphans.arm_if_started_by_a_run_worker(), flush=True)
    print("ready", flush=True)
    time.sleep(120)
    """
)
_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    argv = [sys.executable, "-c", sys.argv[1], *sys.argv[2:]]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    lines = [child.stdout.readline().strip() for _ in range(1 + (sys.argv[2] != "arm"))]
    print(child.pid, *lines, flush=True)
    time.sleep(120)
    """
)


def _parent_with_child(*args: str, parent_is_run_worker: bool = False, run_worker_env: str | None = None):
    """A parent process (in a session of its own) that starts `_CHILD` with `args`; returns the parent,
    the child's pid and what the child said."""
    env = dict(os.environ)
    if run_worker_env is not None:
        env[RUN_WORKER_ENV] = run_worker_env
    prefix = f"import os; os.environ[{RUN_WORKER_ENV!r}] = str(os.getpid())\n" if parent_is_run_worker else ""
    parent = subprocess.Popen(
        [sys.executable, "-c", prefix + _PARENT, _CHILD, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    pid, *said = parent.stdout.readline().split()
    return parent, int(pid), said


@pytest.mark.parametrize("way", ["prctl", "polling"])
def test_an_armed_process_dies_with_its_parent_by_either_way(way):
    parent, child, said = _parent_with_child("arm", way)
    assert said == ["ready"] and process_alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert gone_within(child, 3.0)


def test_a_child_of_the_run_worker_named_in_the_environment_arms_itself_and_dies_with_it():
    parent, child, said = _parent_with_child("check", parent_is_run_worker=True)
    assert said == ["True", "ready"]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert gone_within(child, 3.0)


def test_a_process_whose_parent_is_not_that_run_worker_does_not_arm_itself():
    parent, child, said = _parent_with_child("check", run_worker_env="1")
    assert said == ["False", "ready"]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    time.sleep(1.5)
    assert process_alive(child)
    os.kill(child, signal.SIGKILL)
