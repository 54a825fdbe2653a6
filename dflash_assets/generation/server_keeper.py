"""Keeps an inference server's whole process tree tied to the step that started it:
`python -m dflash_assets.generation.server_keeper COMMAND...`.

vLLM's OpenAI server is a process tree (the API server, its engine core, compile workers). The step
starts this keeper in a session of its own, so a signal to the step's process group never kills the keeper
before it has cleaned up; the keeper starts the server as the leader of another process group and, when
any of these happens, stops that whole group (SIGTERM, then SIGKILL past a grace):

- the step asks (SIGTERM or SIGINT to the keeper: the range ended, failed or was cancelled);
- the step dies, however it died (`kill -9` of the step alone or of its process group): the kernel sends
  the keeper SIGTERM (`prctl(PR_SET_PDEATHSIG)`), and a check twice a second that its parent is still
  the one it started with covers a kernel that does not;
- the server exits by itself: the keeper exits with its status.

The server's output goes where the keeper's goes (the step reads it). Standard library only: it runs
before, and without, anything the server's environment holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parent_death_signal(signum: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def _server_child() -> None:
    """In the server's process, before it runs: killed outright if the keeper itself is killed."""
    _parent_death_signal(signal.SIGKILL)


def stop_group(process: subprocess.Popen, grace_s: float = GRACE_S) -> int:
    """SIGTERM to the server's whole process group, SIGKILL to what is left after `grace_s`."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(process.pid):
                return process.returncode
            time.sleep(0.1)
    return process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m dflash_assets.generation.server_keeper COMMAND...", file=sys.stderr)
        return 2
    parent = os.getppid()
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent or parent == 1:  # the step died before the signal was armed
        return 1
    stopping = []

    def stop(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    server = subprocess.Popen(command, process_group=0, preexec_fn=_server_child)  # noqa: PLW1509
    try:
        _say(f"server_keeper: server pid {server.pid} started")
        while not stopping and os.getppid() == parent:
            if server.poll() is not None:
                # The server ended by itself; anything it left in its group goes with it.
                stop_group(server, grace_s=2.0)
                return server.returncode
            time.sleep(POLL_S)
        _say(f"server_keeper: stopping the server ({'asked to' if stopping else 'its step died'})")
    finally:
        # However this loop ends (a dead step's pipe breaks the first print), the group goes.
        stop_group(server)
    return 0


def _say(line: str) -> None:
    """A line to the step; nobody may be reading any more (a killed step's pipe), which is no error."""
    with contextlib.suppress(OSError, ValueError):
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
