"""What a step does with a torch.distributed launcher it starts, for training's ranks and a split target's
alike: wait until the devices its ranks lease are free (saying whom for), pass the launcher's output
through to the step's log keeping its last lines, and stop it (its ranks die with it)."""

from __future__ import annotations

import collections
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

STOP_GRACE_S = 30.0
REMIND_EVERY_S = 300.0


def wait_for_free_devices(
    devices: Sequence[str],
    lock_dir: str | Path,
    needed: int,
    *,
    where: str,
    status: Callable[[str], None],
    log: Callable[[str], None],
    poll_s: float = 2.0,
) -> None:
    """Return once `needed` of `devices` are free, saying on the run's status (and in the log, every 5
    minutes) how many are and who holds the rest. The caller checks first that `devices` could ever do."""
    from dflash_assets.target.devices import free_devices

    waiting_since, reminded = time.monotonic(), 0.0
    while True:
        free, held = free_devices(devices, lock_dir)
        if len(free) >= needed:
            return
        waited = time.monotonic() - waiting_since
        text = f"waiting for {needed} free devices{where}: {len(free)} free, held: " + "; ".join(held)
        status(text)
        if waited >= reminded:
            log(f"{text} ({waited:.0f} s so far)")
            reminded = waited + REMIND_EVERY_S
        time.sleep(poll_s)


class LauncherOutput:
    """The launcher's output, passed through to this process's stderr (the step's compute logs), its last
    lines kept for a failure message."""

    def __init__(self, stream, name: str) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=60)
        self._thread = threading.Thread(target=self._pump, args=(stream,), name=name, daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in iter(stream.readline, ""):
            sys.stderr.write(line)
            sys.stderr.flush()
            self.lines.append(line.rstrip())

    def join(self) -> None:
        self._thread.join(timeout=5)


def stop_launcher(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (the agent stops its ranks), then SIGKILL past the grace."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
