"""Tiny targets of the real family for the tests, and Hugging Face's own hidden states to compare with."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LAYERS = 10
TINY_VOCAB = 500
# Batched vs alone, after the bf16 cast. fp32 forwards of different batch shapes differ by ~1e-8, so a
# value can land on the other side of a bf16 rounding boundary: at most one bf16 step (2^-8 relative).
BF16_ATOL = 1e-3
BF16_RTOL = 2**-7


def tiny_text_config_kwargs(num_layers: int = TINY_LAYERS) -> dict:
    """A qwen3_5_text config of the real family, small enough for a CPU forward in milliseconds."""
    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=1024,
        layer_types=[pattern[i % 4] for i in range(num_layers)],
        pad_token_id=0,
    )


def save_tiny_target(path: Path, num_layers: int = TINY_LAYERS, seed: int = 0) -> Path:
    """Save a random tiny Qwen3.5 text model as a normal Hugging Face model directory."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**tiny_text_config_kwargs(num_layers))
    model = Qwen3_5ForCausalLM(config)
    # The default init (std 0.02) keeps activations tiny; larger weights make layers distinguishable.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 2 and "embed" in name:
                parameter.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


def reference_hidden_states(model: torch.nn.Module, input_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """HF's own `output_hidden_states` for one unpadded sample, with the last entry left raw.

    By default the last entry is overwritten with the post-final-norm state; turning
    `tie_last_hidden_states` off keeps entry N as decoder layer N-1's raw output.
    """
    model.config.tie_last_hidden_states = False
    try:
        with torch.inference_mode():
            out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        del model.config.tie_last_hidden_states
    return tuple(h[0] for h in out.hidden_states)


def random_token_lists(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]


def tiny_hybrid() -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny_text_config_kwargs(4)))


def tiny_dense() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config)


# e4m3 keeps 3 mantissa bits: a value scaled into its normal range is off by at most 2^-4 of itself, one
# in its subnormal range (below 2^-6 after scaling) by at most half the smallest step, 2^-10 scales.
E4M3_RELATIVE_ROUNDING = 2**-4
E4M3_SUBNORMAL_ROUNDING = 2**-10


def assert_within_e4m3_rounding(actual: torch.Tensor, expected: torch.Tensor, slack: float = 1e-5) -> None:
    """`actual` [..., H] (dequantised fp8) is within e4m3's rounding of `expected`, element by element, for
    a scale of amax/448 per row of H; `slack` (relative to the row's amax) absorbs the float32 difference
    between a batched forward and the lone reference one."""
    expected = expected.float()
    amax = expected.abs().amax(dim=-1, keepdim=True)
    bound = (
        expected.abs() * E4M3_RELATIVE_ROUNDING * (1 + 1e-3)
        + amax / 448 * E4M3_SUBNORMAL_ROUNDING
        + amax * slack
    )
    excess = (actual.float() - expected).abs() - bound
    assert float(excess.max()) <= 0, f"off by up to {float(excess.max())} beyond e4m3 rounding"
