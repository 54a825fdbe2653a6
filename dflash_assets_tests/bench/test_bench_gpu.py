"""`dflash-assets bench --gpu --tiny`: the GPU benchmark's code, at tiny shapes, on this machine."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dflash_assets import cli
from dflash_assets.bench.gpu import TINY_SHAPES, VARIANTS, build_random_target
from dflash_assets.planning.capacity import PlanSettings, TargetFacts, extraction_rate
from dflash_assets.planning.gpu_result import load_gpu_result
from dflash_assets.planning.inputs import device_profile
from dflash_assets.planning.training_split import drafter_rate
from dflash_assets.target.flops import forward_flops


@pytest.mark.slow  # launches the tensor-parallel rows' ranks: processes of their own
def test_the_one_command_runs_every_variant_on_both_tiny_targets_and_prints_the_ratios(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("DFLASH_PEAK_TFLOPS", "1")  # a made-up peak, so the MFU column is exercised
    saved = tmp_path / "gpu-bench.json"
    args = ["bench", "--gpu", "--tiny", "--tokens", "150", "--rounds", "1", "--result", str(saved)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for shape in TINY_SHAPES:
        assert shape.name in out
    assert out.count("extraction with writes / forward alone:") == 2
    assert out.count("extraction with writes, fp8 / bf16:") == 2
    assert out.count("capture, ours / anchors' way:") == 2
    # What the plan reads back: every variant's rate, MFU and FLOPs per token, for both targets.
    result = load_gpu_result(saved)
    assert result["device"] == "CPU" and [t["shape"] for t in result["targets"]] == [
        s.name for s in TINY_SHAPES
    ]
    for target in result["targets"]:
        assert (
            set(target["tokens_per_s"]) == set(VARIANTS) and target["flops_per_token"]["extraction_fp8"] > 0
        )
        assert target["mfu"]["extraction"] > 0
    # Planning on this machine's CPU, the plan takes its extraction rate from the saved measurement.
    profile = device_profile(
        device_name=None, device_memory_bytes=None, gpu_result=result, configured_devices=[]
    )
    hybrid = result["targets"][1]
    facts = TargetFacts(tmp_path, "t", [1, 3], 64, "qwen3_5_text", hybrid["flops_per_token"]["extraction"], 0)
    settings = PlanSettings("bf16", 1024, 2**30, tmp_path, str(tmp_path), devices=1)
    rate, source = extraction_rate(facts, profile, settings, result)
    assert rate == pytest.approx(hybrid["tokens_per_s"]["extraction"]) and "bench --gpu" in source
    # The drafter step too: the training split's drafter rate, scaled by FLOPs per token.
    step = result["drafter_step"]
    assert step["backend"] == "materialised" and step["tokens_per_s"] > 0
    rate, source = drafter_rate(2 * step["flops_per_token"], profile, result)
    assert rate == pytest.approx(step["tokens_per_s"] / 2) and "bench --gpu" in source
    assert "gated-delta-net layers" in out  # the hybrid's kernel path
    # The target split over devices: k = 1 and 2 gloo ranks on the CPU, each row measured and saved.
    assert f"{TINY_SHAPES[1].name} split over devices" in out
    split_rows = re.findall(
        r"^  target over (\d) devices? +([\d,]+) tokens/s +([\d.]+)x one device$", out, re.M
    )
    assert [int(k) for k, _, _ in split_rows] == [1, 2] and all(
        float(r.replace(",", "")) > 0 for _, r, _ in split_rows
    )
    assert [row["tp"] for row in result["tensor_parallel"]] == [1, 2]
    assert result["tensor_parallel"][0]["vs_one_device"] == 1.0
    targets, drafter = out.split("drafter training step")
    table_rows = [line for line in targets.splitlines() if "tokens/s" not in line and "%" in line]
    assert len(table_rows) == 2 * len(VARIANTS)  # every variant of both targets has an MFU
    # The drafter step is measured, not announced: both batch sizes, with an MFU against the peak.
    steps = [line for line in drafter.splitlines() if "s/step" in line]
    dflash = [line for line in steps if "materialised" in line]
    assert len(dflash) == 2 and all("MFU" in line and "%" in line for line in dflash)
    # DFlash2 beside it, at the first batch size, with the selector's and the convolutions' share.
    (dflash2,) = [line for line in steps if "dflash2" in line]
    # (Timed at toy shapes on a shared machine, the shares are noise-sized, either sign: only printed.)
    shares = re.search(
        r"([\d.]+)x DFlash's step; of it the selector (-?\d+)% and the convolutions (-?\d+)%", dflash2
    )
    assert shares and float(shares.group(1)) > 0, dflash2
    # Training scaling trains through the step's own path on what runs here: one rank, in this process
    # (the CPU row, `bench --only scaling`, launches two).
    _, scaling = drafter.split("training scaling, tiny dense (qwen3) target")
    one_rank = re.search(r"^  1 rank\(s\): ([\d.]+) samples/s, ([\d,]+) tokens/s .*$", scaling, re.M)
    assert one_rank and float(one_rank.group(1)) > 0 and "world size 1 on cpu:0" in one_rank.group(0)
    assert "one device visible (cpu:0): no multi-rank figure" in scaling


def test_model_flops_grow_with_depth_and_the_lm_head_adds_two_flops_per_weight_per_token():
    model = build_random_target(TINY_SHAPES[1], torch.device("cpu"))
    lengths = [10, 30]
    early = forward_flops(model, lengths, 1, lm_head=False)
    full = forward_flops(model, lengths, None, lm_head=False)
    with_head = forward_flops(model, lengths, None, lm_head=True)
    assert 0 < early < full
    head = model.get_output_embeddings().weight.numel()
    assert math.isclose(with_head - full, 2 * sum(lengths) * head)


def test_the_real_shapes_need_a_gpu_and_say_how_to_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="--gpu --tiny"):
        cli.main(["bench", "--gpu"])
