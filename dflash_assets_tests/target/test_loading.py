"""Loading the target without its LM head (capture never reads logits) says nothing about the head it left
out on purpose, and every other loading problem is still reported."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from dflash_assets.target.model import load_target_model


def test_a_capture_load_without_the_lm_head_prints_no_loading_report(demo_model_dir, capfd, caplog):
    load_target_model(demo_model_dir, "cpu", lm_head=False)
    printed = "".join(capfd.readouterr()) + caplog.text  # its handler, or the root logger's
    assert "LOAD REPORT" not in printed and "UNEXPECTED" not in printed


def test_a_report_that_says_more_than_the_left_out_head_is_printed_whole(
    demo_model_dir, tmp_path, capfd, caplog
):
    damaged = Path(shutil.copytree(demo_model_dir, tmp_path / "damaged"))
    weights = load_file(damaged / "model.safetensors")
    weights["model.stray.weight"] = weights["lm_head.weight"][:2].clone()  # a key no module reads
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    caplog.clear()
    load_target_model(damaged, "cpu", lm_head=False)
    printed = "".join(capfd.readouterr()) + caplog.text  # its handler, or the root logger's
    assert "LOAD REPORT" in printed and "model.stray.weight" in printed and "lm_head.weight" in printed


def test_a_whole_target_still_reports_a_missing_lm_head(demo_model_dir, tmp_path, capfd, caplog):
    headless = Path(shutil.copytree(demo_model_dir, tmp_path / "headless"))
    weights = load_file(headless / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    caplog.clear()
    load_target_model(headless, "cpu")  # the head is wanted here: its absence is news
    printed = "".join(capfd.readouterr()) + caplog.text  # its handler, or the root logger's
    assert "LOAD REPORT" in printed and "lm_head.weight" in printed and "MISSING" in printed
