"""The OpenMP runtime torch loads after the package lets its idle threads sleep instead of spinning."""

from __future__ import annotations

import os
import subprocess
import sys


def _openmp_environment(code: str, **environment: str) -> str:
    """What torch's OpenMP runtime reports about its settings when `code` runs in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **environment)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stderr


def test_importing_the_package_before_torch_makes_openmp_threads_sleep_when_idle():
    report = _openmp_environment("import dflash_assets, torch; torch.ones(4) @ torch.ones(4)")
    assert "GOMP_SPINCOUNT = '0'" in report, report
    # Without the package, the same runtime spins (the default that stalls a busy 2-core machine).
    assert "GOMP_SPINCOUNT = '300000'" in _openmp_environment("import torch; torch.ones(4) @ torch.ones(4)")


def test_a_wait_policy_the_user_set_is_kept():
    report = _openmp_environment("import dflash_assets, torch", OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in report, report
