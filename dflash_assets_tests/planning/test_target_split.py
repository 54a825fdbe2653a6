"""The plan's split of the target over devices (`planning/memory.py`'s `target_split`): the smallest number
of devices each stage fits with headroom, and warnings when `DFLASH_TARGET_TP` does not fit, on a
70B-shaped target (a config-only directory: nothing is loaded) and on 80 GB cards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.planning.capacity import DeviceProfile
from dflash_assets.planning.inputs import target_facts
from dflash_assets.planning.memory import target_split
from dflash_assets.target.memory import parameter_count
from dflash_assets.training.memory import with_headroom

# A Llama/Qwen2-70B-like dense target in the qwen3 family (which has a tensor-parallel plan).
SEVENTY_B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
LAYERS = [1, 20, 39, 58, 77]
A100 = DeviceProfile("A100", "cuda", 80 * 10**9, 312e12, "data sheet")
H200 = DeviceProfile("H200", "cuda", 141 * 10**9, 989e12, "data sheet")


@pytest.fixture
def seventy_b(tmp_path: Path) -> Path:
    directory = tmp_path / "seventy-b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(SEVENTY_B))
    return directory


def _split(model_dir: Path, device: DeviceProfile, configured: int, tmp_path: Path):
    facts = target_facts(model_dir, "seventy-b@0", LAYERS, [2017], tmp_path / "cache")
    split = target_split(
        target=facts,
        device=device,
        hidden_state_dtype="bf16",
        max_tokens_per_batch=16384,
        max_length=3072,
        configured_tp=configured,
    )
    return facts, split


def test_a_70b_target_on_80_gb_cards_needs_four_devices_to_capture_and_the_configured_one_is_warned(
    seventy_b, tmp_path
):
    facts, split = _split(seventy_b, A100, 1, tmp_path)
    assert 69e9 < parameter_count(seventy_b) < 73e9  # the shape is 70B's
    assert split.sizes == [1, 2, 4, 8]  # 64 query / 8 key-value heads
    assert split.smallest == {"extraction": 4, "regeneration": 4, "online target": 4}
    for stage, k in split.smallest.items():
        by_k = split.bytes_by_tp[stage]
        assert with_headroom(by_k[k]) <= A100.total_memory_bytes
        smaller = [n for n in split.sizes if n < k]
        assert all(with_headroom(by_k[n]) > A100.total_memory_bytes for n in smaller)
    # two devices hold the bf16 weights (~131 GiB) but not with a 16 K-token forward and headroom
    assert split.bytes_by_tp["extraction"][2] > facts.weight_bytes_bf16 // 2
    assert any("extraction needs the target over 4 devices on A100" in w for w in split.warnings)
    assert any("set DFLASH_TARGET_TP=4 or `auto`" in w for w in split.warnings)


def test_auto_or_enough_devices_leave_nothing_to_warn_and_a_bigger_card_needs_fewer(seventy_b, tmp_path):
    for configured in (0, 4, 8):
        _, split = _split(seventy_b, A100, configured, tmp_path)
        assert split.warnings == [], configured
    _, auto = _split(seventy_b, A100, 0, tmp_path)
    assert auto.chosen("extraction") == 4
    _, h200 = _split(seventy_b, H200, 0, tmp_path)
    assert h200.smallest["extraction"] == 2


def test_a_count_that_does_not_divide_the_heads_is_named(seventy_b, tmp_path):
    _, split = _split(seventy_b, A100, 3, tmp_path)
    assert any(
        "DFLASH_TARGET_TP=3 does not divide the target's heads: choose one of 1, 2, 4, 8" in w
        for w in split.warnings
    )


@pytest.mark.slow  # the plan command in a process of its own
def test_the_plan_command_prints_the_split_for_a_70b_target_on_80_gb_cards(seventy_b, tmp_path):
    env = {
        **os.environ,
        "DFLASH_HOME": str(tmp_path / "home"),
        "DFLASH_TARGET_MODEL": str(seventy_b),
        "DFLASH_TARGET_TP": "2",
    }
    command = [sys.executable, "-m", "dflash_assets.cli", "plan", "--device", "H100", "--samples", "914000"]
    command += ["--mean-tokens", "2017", "--json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["target_split"]["configured"] == 2
    assert plan["target_split"]["smallest"]["extraction"] == 4
    assert (
        plan["device_memory"]["extraction"]["bytes"] == plan["target_split"]["bytes_by_tp"]["extraction"]["2"]
    )
    assert any("more than DFLASH_TARGET_TP=2" in w for w in plan["warnings"])


def test_the_training_split_counts_a_ranks_target_devices_in_whole_replicas_of_their_span():
    from dflash_assets.planning.training_split import NodeFigures, online_splits, plan_training_split
    from dflash_assets.training.memory import TrainingMemory

    training = TrainingMemory(weights=10 * 10**9, gradients=0, optimizer=0, frozen=0, activations=5 * 10**9)
    figures = NodeFigures(
        gpus_per_node=8,
        nodes=1,
        target_tokens_per_s=8_000.0,  # one device's forward; a replica over 2 devices runs at it too
        drafter_tokens_per_s=24_000.0,
        device_memory_bytes=80 * 10**9,
        target_device_bytes=40 * 10**9,  # a 70B replica's share on each of its 2 devices
        training=training,
        tokens_to_train=11e9,
        target_span=2,
    )
    splits = online_splits(figures)
    assert splits and all(
        s.target_devices_per_rank % 2 == 0 and s.target_devices_per_rank > 0 for s in splits
    )
    one_rank_six = next(s for s in splits if (s.drafter_ranks, s.target_devices_per_rank) == (1, 6))
    assert one_rank_six.tokens_per_s == 3 * 8_000.0  # three replicas of two devices each
    best = plan_training_split(figures, device_name="A100").recommended
    assert best.target_devices_per_rank % 2 == 0 and best.gpus_per_node <= 8
