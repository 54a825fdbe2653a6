"""The export is the published DFlash layout: an independent reader loads it and drafts what we trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import export_drafter, load_drafter
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets_tests.support.drafter_fixtures import MASK_TOKEN_ID, tiny_drafter_config
from dflash_assets_tests.support.reference_dflash import ReferenceDrafter


def trained_like(config: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Weights far from initialisation (as after training), so every tensor shapes the drafts."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(noise * 0.15 + 1.0 if parameter.ndim == 1 else noise * 0.15)
    return drafter.eval()


def reference_names_and_shapes(config_json: dict) -> dict[str, tuple[int, ...]]:
    """Every weight a reference loader fills, with its shape, from the config alone."""
    hidden, heads = config_json["hidden_size"], config_json["num_attention_heads"]
    kv, head_dim = config_json["num_key_value_heads"], config_json["head_dim"]
    mlp = config_json["intermediate_size"]
    context = len(config_json["dflash_config"]["target_layer_ids"]) * hidden
    shapes = {"fc.weight": (hidden, context), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(config_json["num_hidden_layers"]):
        layer = f"layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv * head_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv * head_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer}.self_attn.q_norm.weight": (head_dim,),
            f"{layer}.self_attn.k_norm.weight": (head_dim,),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (mlp, hidden),
            f"{layer}.mlp.up_proj.weight": (mlp, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, mlp),
        }
    return shapes


def test_an_export_holds_every_reference_weight_in_bf16_with_a_config_the_engines_read(
    target_dir: Path, tmp_path: Path
) -> None:
    config = tiny_drafter_config(target_dir)
    export_drafter(trained_like(config), tmp_path, model_card="# card\n")

    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 16 and raw["num_target_layers"] == 8  # the target's depth
    assert raw["dflash_config"]["target_layer_ids"] == config.target_layer_ids
    assert raw["dflash_config"]["mask_token_id"] == MASK_TOKEN_ID
    hf = Qwen3Config.from_pretrained(tmp_path)  # what z-lab/dflash and vLLM build the drafter from
    assert (hf.num_hidden_layers, hf.head_dim, hf.layer_types) == (2, config.head_dim, config.layer_types)

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        stored = {
            name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
            for name in handle.keys()  # noqa: SIM118 (not a dict)
        }
    expected = reference_names_and_shapes(raw)
    assert {name: shape for name, (shape, _) in stored.items()} == expected
    assert {dtype for _, dtype in stored.values()} == {"BF16"}
    assert (tmp_path / "README.md").read_text() == "# card\n"


def target_context(target: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The target's layers for every position, as an engine captures them ([L, K, H], bf16)."""
    with torch.no_grad():
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    return torch.stack([states[i + 1][0] for i in layer_ids], dim=1).to(torch.bfloat16)


