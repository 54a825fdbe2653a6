"""Hidden states as they are stored: bf16, or float8 e4m3 with one float32 scale per (token, layer).

e4m3's largest finite value is 448, and an unscaled cast of a residual stream (values in the hundreds
or thousands in deep layers) would saturate. So each (token, layer) row of H values is scaled by its own
`amax / 448` first: the largest value of the row lands on 448 and the rest keep e4m3's 3-bit mantissa,
a relative rounding error of at most 2^-4 per value (6.25 %), and ~2 % RMS over a row. The scale is
never zero (an all-zero row gets the smallest normal float32), and the scaled values are clamped to
±448 before the cast, so float32 rounding of `x / scale` can never push one past the range.

`encode_states` runs wherever the tensor lives: extraction calls it on the device, before the copy to
the host, so the bytes copied, staged, uploaded and read back all halve; training calls
`EncodedStates.dequantize` on its own device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_assets.extraction.object_size import check_hidden_state_dtype

E4M3_MAX = 448.0
# The smallest normal float32: a zero row's scale, so a scale is never zero (and never subnormal).
MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass
class EncodedStates:
    """Stored hidden states of one sample or a batch: `values` [..., K, H] (bf16, or float8_e4m3fn
    with `scale` [..., K] float32)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def dtype(self) -> str:
        return "fp8" if self.scale is not None else "bf16"

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.values.numel() * self.values.element_size() + scale

    def rows(self, row: int, length: int) -> EncodedStates:
        """`[row, :length]` of a batch: views, no copy."""
        scale = self.scale[row, :length] if self.scale is not None else None
        return EncodedStates(self.values[row, :length], scale)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The states as `dtype` on `device` (default: where they are); fp8 is multiplied out there."""
        values = self.values if device is None else self.values.to(device, non_blocking=True)
        if self.scale is None:
            return values.to(dtype)
        scale = self.scale if device is None else self.scale.to(device, non_blocking=True)
        return (values.float() * scale.unsqueeze(-1)).to(dtype)

    def non_finite_count(self) -> int:
        """Values that are NaN or infinite once dequantised (a non-finite scale spoils its whole row)."""
        return int((~torch.isfinite(self.dequantize(torch.float32))).sum())


def quantize_e4m3(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden` [..., H] (any float dtype) -> (float8_e4m3fn [..., H], float32 scale [...]), on its device."""
    # max |x| from two reductions (no |x| copy), exact in the input's dtype; then one float32 temporary,
    # clamped in place: on a GPU a batch is ~0.4 G values at the 27B shape.
    amax = torch.maximum(hidden.amax(dim=-1), hidden.amin(dim=-1).neg()).float()
    scale = amax.div_(E4M3_MAX).clamp_(min=MIN_SCALE)
    scaled = torch.div(hidden, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)  # float32 by promotion
    return scaled.to(torch.float8_e4m3fn), scale


def encode_states(hidden: torch.Tensor, dtype: str) -> EncodedStates:
    """`hidden` [..., K, H] as stored under `dtype` (`bf16` or `fp8`); no copy when it already is bf16."""
    if check_hidden_state_dtype(dtype) == "bf16":
        return EncodedStates(hidden if hidden.dtype == torch.bfloat16 else hidden.to(torch.bfloat16))
    values, scale = quantize_e4m3(hidden)
    return EncodedStates(values, scale)


def relative_error_per_layer(reference: torch.Tensor, approximation: torch.Tensor) -> list[float]:
    """`||approx - ref|| / ||ref||` per layer of [T, K, H] (or [B, T, K, H]) states, in float64."""
    reference, approximation = reference.double(), approximation.double()
    dims = tuple(d for d in range(reference.ndim) if d != reference.ndim - 2)
    error = (approximation - reference).pow(2).sum(dim=dims).sqrt()
    norm = reference.pow(2).sum(dim=dims).sqrt().clamp(min=1e-30)
    return (error / norm).tolist()
