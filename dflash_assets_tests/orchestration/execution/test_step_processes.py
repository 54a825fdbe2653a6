"""How the local engine starts step processes: from a forkserver that has imported what steps import,
which must never initialise CUDA (the steps forked from it could not use it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dflash_assets.orchestration.execution.executor import STEP_PRELOAD, with_forkserver_steps

# Records every call of torch's functions that count or initialise CUDA devices, then imports `module`.
_CUDA_CALLS = textwrap.dedent(
    """
    import json, sys
    import torch
    calls = []
    def recording(owner, name):
        original = getattr(owner, name)
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        setattr(owner, name, wrapper)
    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
        recording(torch.cuda, name)
    for name in ("_cuda_getDeviceCount", "_cuda_init"):
        if hasattr(torch._C, name):
            recording(torch._C, name)
    for module in sys.argv[1:]:
        __import__(module)
    during_import = list(calls)
    torch.cuda.is_available()  # the recording itself works
    initialised = torch.cuda.is_initialized()
    print(json.dumps({"during_import": during_import, "after": calls, "initialised": initialised}))
    """
)


def _cuda_calls(*modules: str, path: Path | None = None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_CALLS, *modules], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_what_the_forkserver_preloads_initialises_no_cuda():
    found = _cuda_calls(*STEP_PRELOAD)
    assert found["during_import"] == [] and not found["initialised"]
    assert "is_available" in found["after"]  # a call would have been seen


def test_a_module_that_counts_devices_when_imported_is_caught(tmp_path):
    # What the check above would see if a stage counted devices at import (`available_devices()`).
    (tmp_path / "counts_devices.py").write_text(
        "from dflash_assets.target.devices import available_devices\nDEVICES = available_devices()\n"
    )
    found = _cuda_calls("counts_devices", path=tmp_path)
    assert "is_available" in found["during_import"]


def test_a_run_starts_its_steps_from_the_preloaded_forkserver_unless_it_chose_otherwise():
    defaults = {"multiprocess": {"max_concurrent": None, "retries": {"enabled": {}}}}
    chosen = with_forkserver_steps(defaults)["multiprocess"]
    assert chosen["start_method"] == {"forkserver": {"preload_modules": list(STEP_PRELOAD)}}
    assert chosen["retries"] == {"enabled": {}}
    spawn = {"multiprocess": {"start_method": {"spawn": {}}}}
    assert with_forkserver_steps(spawn) == spawn
    in_process = {"in_process": {"retries": {"enabled": {}}}}
    assert with_forkserver_steps(in_process) == in_process
