"""Step processes die with their run worker instead of running on as orphans.

Dagster's multiprocess executor starts each step as a child process of the run worker (the
`dagster asset materialize` process, or the one a run launcher started), and nothing stops that
child when the run worker alone is killed: a training step once ran on for 20 minutes holding its
device lease, so the rerun could only wait for it. So while a run worker executes a run it names
itself in `DFLASH_RUN_WORKER_PID` (inherited by the processes it starts), and a process that loads
the code location (every step process does, to rebuild its job) and finds that its parent is that
run worker arms a watchdog:

- on Linux the kernel sends it SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`; strictly,
  when the parent's thread that started it ends: Dagster starts step processes from the thread
  that runs the executor, which lives as long as the run worker executes the run);
- where that is not available, a thread checks twice a second that its parent is still the one it
  started with.

A process forked from an armed one (the steps of a forkserver, `executor.py`) arms itself against its
own parent. With the kernel's signal armed, no thread is started: a forkserver must stay
single-threaded, since forking a process with threads can deadlock the child (Python 3.12 warns of it).
The step is killed, not interrupted: it is then in the same state as a step whose whole process
group was killed, which extraction resumes exactly once and the reaper (`recovery.py`) cleans up
after, and a process that ignores or is too busy for SIGINT still stops within a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

RUN_WORKER_ENV = "DFLASH_RUN_WORKER_PID"
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_armed_against: int | None = None
_fork_hook = False


@contextlib.contextmanager
def run_worker_environment() -> Iterator[None]:
    """While the block runs, processes this one starts know it as their run worker."""
    previous = os.environ.get(RUN_WORKER_ENV)
    os.environ[RUN_WORKER_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_WORKER_ENV, None)
        else:
            os.environ[RUN_WORKER_ENV] = previous


def arm_if_started_by_a_run_worker() -> bool:
    """Arm the watchdog when this process's parent is the run worker named in the environment."""
    run_worker = os.environ.get(RUN_WORKER_ENV, "")
    if not run_worker.isdigit() or int(run_worker) != os.getppid():
        return False
    arm(os.getppid())
    return True


def arm(parent_pid: int, *, use_prctl: bool = True) -> None:
    """Kill this process as soon as `parent_pid` stops being its parent (it died)."""
    global _armed_against, _fork_hook
    if _armed_against == parent_pid:
        return
    _armed_against = parent_pid
    signalled = use_prctl and _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # died before the signal was armed
        _die()
    if not signalled:
        threading.Thread(target=_watch, args=(parent_pid,), name="dflash-parent-watch", daemon=True).start()
    if not _fork_hook and hasattr(os, "register_at_fork"):
        _fork_hook = True
        os.register_at_fork(after_in_child=_rearm_after_fork)


def _rearm_after_fork() -> None:
    global _armed_against
    _armed_against = None
    arm(os.getppid())


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # the polling thread still stops it


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
