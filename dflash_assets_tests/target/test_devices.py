"""Device leases: one device per run, across separate processes, released even when a holder is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_assets.target.devices import (
    DeviceLeaseTimeout,
    available_devices,
    lease_device,
    torch_device,
    try_lease_device,
)

# A separate Python process that leases a device the way a run started from its own shell would.
HOLDER = """
import sys, time
from pathlib import Path
from dflash_assets.target.devices import lease_device
lock_dir, state = Path(sys.argv[1]), Path(sys.argv[2])

def waiting(message):
    (state / "waiting").write_text(message)

with lease_device(["cpu:0", "cpu:1"], lock_dir=lock_dir, poll_s=0.05, log=waiting) as device:
    (state / "device").write_text(device)
    while not (state / "release").exists():
        time.sleep(0.05)
"""


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Wait for an event; the timeout only bounds a hang, it asserts nothing about speed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Holder:
    def __init__(self, lock_dir: Path, state: Path):
        state.mkdir()
        self.state = state
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_dir), str(state)])

    @property
    def device(self) -> str | None:
        path = self.state / "device"
        return path.read_text() if path.exists() and path.read_text() else None

    def is_waiting(self) -> bool:
        return (self.state / "waiting").exists()

    def release(self) -> None:
        (self.state / "release").write_text("")
        assert self.process.wait(timeout=60) == 0

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)


@pytest.fixture
def holders(tmp_path):
    started: list[Holder] = []

    def start(name: str) -> Holder:
        holder = Holder(tmp_path / "locks", tmp_path / name)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        if holder.process.poll() is None:
            holder.kill()


def test_runs_lease_the_devices_dflash_devices_names_else_the_visible_ones(monkeypatch):
    from dflash_assets.orchestration.resources import DeviceLeaseResource

    monkeypatch.setenv("DFLASH_DEVICES", "cpu:0, cpu:1")
    assert DeviceLeaseResource().candidates() == ["cpu:0", "cpu:1"]
    assert DeviceLeaseResource(devices="cpu:3").candidates() == ["cpu:3"]  # run config wins
    monkeypatch.delenv("DFLASH_DEVICES")
    visible = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    assert DeviceLeaseResource().candidates() == available_devices() == visible
    monkeypatch.setenv("DFLASH_DEVICES", "gpu0")
    with pytest.raises(ValueError, match="DFLASH_DEVICES"):
        DeviceLeaseResource().candidates()


def test_cpu_lease_names_map_to_the_cpu_device():
    assert torch_device("cpu:1") == torch.device("cpu")
    assert torch_device("cpu") == torch.device("cpu")
    assert torch_device("cuda:1") == torch.device("cuda", 1)


def test_processes_leasing_at_once_get_different_devices_and_a_third_waits_for_a_release(holders):
    first, second = holders("first"), holders("second")
    wait_for(lambda: first.device and second.device, "two leases")
    assert {first.device, second.device} == {"cpu:0", "cpu:1"}

    third = holders("third")
    wait_for(third.is_waiting, "the third process to report it is waiting")
    assert third.device is None
    freed = first.device
    first.release()
    wait_for(lambda: third.device, "the third lease")
    assert third.device == freed
    second.release()
    third.release()


def test_a_sigkilled_holder_releases_its_device(holders):
    first, second = holders("first"), holders("second")
    wait_for(lambda: first.device and second.device, "two leases")
    third = holders("third")
    wait_for(third.is_waiting, "the third process to wait")
    killed_device = second.device
    second.kill()
    wait_for(lambda: third.device, "the lease of the killed process")
    assert third.device == killed_device
    first.release()
    third.release()


def test_a_lease_times_out_naming_the_holder_when_every_device_is_busy(tmp_path):
    with lease_device(["cpu:0"], lock_dir=tmp_path) as device:
        assert device == "cpu:0"
        with (
            pytest.raises(DeviceLeaseTimeout) as error,
            lease_device(["cpu:0"], lock_dir=tmp_path, timeout_s=0.2, poll_s=0.05),
        ):
            pass
        assert f"pid={os.getpid()}" in str(error.value) and "DFLASH_DEVICES" in str(error.value)
    with lease_device(["cpu:0"], lock_dir=tmp_path, timeout_s=0) as device:
        assert device == "cpu:0"


def test_the_lease_is_released_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError), lease_device(["cpu:0"], lock_dir=tmp_path):
        raise RuntimeError("run failed")
    with lease_device(["cpu:0"], lock_dir=tmp_path, timeout_s=0) as device:
        assert device == "cpu:0"


def test_a_spare_device_is_leased_only_when_one_is_free_now_and_never_waited_for(tmp_path):
    with lease_device(["cpu:0"], lock_dir=tmp_path) as held:
        started = time.monotonic()
        with try_lease_device(["cpu:0", "cpu:1"], lock_dir=tmp_path, holder="spare") as spare:
            assert held == "cpu:0" and spare == "cpu:1"
            with try_lease_device(["cpu:0", "cpu:1"], lock_dir=tmp_path) as none_left:
                assert none_left is None
        assert time.monotonic() - started < 5  # answered at once, never a wait for a release
        with try_lease_device(["cpu:1"], lock_dir=tmp_path) as released:
            assert released == "cpu:1"  # the spare was given back
    with try_lease_device([], lock_dir=tmp_path) as nothing:
        assert nothing is None