@pytest.mark.parametrize("window", [None, 12])
def test_the_reference_reader_drafts_what_the_trained_drafter_drafts(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path, window: int | None
) -> None:
    config = tiny_drafter_config(target_dir)
    if window is not None:  # the Qwen3.6 pattern: sliding layers, then a full one; a window the
        # 30-token context exceeds, so the window really cuts
        layer_types = ["sliding_attention", "full_attention"]
        config = DrafterConfig(**{**config.__dict__, "layer_types": layer_types, "sliding_window": window})
    drafter = trained_like(config, seed=3)
    export_drafter(drafter, tmp_path)
    reference = ReferenceDrafter(tmp_path)
    reloaded = load_drafter(tmp_path, target_model=target_dir)

    ids = torch.randint(0, MASK_TOKEN_ID, (31,), generator=torch.Generator().manual_seed(5))
    context, anchor = target_context(target, ids[:-1], config.target_layer_ids), int(ids[-1])
    expected = reference.draft_logits(context, anchor, target.get_input_embeddings(), target.lm_head)

    def our_logits(model: DFlashDrafter) -> torch.Tensor:
        size = config.block_size
        block = torch.full((1, 1, size), config.mask_token_id)
        block[0, 0, 0] = anchor
        with torch.no_grad():
            hidden = model(
                block, (30 + torch.arange(size)).view(1, 1, size), context[None], torch.arange(30)[None],
                torch.tensor([[30]]),
            )  # fmt: skip
        return model.logits(hidden[0, 0, 1:])

    # The reloaded weights are the trained ones rounded to bf16: the same function, read independently.
    torch.testing.assert_close(our_logits(reloaded), expected, rtol=1e-4, atol=1e-4)
    # Against the float32 weights training ended with: only bf16 rounding apart.
    trained = our_logits(drafter)
    assert (trained - expected).abs().max() < 0.05 * expected.abs().max()
    assert (trained.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
    assert torch.equal(reloaded.draft_block(context, anchor), expected.argmax(-1))


def test_the_model_card_names_the_target_layers_metrics_and_how_to_serve(target_dir: Path) -> None:
    from dflash_assets.drafter.model_card import drafter_model_card

    config = tiny_drafter_config(target_dir)
    card = drafter_model_card(
        config,
        run="r1",
        target_model_name="tiny",
        trained_sample_ranges=["00000000-00000099"],
        partitions=["00000000-00000099"],
        steps=12,
        metrics={"acceptance_length_tau": 2.5, "baseline_acceptance_length_tau": 1.0, "loss": 3.2},
    )
    assert "`tiny`" in card and str(config.target_layer_ids) in card and "00000000-00000099" in card
    assert "2.500" in card and "1.000" in card
    assert "sglang.launch_server" in card and "vllm serve" in card and '"method": "dflash"' in card


def test_the_model_card_says_whose_answers_the_drafter_learned():
    from dflash_assets.drafter.model_card import describe_data_source

    regenerated = describe_data_source(
        {
            "completions": "target",
            "regenerated_by": "Qwen3.6-27B@0123abcd",
            "generation": {
                "temperature": 0.0,
                "max_new_tokens": 2048,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        }
    )
    assert regenerated == (
        "every answer regenerated by the target `Qwen3.6-27B@0123abcd` itself (greedy, at most 2048 new "
        'tokens, chat template {"enable_thinking": false})'
    )
    assert "not regenerated" in describe_data_source({"completions": "dataset"})
    assert "not regenerated" in describe_data_source(None)
    assert "some ranges" in describe_data_source({"completions": "mixed"})


def with_target_config(target_dir: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the tiny target whose config.json has `changes` (its weights linked, not copied)."""
    copy = tmp_path / "target"
    copy.mkdir()
    for item in target_dir.iterdir():
        (copy / item.name).symlink_to(item)
    (copy / "config.json").unlink()
    raw = json.loads((target_dir / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, **changes}))
    return copy


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_an_export_reaches_the_targets_context_with_its_rotary_scaling(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path
) -> None:
    # A YaRN-extended target of 131,072 positions (Qwen3's long-context recipe): vLLM refuses a drafter
    # whose max_position_embeddings is below the target's, and a drafter rotating positions otherwise
    # than its training did drafts something else.
    long_target = with_target_config(
        target_dir,
        tmp_path,
        max_position_embeddings=131072,
        rope_parameters={**YARN, "rope_theta": 5e6, "partial_rotary_factor": 0.25},
    )
    config = tiny_drafter_config(long_target)
    export = tmp_path / "drafter"
    export_drafter(trained_like(config, seed=4), export)

    raw = json.loads((export / "config.json").read_text())
    assert raw["max_position_embeddings"] == 131072
    assert raw["rope_parameters"] == {**YARN, "rope_theta": 5e6}  # the drafter rotates its whole head
    assert raw["rope_scaling"]["type"] == "yarn" and raw["rope_theta"] == 5e6
    hf = Qwen3Config.from_pretrained(export)
    assert hf.max_position_embeddings == 131072 and hf.rope_parameters["rope_type"] == "yarn"
    assert DrafterConfig.load(export) == config

    # transformers' own YaRN rotary (the reference reader's) drafts what ours drafts, far past the
    # original 32,768 positions.
    reference, reloaded = ReferenceDrafter(export), load_drafter(export, target_model=long_target)
    ids = torch.randint(0, MASK_TOKEN_ID, (21,), generator=torch.Generator().manual_seed(6))
    context = target_context(target, ids[:-1], config.target_layer_ids)
    start = 100_000
    expected = reference.draft_logits(
        context, int(ids[-1]), target.get_input_embeddings(), target.lm_head, start=start
    )
    size = config.block_size
    block = torch.full((1, 1, size), config.mask_token_id)
    block[0, 0, 0] = int(ids[-1])
    with torch.no_grad():
        hidden = reloaded(
            block, (start + 20 + torch.arange(size)).view(1, 1, size), context[None],
            (start + torch.arange(20))[None], torch.tensor([[start + 20]]),
        )  # fmt: skip
    torch.testing.assert_close(reloaded.logits(hidden[0, 0, 1:]), expected, rtol=1e-4, atol=1e-4)
    plain = DrafterConfig(**{**config.__dict__, "rope_scaling": None})
    assert not torch.equal(
        DFlashDrafter(plain, reloaded.embed_weight, reloaded.lm_head_weight).rotary[0], reloaded.rotary[0]
    )


def test_a_target_without_a_stated_context_or_scaling_gives_the_plain_rotary_at_its_theta(
    target_dir: Path, tmp_path: Path
) -> None:
    qwen35 = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1]}
    config = tiny_drafter_config(with_target_config(target_dir, tmp_path, rope_parameters=qwen35))
    assert (config.rope_theta, config.rope_scaling) == (1e7, None)
    assert config.to_reference_dict()["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert "rope_scaling" not in config.to_reference_dict()


def test_the_model_card_states_the_context_and_a_sliding_layers_window(target_dir: Path) -> None:
    from dflash_assets.drafter.model_card import drafter_model_card

    base = tiny_drafter_config(target_dir)
    sliding = DrafterConfig(
        **{**base.__dict__, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048}
    )
    card = drafter_model_card(
        sliding, run="r", target_model_name="t", trained_sample_ranges=[], partitions=[], steps=1, metrics={}
    )
    context = next(line for line in card.splitlines() if line.startswith("| context |"))
    assert f"max_position_embeddings {base.max_position_embeddings:,}" in context
    assert "sliding window 2,048 tokens: layers [0] see only the last 2,048 positions" in context
    plain = drafter_model_card(
        base, run="r", target_model_name="t", trained_sample_ranges=[], partitions=[], steps=1, metrics={}
    )
    assert "sliding window" not in plain


def test_the_model_card_gives_tau_per_prompt_length_and_calls_a_bucket_of_few_prompts_too_few(
    target_dir: Path,
) -> None:
    from dflash_assets.drafter.model_card import drafter_model_card
    from dflash_assets.drafter.speculative import by_context_length

    buckets = by_context_length([(100, 10, 31), (150, 10, 29), (200, 10, 30), (250, 10, 30), (9000, 8, 12)])
    card = drafter_model_card(
        tiny_drafter_config(target_dir), run="r", target_model_name="t", trained_sample_ranges=[],
        partitions=[], steps=1, metrics={"acceptance_length_tau": 2.5, "tau_by_context_length": buckets},
    )  # fmt: skip
    assert "| tau measured on prompts of < 2K tokens | 3.000 (4 prompts) |" in card
    few = "1.500 (1 prompt: too few to mean anything, fewer than 4) |"
    assert f"| tau measured on prompts of 8K-32K tokens | {few}" in card
