"""`scripts/peer_speculators.py`, the driver that trains vLLM's speculators on our hidden states: the
conventions it translates between (layer ids, the final state before and after the norm, the validation
split, z-lab's config and weights), each against a hand-computed case. Nothing here needs the speculators
venv."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_assets_tests.support.scripts import load_script


@pytest.fixture(scope="module")
def peer():
    return load_script("peer_speculators")


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the targets (and speculators' `verifier_norm`) compute it, in float32."""
    return gain * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_speculators_layer_ids_are_ours_plus_one_and_back(peer):
    assert peer.speculators_layer_ids([1, 8, 14, 20, 27]) == [2, 9, 15, 21, 28]
    assert peer.zlab_layer_ids([2, 9, 15, 21, 28]) == [1, 8, 14, 20, 27]


@pytest.mark.parametrize("gain", ["w", "1+w"])
def test_the_last_slot_normed_by_the_targets_norm_is_the_stored_final_state(peer, gain):
    torch.manual_seed(0)
    eps = 1e-5
    weight = torch.randn(64) * 2  # negative entries too: only the gain's elementwise value matters
    x = torch.randn(12, 64) * torch.logspace(-1, 2, 12)[:, None]  # the layer's output, rows at many scales
    g = weight + (1 if gain == "1+w" else 0)
    stored = rms_norm(x, g, eps)  # what the store holds: after the final norm
    slot = peer.pre_norm_state(stored, weight, gain)
    # Equal up to eps: the slot's mean square is ms / (ms + eps), ms the layer output's, and the second norm
    # adds its own eps to about 1, so a row is off by at most eps / ms + eps of itself.
    error = (rms_norm(slot, g, eps) - stored).norm(dim=-1) / stored.norm(dim=-1)
    assert (error <= eps / x.pow(2).mean(-1) + eps).all(), error
    # Fed the stored state itself, the norm would apply its gain twice.
    assert not torch.allclose(rms_norm(stored, g, eps), stored, rtol=1e-2)


def test_a_channel_the_norm_zeroes_gets_zero_not_nan(peer):
    weight = torch.tensor([1.0, 0.0, 2.0])
    slot = peer.pre_norm_state(torch.tensor([[0.5, 0.0, -1.0]]), weight, "w")
    assert slot.tolist() == [[0.5, 0.0, -0.5]]


def test_the_gain_is_one_plus_w_for_the_families_speculators_names(peer):
    assert peer.final_norm_gain({"model_type": "llama"}) == "w"
    assert peer.final_norm_gain({"model_type": "qwen3"}) == "w"
    assert peer.final_norm_gain({"model_type": "gemma3_text"}) == "1+w"
    assert (
        peer.final_norm_gain({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}})
        == "1+w"
    )


def test_the_validation_split_is_the_one_copied_row_whatever_the_count(peer):
    for rows in range(1, 20_000):
        ratio = peer.validation_ratio(rows)
        assert ratio < 1 and int((rows + 1) * ratio) == rows, rows


def test_held_out_indices_parse_as_lists_and_ranges(peer):
    assert peer.parse_indices("5, 9,120-123") == {5, 9, 120, 121, 122, 123}
    assert peer.parse_indices("") == set()


def speculators_checkpoint_config(**overrides) -> dict:
    """A DFlash2 checkpoint's config.json as speculators 0.9.0 writes it (the fields convert reads)."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "speculators_model_type": "dflash2",
        "block_size": 8,
        "aux_hidden_state_layer_ids": [2, 9, 15, 21, 28],
        "mask_token_id": 16,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
        "draft_vocab_size": 49152,
        "transformer_layer_config": {
            "model_type": "qwen3",
            "hidden_size": 576,
            "num_hidden_layers": 5,
            "layer_types": ["sliding_attention"] * 5,
            "sliding_window": 2048,
            "use_sliding_window": True,
            "vocab_size": 49152,
            "_attn_implementation": "sdpa",
            "transformers_version": "5.19.0",
        },
        **overrides,
    }


def test_zlab_config_is_the_flattened_layer_config_with_the_dflash_fields(peer):
    config = peer.zlab_config(speculators_checkpoint_config(), num_target_layers=30)
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("qwen3", 576, 5)
    assert (config["block_size"], config["num_target_layers"]) == (8, 30)
    assert config["dflash_config"] == {
        "target_layer_ids": [1, 8, 14, 20, 27], "mask_token_id": 16, "block_size": 8,
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
    }  # fmt: skip
    assert config["is_causal"] is False  # speculators' DFlash2 sliding layers see the whole block
    assert "_attn_implementation" not in config and "transformer_layer_config" not in config


def test_zlab_config_keeps_causal_sliding_layers_causal_and_refuses_anchor_drafting(peer):
    causal = peer.zlab_config(speculators_checkpoint_config(sliding_window_non_causal=False), 30)
    assert causal["is_causal"] is True
    with pytest.raises(ValueError, match="sample_from_anchor"):
        peer.zlab_config(speculators_checkpoint_config(sample_from_anchor=True), 30)


def test_zlab_weights_are_the_drafts_own(peer):
    names = [
        "layers.0.self_attn.q_proj.weight", "layers.0.attention_conv.base_kernel", "fc.weight", "norm.weight",
        "hidden_norm.weight", "candidate_selector.predecessor_codebook", "embed_tokens.weight",
        "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t",
    ]  # fmt: skip
    kept = peer.zlab_weights(dict.fromkeys(names, torch.zeros(1)))
    assert sorted(kept) == sorted(names[:6])


@pytest.mark.skipif(
    not Path("/work/speculators-venv/bin/python").exists(),
    reason="needs the speculators venv (the script's docstring)",
)
def test_the_speculators_venv_imports_its_trainer_on_a_cpu_torch():
    import subprocess

    done = subprocess.run(
        ["/work/speculators-venv/bin/python", "-c",
         "import torch; from speculators.train.cli import main; print(torch.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "+cpu" in done.stdout
