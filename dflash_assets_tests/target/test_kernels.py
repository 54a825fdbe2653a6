"""Which kernel path a target runs on, and the warning for a CUDA run of a hybrid target on the fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_assets.target.kernels import FALLBACK, fallback_warning, kernel_paths, report_kernel_paths
from dflash_assets_tests.support.targets import tiny_dense, tiny_hybrid


def fast_kernels_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


@pytest.mark.skipif(fast_kernels_installed(), reason="flash-linear-attention is installed here")
def test_a_hybrid_target_without_the_kernel_packages_reports_the_fallback_and_warns_only_on_cuda():
    paths = kernel_paths(tiny_hybrid())
    assert paths.hybrid and paths.gated_delta_net_layers == 3
    assert paths.linear_attention["chunk_gated_delta_rule"] == FALLBACK
    assert "chunk_gated_delta_rule" in paths.fallbacks
    message = fallback_warning(paths, "cuda:0")
    assert (
        message is not None and "flash-linear-attention" in message and "pip install -e '.[gpu]'" in message
    )
    assert fallback_warning(paths, "cpu") is None


def test_a_dense_target_has_no_linear_attention_kernels_and_no_warning():
    paths = kernel_paths(tiny_dense())
    assert not paths.hybrid and paths.linear_attention == {}
    assert fallback_warning(paths, "cuda:0") is None
    assert "qwen3" in paths.describe()


def test_the_report_logs_the_path_and_sends_the_warning_to_warn():
    logs, warnings = [], []
    report_kernel_paths(tiny_hybrid(), "cuda:3", log=logs.append, warn=warnings.append)
    assert logs and "gated-delta-net" in logs[0] and logs[0].startswith("cuda:3")
    if not fast_kernels_installed():
        assert len(warnings) == 1 and "cuda:3" in warnings[0]


@pytest.mark.slow  # a fresh Python process
def test_installed_flash_linear_attention_is_what_transformers_picks_and_what_is_reported(tmp_path: Path):
    # A stand-in `fla` package on the path (same module layout and function signature as the real one):
    # transformers must route the gated-delta rule to it at import, and the report must say so.
    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                       output_final_state=False, use_qk_l2norm_in_kernel=False,
                                       cu_seqlens=None):
                raise NotImplementedError("stand-in")

            def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                                 output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                 cu_seqlens=None):
                raise NotImplementedError("stand-in")
            """
        )
    )
    code = textwrap.dedent(
        """
        from dflash_assets.target.kernels import kernel_paths
        from dflash_assets_tests.support.targets import tiny_hybrid
        print(kernel_paths(tiny_hybrid()).linear_attention["chunk_gated_delta_rule"])
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "flash-linear-attention"
