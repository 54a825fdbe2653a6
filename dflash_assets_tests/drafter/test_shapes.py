"""The drafter's shape presets at the real widths users train at (no weights needed: the model is built on
the meta device), against the published drafters' shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig, drafter_shape
from dflash_assets.drafter.model import DFlashDrafter, drafter_parameter_count

# The text configs of the seeds' target and of a dense Qwen3-8B, as their config.json files give them.
QWEN3_6_27B = {
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "rope_theta": 10_000_000,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1_000_000,
}


def target_dir(tmp_path: Path, text_config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(text_config))
    return tmp_path


def test_the_dflash_preset_is_the_published_32_by_8_heads_of_128_at_a_real_width():
    shape = drafter_shape(QWEN3_8B, "dflash", num_layers=5)
    assert (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (32, 8, 128)
    assert shape["layer_types"] == ["full_attention"] * 5 and shape["sliding_window"] is None
    assert shape["intermediate_size"] == 12288  # the target's MLP width
    assert drafter_shape(QWEN3_8B, "auto", num_layers=5) == shape


def test_the_swa_preset_is_four_sliding_window_layers_then_one_full_layer():
    shape = drafter_shape(QWEN3_6_27B, "dflash-swa", num_layers=5)
    assert (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (32, 8, 128)
    assert shape["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert shape["sliding_window"] == 2048


def test_the_target_shape_is_only_taken_when_asked_for():
    shape = drafter_shape(QWEN3_6_27B, "target", num_layers=5)
    assert (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (24, 4, 256)
    with pytest.raises(ValueError, match="unknown drafter shape 'wide'.*DFLASH_DRAFTER_SHAPE"):
        drafter_shape(QWEN3_6_27B, "wide", num_layers=5)


@pytest.mark.parametrize("shape", ["dflash", "dflash-swa"])
def test_a_drafter_for_the_27b_target_reads_the_seeds_layers_and_builds_with_the_reference_names(
    tmp_path, shape
):
    config = DrafterConfig.from_target(target_dir(tmp_path, QWEN3_6_27B), mask_token_id=248070, shape=shape)
    assert config.target_layer_ids == [1, 16, 31, 46, 61] and config.target_num_hidden_layers == 64
    assert config.mask_token_id == 248070

    with torch.device("meta"):
        embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        lm_head = torch.empty(config.vocab_size, config.hidden_size)
        drafter = DFlashDrafter(config, embedding.weight, lm_head)
    names = dict(drafter.state_dict())
    assert names["fc.weight"].shape == (5120, 5 * 5120)  # the context projection of 5 target layers
    assert names["layers.0.self_attn.q_proj.weight"].shape == (32 * 128, 5120)
    assert names["layers.0.self_attn.k_proj.weight"].shape == (8 * 128, 5120)
    assert names["layers.4.mlp.down_proj.weight"].shape == (5120, 17408)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(names)
    own = sum(t.numel() for n, t in names.items())
    assert own == drafter_parameter_count(
        config
    )  # what the export holds: embedding and head are the target's
    assert 1.5e9 < own < 2.0e9  # the issue's ~1.7 B parameters for the 27B target
