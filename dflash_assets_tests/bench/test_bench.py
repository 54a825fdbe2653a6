"""`dflash-assets bench` runs and prints its ratios (the figures themselves are read, not asserted: the
machine is shared)."""

from __future__ import annotations

import re

import pytest

from dflash_assets import cli


@pytest.mark.slow
def test_the_generation_row_compares_the_batched_engine_with_one_conversation_at_a_time(
    capsys, monkeypatch, tmp_path, demo_model_dir
):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    assert cli.main(["bench", "--quick", "--only", "generation"]) == 0
    out = capsys.readouterr().out
    ratio = re.search(
        r"^\s+([\d.]+)\s+generation tokens/s, batched in-process engine / one conversation", out, re.M
    )
    assert ratio and float(ratio.group(1)) > 0
    assert "batched answers equal the one-at-a-time answers: True" in out
