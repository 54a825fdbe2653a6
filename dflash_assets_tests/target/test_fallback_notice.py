"""Quiet CPU runs: transformers' "falling back to its reference PyTorch implementation because
causal_conv1d / flash-linear-attention is not installed" notice is not shown for a target running on the
CPU, and is kept for any other device and for everything else transformers logs."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from dflash_assets.target.fallback_notice import HUB_KERNELS_LOGGER, CpuKernelFallbackFilter

NOTICE = "is falling back to its reference PyTorch implementation"

# A hybrid target's forward on the CPU in a fresh process (transformers logs the notice once per process).
FORWARD = textwrap.dedent(
    """
    import logging, sys, torch
    import dflash_assets.target  # what every product path that runs a target imports
    if sys.argv[1] == "without-filter":
        logging.getLogger("transformers.integrations.hub_kernels").filters.clear()
    from dflash_assets_tests.support.drafter_fixtures import _tiny_target_config
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(_tiny_target_config(0.02)).eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    print("forward done")
    """
)


def _forward(mode: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", FORWARD, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forward done" in done.stdout
    return done


@pytest.mark.slow  # two fresh Python processes
def test_a_hybrid_target_on_the_cpu_runs_without_the_cuda_kernel_notices() -> None:
    quiet = _forward("with-filter")
    assert NOTICE not in quiet.stdout + quiet.stderr
    # The same forward without the filter shows them: the test sees what a user saw before.
    noisy = _forward("without-filter")
    assert "`chunk_gated_delta_rule` " + NOTICE in noisy.stderr
    assert "`causal_conv1d_fn` " + NOTICE in noisy.stderr


@pytest.fixture()
def kernel_log() -> Iterator[list[str]]:
    import dflash_assets.target  # noqa: F401 (installs the filter)

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    handler = Collect()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _kernel(name: str):
    """A kernel wrapped the way transformers wraps gated-delta-net kernels, for a package nobody has."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    return use_kernel_func_from_hub_with_fallback(name, "dflash_no_such_kernel_package")(lambda x: x * 2)


def test_the_notice_stays_for_a_call_on_another_device(kernel_log: list[str]) -> None:
    on_cpu, elsewhere = _kernel("dflash_probe_cpu_call"), _kernel("dflash_probe_meta_call")
    assert torch.equal(on_cpu(torch.ones(2)), torch.full((2,), 2.0))  # the fallback still runs
    elsewhere(torch.ones(2, device="meta"))  # what a CUDA tensor would be here: not the CPU
    assert not [m for m in kernel_log if "dflash_probe_cpu_call" in m]
    assert [m for m in kernel_log if "dflash_probe_meta_call" in m and NOTICE in m]


def test_the_filter_keeps_every_other_record() -> None:
    keep = CpuKernelFallbackFilter()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(HUB_KERNELS_LOGGER, logging.WARNING, __file__, 1, message, None, None)

    assert keep.filter(record("kernel hub unreachable"))
    # The notice itself, logged from outside the kernel wrapper (its device unknown): kept.
    assert keep.filter(record(f"`x` {NOTICE}"))
    assert any(isinstance(f, CpuKernelFallbackFilter) for f in logging.getLogger(HUB_KERNELS_LOGGER).filters)
