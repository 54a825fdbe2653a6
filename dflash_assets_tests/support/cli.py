"""The `dagster` command as a user runs it from a shell: in a session of its own, so a test can kill
its whole process group, or only the process itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def dagster(args: list[str], env: dict[str, str], **popen) -> subprocess.Popen:
    executable = Path(sys.executable).with_name("dagster")
    return subprocess.Popen(
        [str(executable), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


# Run config that runs every step inside the `dagster` process instead of a child process per step.
# For tests about what a range stores or how a run fails, not about processes: each child process
# imports torch and transformers again, which would double a two-step run's CPU time on the 2-core
# machine. Every test about kills, orphans, device leases or the user's default command keeps the
# multiprocess executor a user gets.
IN_PROCESS = {"execution": {"config": {"in_process": {}}}}


def materialize_args(
    asset: str, partition: str | None, config: dict | None = None, *, in_process: bool = False
) -> list[str]:
    """`dagster asset materialize` of `asset` (a selection), one partition unless `partition` is None;
    `config` is the op config of `asset` when it names one asset."""
    args = ["asset", "materialize", "-m", "dflash_assets.definitions", "--select", asset]
    if partition is not None:
        args += ["--partition", partition]
    run_config: dict = {"ops": {asset: {"config": config}}} if config else {}
    if in_process:
        run_config.update(IN_PROCESS)
    if run_config:
        args += ["--config-json", json.dumps(run_config)]
    return args


def run_cli(args: list[str], env: dict[str, str], timeout_s: float = 300) -> tuple[int, str]:
    process = dagster(args, env)
    output, _ = process.communicate(timeout=timeout_s)
    return process.returncode, output


def kill_when(process: subprocess.Popen, condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """SIGKILL the process's whole group as soon as `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError("the run finished before the kill point:\n" + process.stdout.read()[-3000:])
        if condition():
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError("kill point never reached")
