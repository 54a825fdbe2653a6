"""The training split as users meet it: `dflash-assets plan` for a node whose target weights and dataset are
elsewhere (a config-only target directory, what-if counts), and `DFLASH_TRAIN_NPROC_PER_NODE=auto` taking
the plan's split (in process: the environment is monkeypatched, nothing is launched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_assets import cli
from dflash_assets.orchestration.capacity_plan import build_plan, online_split_recommender
from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.orchestration.training import TrainConfig
from dflash_assets.storage.manifest import StoredPartition

SEEDS = ["--gpus-per-node", "8", "--device", "H200", "--samples", "914000", "--mean-tokens", "2017"]


@pytest.fixture
def config_only_27b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Qwen3.6-27B-shaped target directory holding only its config.json: no weights, no tokenizer."""
    from dflash_assets.bench.gpu import REAL_SHAPES

    config = dict(REAL_SHAPES[1].config)
    config["num_hidden_layers"] = 64
    config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
    directory = tmp_path / "qwen3.6-27b-config"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", **config}))
    monkeypatch.setenv("DFLASH_TARGET_MODEL", str(directory))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DFLASH_DATASET", str(tmp_path / "not-here.jsonl"))  # never read: both counts given
    # The seeds' node trained a DFlash drafter: their 25.1 K tokens/s is its step (a DFlash2 one costs more).
    monkeypatch.setenv("DFLASH_DRAFTER_ARCH", "dflash")
    return directory


def test_plan_prints_the_training_split_for_the_seeds_node_beside_their_seven_plus_one(
    config_only_27b, capsys
):
    assert cli.main(["plan", *SEEDS, "--online-target-devices", "7"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("training split") :]
    for row in ("target forward", "drafter step", "recommended", "alternative", "stated", "offline"):
        assert f"  {row}" in block
    assert "1 drafter rank × 7 target devices each: 8 GPUs a node, 25,100 tokens/s, 5.1 days" in block
    assert "--online-target-devices 7" in block

    assert cli.main(["plan", "--json", *SEEDS, "--online-target-devices", "7"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["samples"] == 914_000 and plan["tokens"] == 914_000 * 2017  # the what-if's counts
    split = plan["training_split"]
    assert split["gpus_per_node"] == 8 and split["tokens_to_train"] == 6 * 914_000 * 2017
    best, seeds = split["recommended"], split["stated"]
    assert (seeds["drafter_ranks"], seeds["target_devices_per_rank"], seeds["bottleneck"]) == (
        1,
        7,
        "drafter",
    )
    assert best["fits"] and best["gpus_per_node"] <= 8 and best["tokens_per_s"] > 1.9 * seeds["tokens_per_s"]
    assert best["days"] == pytest.approx(split["tokens_to_train"] / best["tokens_per_s"] / 86400)
    assert len(split["alternatives"]) == 2 and split["data_parallel"] == "DDP"
    # The seeds' rate is more than an H200's peak at this FLOP count: the plan says so.
    assert any("cannot hold there" in warning for warning in plan["warnings"])


def test_a_wrong_split_flag_is_one_line_naming_it(config_only_27b, capsys):
    assert cli.main(["plan", "--gpus-per-node", "0"]) == 2
    assert capsys.readouterr().err.strip() == "dflash-assets plan: --gpus-per-node 0 must be more than 0"
    assert cli.main(["plan", "--mean-tokens", "9000"]) == 2
    assert "DFLASH_MAX_LENGTH=8192" in capsys.readouterr().err


def test_auto_takes_the_plans_split_for_this_nodes_devices(
    demo_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASH_DEVICES", "cpu:0,cpu:1,cpu:2,cpu:3")
    monkeypatch.setenv("DFLASH_TRAIN_NPROC_PER_NODE", "auto")
    target = TargetModelResource()
    manifest = {"partition": "00000000-00000099", "tokens": 100 * 120, "sample_indices": list(range(100))}
    tokenized = [StoredPartition(None, "tokenized-completions/00000000-00000099", manifest)]
    lines: list[str] = []
    config = TrainConfig()
    recommend = online_split_recommender(target, tokenized, config.train_settings(), lines.append)

    launch, target_devices = config.launch(4, "online", recommend)
    plan = build_plan(
        store=StoreResource(),
        dataset=DatasetResource(),
        target_model=target,
        gpus_per_node=4,
        samples=100,
        mean_tokens=120,
    )
    recommended = plan.figures["training_split"]["recommended"]
    assert (launch.nproc_per_node, target_devices) == (
        recommended["drafter_ranks"],
        recommended["target_devices_per_rank"],
    )
    assert any(line.startswith("DFLASH_TRAIN_NPROC_PER_NODE=auto:") for line in lines)
    # Run config fixing one target device per rank: auto chooses how many ranks of 1 + 1 the node holds.
    launch, target_devices = TrainConfig(online_target_devices=1).launch(4, "online", recommend)
    assert (launch.nproc_per_node, target_devices) == (2, 1)
    # Offline, every device trains.
    launch, target_devices = config.launch(4, "offline", recommend)
    assert (launch.nproc_per_node, target_devices) == (4, 0)
