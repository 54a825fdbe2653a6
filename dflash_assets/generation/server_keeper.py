"""Keeps an inference server's whole process tree tied to the step that started it:
`python -m dflash_assets.generation.server_keeper COMMAND...`.

vLLM's OpenAI server is a process tree (the API server, its engine core, compile workers). The step
starts this keeper in a session of its own, so a signal to the step's process group never kills the keeper
before it has cleaned up; the keeper starts the server as the leader of another process group and, when
any of these happens, stops the whole tree (SIGTERM to that group, then SIGKILL to all that is left of the
tree past a grace):

- the step asks (SIGTERM or SIGINT to the keeper: the range ended, failed or was cancelled);
- the step dies, however it died (`kill -9` of the step alone or of its process group): the kernel sends
  the keeper SIGTERM (`prctl(PR_SET_PDEATHSIG)`), and a check twice a second that its parent is still
  the one it started with covers a kernel that does not;
- the server exits by itself: what it left is stopped and the keeper exits with its status.

The keeper is its server's subreaper (`PR_SET_CHILD_SUBREAPER`): a process of the tree whose parent dies
comes to the keeper, not to the host's init. So what leaves the server's group (vLLM's data-parallel
supervisor makes a group of its own) is still found and stopped, and an orphan's exit is reaped at once,
where an init that reaps nothing (a container's first process often does not) would leave a zombie that
looks alive to a signal. The keeper is done when nothing under it is left.

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
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, int(value), 0, 0, 0)


def _parent_death_signal(signum: int) -> None:
    _prctl(_PR_SET_PDEATHSIG, signum)


def _server_child() -> None:
    """In the server's process, before it runs: killed outright if the keeper itself is killed."""
    _parent_death_signal(signal.SIGKILL)


def processes() -> dict[int, tuple[int, int, str]]:
    """Every process on this host: pid to (parent pid, process group, state letter), from /proc."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        found[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return found


def descendants(root: int, table: dict[int, tuple[int, int, str]]) -> list[int]:
    """The processes under `root` in `table` (children, theirs, and so on)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _left(server: subprocess.Popen) -> list[int]:
    """What of the server's tree still runs: the keeper's descendants and the server's group, less the
    zombies, after reaping those that are the keeper's own (orphans that came to it)."""
    server.poll()
    table = processes()
    me = os.getpid()
    for pid, (parent, _, state) in table.items():
        if parent == me and state == "Z" and pid != server.pid:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    under = set(descendants(me, table))
    group = {pid for pid, (_, pgid, _) in table.items() if pgid == server.pid}
    return sorted(pid for pid in under | group if table[pid][2] != "Z" and pid != me)


def stop_group(process: subprocess.Popen, grace_s: float = GRACE_S) -> int:
    """SIGTERM to the server's process group; SIGKILL after `grace_s` to whatever of its tree is left,
    in the group or not. Returns when nothing under the keeper runs (or 10 s after the SIGKILL)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    if _wait_empty(process, grace_s):
        return process.returncode
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in _left(process):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    _wait_empty(process, 10.0)
    return process.wait()


def _wait_empty(process: subprocess.Popen, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if not _left(process) and process.poll() is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m dflash_assets.generation.server_keeper COMMAND...", file=sys.stderr)
        return 2
    parent = os.getppid()
    _parent_death_signal(signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
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
                # The server ended by itself; anything it left goes with it.
                stop_group(server, grace_s=2.0)
                return server.returncode
            time.sleep(POLL_S)
        _say(f"server_keeper: stopping the server ({'asked to' if stopping else 'its step died'})")
    finally:
        # However this loop ends (a dead step's pipe breaks the first print), the whole tree goes.
        stop_group(server)
    return 0


def _say(line: str) -> None:
    """A line to the step; nobody may be reading any more (a killed step's pipe), which is no error."""
    with contextlib.suppress(OSError, ValueError):
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
