"""One device per lease: an exclusive lease held as an `flock` on one lock file per device (a run whose
target spans k devices holds k of them, one per rank).

The kernel drops an flock when its holder dies (even by SIGKILL), and the lock works between any
processes on the host, including runs launched from separate shells outside Dagster's run queue.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICES_ENV = "DFLASH_DEVICES"
# The device kinds torch runs a target on; `cpu:N` names distinct leases of the one CPU.
_DEVICE_NAME = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")


class DeviceLeaseTimeout(TimeoutError):
    """No device became free within the timeout."""


def available_devices(configured: Sequence[str] = ()) -> list[str]:
    """Devices runs may lease: `configured` (the `DFLASH_DEVICES` setting) when it names any, checked;
    else every visible CUDA device; else `["cpu"]`. `cpu:0,cpu:1` simulates several devices on a
    CPU-only machine."""
    if configured:
        return [check_device_name(device) for device in configured]  # fail fast on a typo
    import torch

    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def check_device_name(device: str) -> str:
    if not _DEVICE_NAME.match(device.strip()):
        raise ValueError(
            f"device {device!r} is not a device name (expected e.g. 'cuda:0', 'cpu' or 'cpu:1'); "
            f"check {DEVICES_ENV}"
        )
    return device.strip()


def current_device(device: str | torch.device) -> contextlib.AbstractContextManager:
    """`device` as this thread's current CUDA device for the block (and back after). A thread starts on
    device 0, whatever its process set: a kernel launched without an explicit device (fused gated-delta-net
    and conv kernels, flex attention) from a thread that never set one runs on, and allocates on, GPU 0."""
    import torch

    target = torch_device(device)
    return torch.cuda.device(target) if target.type == "cuda" else contextlib.nullcontext()


def thread_on_device(device: str | torch.device) -> Callable[[], None]:
    """A thread pool's initializer that makes `device` its threads' current CUDA device."""
    import torch

    target = torch_device(device)

    def initialize() -> None:
        if target.type == "cuda":
            torch.cuda.set_device(target)

    return initialize


def torch_device(device: str | torch.device) -> torch.device:
    """The torch device for a lease name; `cpu:N` names distinct leases but all map to the CPU."""
    import torch

    if isinstance(device, torch.device):
        return device
    name = check_device_name(device)
    if name == "cpu" or name.startswith("cpu:"):
        return torch.device("cpu")
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise ValueError(
            f"device {device!r} is not a torch device name (expected e.g. 'cuda:0', 'cpu' or 'cpu:1'); "
            f"check {DEVICES_ENV}"
        ) from error


def release_cached_memory() -> None:
    """Memory back to the device before an out-of-memory retry: reference cycles collected (a failed
    forward's frames can sit in one), then the CUDA allocator's cached blocks returned. Call it after the
    `except` block of the failed attempt has ended: until then its traceback holds that attempt's frames,
    and with them every tensor they allocated, so nothing could be freed."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA was never initialised


def _lock_path(lock_dir: Path, device: str) -> Path:
    # The host name keeps leases apart when the lock directory sits on a shared home directory.
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
    return lock_dir / f"{socket.gethostname()}-{safe}.lock"


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown holder"
    except OSError:
        return "unknown holder"


def describe_holder(lock_dir: str | Path, device: str) -> str:
    """Who holds `device`'s lease, as its lock file says (diagnostics only)."""
    return _holder(_lock_path(Path(lock_dir).expanduser(), check_device_name(device)))


@contextlib.contextmanager
def lease_device(
    devices: Sequence[str] | None,
    lock_dir: str | Path,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    log: Callable[[str], None] | None = None,
    holder: str = "",
    remind_every_s: float = 300.0,
) -> Iterator[str]:
    """Hold one free device from `devices` (default `available_devices()`) for the `with` block.

    Tries every device without blocking, then sleeps and tries again until one frees up;
    `timeout_s=None` waits forever. `holder` (e.g. `run <id>`) is written into the lock file so a
    waiting run can say whom it waits for; `log` hears that when the wait starts and every
    `remind_every_s` after.
    """
    # torch is imported only to detect devices, so a lease costs little when they are given.
    candidates = [check_device_name(d) for d in devices] if devices else available_devices()
    directory = Path(lock_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waiting_since = time.monotonic()
    next_reminder = waiting_since
    while True:
        for device in candidates:
            path = _lock_path(directory, device)
            fd = _try_lock(path)
            if fd is None:
                continue
            try:
                # Diagnostics only: who holds it. The lock itself is the flock, not this text.
                os.ftruncate(fd, 0)
                who = f"{holder} " if holder else ""
                os.pwrite(
                    fd,
                    f"{who}pid={os.getpid()} host={socket.gethostname()} since={time.time():.0f}\n".encode(),
                    0,
                )
                yield device
            finally:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if deadline is not None and time.monotonic() >= deadline:
            holders = "; ".join(f"{d}: {_holder(_lock_path(directory, d))}" for d in candidates)
            raise DeviceLeaseTimeout(
                f"no free device after {timeout_s:.0f} s among {candidates} (locks in {directory}; "
                f"{holders}). Wait for a run to finish, or add devices via {DEVICES_ENV}."
            )
        if log is not None and time.monotonic() >= next_reminder:
            holders = "; ".join(f"{d}: {_holder(_lock_path(directory, d))}" for d in candidates)
            waited = time.monotonic() - waiting_since
            log(
                f"waiting for a device ({len(candidates)} busy, {waited:.0f} s so far): {holders}. "
                f"More devices: {DEVICES_ENV}."
            )
            next_reminder = time.monotonic() + remind_every_s
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


@contextlib.contextmanager
def try_lease_device(devices: Sequence[str], lock_dir: str | Path, holder: str = "") -> Iterator[str | None]:
    """Hold one of `devices` if one is free right now, else yield None: never waits (e.g. a spare
    device for a speculative evaluation that does not fit beside the drafter)."""
    with contextlib.ExitStack() as stack:
        device = None
        if devices:
            try:
                lease = lease_device(devices, lock_dir=lock_dir, timeout_s=0, holder=holder)
                device = stack.enter_context(lease)
            except DeviceLeaseTimeout:
                device = None
        yield device


def free_devices(devices: Sequence[str], lock_dir: str | Path) -> tuple[list[str], list[str]]:
    """(free, held with their holders) among `devices`, right now (nothing is kept)."""
    free, held = [], []
    for device in devices:
        with try_lease_device([device], lock_dir=lock_dir, holder="probe") as leased:
            if leased is None:
                held.append(f"{device} ({describe_holder(lock_dir, device)})")
            else:
                free.append(device)
    return free, held
