"""A target over several devices, in the core: which targets can be split and how, loading straight onto
devices, and two real ranks (gloo, torch.distributed's launcher) capturing what one process captures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.target.model import layer_split_device_map, load_target_model
from dflash_assets.target.tensor_parallel import (
    TensorParallelUnsupported,
    check_tensor_parallel,
    read_config,
    valid_tp_sizes,
)


def test_the_demo_targets_heads_allow_two_devices_and_four_is_refused_naming_the_choices(demo_model_dir):
    config = read_config(demo_model_dir)  # 4 query heads, 2 key/value heads
    assert valid_tp_sizes(config, limit=8) == [1, 2]
    check_tensor_parallel(config, 2, stage="capture")
    with pytest.raises(TensorParallelUnsupported) as error:
        check_tensor_parallel(config, 4, stage="capture")
    assert "DFLASH_TARGET_TP=4 does not divide" in str(error.value)
    assert "num_key_value_heads=2" in str(error.value) and "Choose one of 1, 2" in str(error.value)


@pytest.mark.parametrize(
    ("stage", "instead"),
    [("capture", "DFLASH_TARGET_TP=1"), ("regeneration", "DFLASH_GENERATE_URL")],
)
def test_a_family_without_a_plan_is_refused_naming_its_model_type_and_what_to_do(tmp_path, stage, instead):
    from transformers import GPT2Config

    GPT2Config(n_layer=8, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(TensorParallelUnsupported) as error:
        check_tensor_parallel(read_config(tmp_path), 2, stage=stage)
    message = str(error.value)
    assert "no tensor-parallel plan for model type 'gpt2'" in message and instead in message
    check_tensor_parallel(read_config(tmp_path), 1, stage=stage)  # one device needs no plan


def test_a_replica_over_several_devices_splits_its_layers_in_contiguous_blocks(demo_model_dir):
    devices = [torch.device(f"cuda:{i}") for i in range(5)]
    device_map = layer_split_device_map(demo_model_dir, devices)
    layers = [device_map[f"model.layers.{i}"] for i in range(12)]
    assert layers == ["cuda:0"] * 3 + ["cuda:1"] * 3 + ["cuda:2"] * 2 + ["cuda:3"] * 2 + ["cuda:4"] * 2
    others = {name: device for name, device in device_map.items() if ".layers." not in name}
    assert others == {
        "model.embed_tokens": "cuda:0",
        "model.norm": "cuda:0",
        "model.rotary_emb": "cuda:0",
        "lm_head": "cuda:0",
    }


def test_a_target_is_placed_on_its_device_as_its_weights_are_read(demo_model_dir, monkeypatch):
    """Not loaded into host memory and moved after: eight ranks of one host would each hold the whole
    target there. transformers places each tensor as it reads it when given a `device_map`."""
    from transformers import AutoModelForCausalLM

    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    load_target_model(demo_model_dir, "cpu:1")
    assert calls[-1]["device_map"] == torch.device("cpu")


def test_a_target_loads_onto_its_device_and_a_cpu_replica_over_two_leases_is_the_same_model(demo_model_dir):
    one = load_target_model(demo_model_dir, "cpu:0")
    two = load_target_model(demo_model_dir, ["cpu:0", "cpu:1"])  # both leases are the one CPU
    assert {p.device.type for p in one.parameters()} == {"cpu"} and not hasattr(two, "hf_device_map")
    ids = torch.randint(0, 1000, (2, 17))
    mask = torch.ones_like(ids)
    layers = [1, 3, 5]
    torch.testing.assert_close(
        HiddenStateCapture(two, layers)(ids, mask), HiddenStateCapture(one, layers)(ids, mask)
    )


RANKS_SCRIPT = """
import json, os, sys, torch
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.target.tensor_parallel import TargetGroup, is_sharded, load_target_shard
model_dir, out, layers = sys.argv[1], sys.argv[2], [1, 3, 5, 7, 9]
group = TargetGroup(torch.device("cpu"), timeout_s=60, heartbeat_s=0.2)
model = load_target_shard(model_dir, torch.device("cpu"), group.size)
assert is_sharded(model)
capture = HiddenStateCapture(model, layers)
if group.is_leader:
    group.start_heartbeat()
    ids, mask = torch.load(out + ".in.pt")
    results = []
    for rows in (slice(0, 3), slice(3, 4)):  # two forwards, the second after the followers only heard pings
        if rows.start:
            import time; time.sleep(1.0)
        group.send("capture", ids[rows], mask[rows])
        results.append(capture(ids[rows], mask[rows]))
    group.stop_followers()
    torch.save(torch.cat(results), out)
else:
    ran = group.follow({"capture": lambda ids, mask: capture(ids, mask)})
    assert ran == 2, ran
group.close()
"""


def test_capture_loads_the_target_without_its_lm_head_and_captures_the_same_layers(demo_model_dir):
    ids = torch.tensor([[5, 9, 14, 3, 7, 21, 8, 2]])
    whole = load_target_model(demo_model_dir, "cpu")
    headless = load_target_model(demo_model_dir, "cpu", lm_head=False)
    names = [name for name, _ in headless.named_parameters()]
    assert not [name for name in names if "lm_head" in name]
    assert sum(p.numel() for p in whole.parameters()) - sum(p.numel() for p in headless.parameters()) == (
        whole.config.vocab_size * whole.config.hidden_size
    )
    layers = [1, 3, 5]
    expected = HiddenStateCapture(whole, layers)(ids, torch.ones_like(ids))
    assert torch.equal(HiddenStateCapture(headless, layers)(ids, torch.ones_like(ids)), expected)


@pytest.mark.slow  # two ranks under torch.distributed's launcher
def test_two_ranks_capture_what_one_process_captures_to_float32_precision(demo_model_dir, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 1500, (4, 40))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0  # a left-padded row
    out = tmp_path / "captured.pt"
    torch.save((ids, mask), str(out) + ".in.pt")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
    ]
    result = subprocess.run(
        [*command, str(demo_model_dir), str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    split = torch.load(out)

    one = HiddenStateCapture(load_target_model(demo_model_dir, "cpu"), [1, 3, 5, 7, 9])
    whole = torch.cat([one(ids[:3], mask[:3]), one(ids[3:], mask[3:])])
    real = mask.bool()
    difference = (split - whole).abs()[real].max().item()
    print(json.dumps({"largest_float32_difference": difference}))
    torch.testing.assert_close(split[real], whole[real], atol=1e-5, rtol=1e-5)
    assert Path(str(out) + ".in.pt").exists()
