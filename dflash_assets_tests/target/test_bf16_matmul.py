"""The bf16 LM head on a CPU without bf16 matrix units: the same product and gradients as `F.linear` in
bf16, through float32 tiles of the weight (PyTorch's reference bf16 kernel there is 20-100x slower)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dflash_assets.target.bf16_matmul as bf16_matmul
from dflash_assets.target.bf16_matmul import bf16_linear, runs_through_float32_tiles


@pytest.fixture
def no_bf16_units(monkeypatch):
    """This host as one without bf16 matrix units, with small tiles so that several are used."""
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(bf16_matmul, "TILE_ROWS", 48)


def test_the_tiled_product_and_its_gradients_equal_bf16_linear(no_bf16_units):
    torch.manual_seed(0)
    weight = (torch.randn(200, 64) * 0.1).bfloat16().requires_grad_()  # 200 rows: 4 tiles of 48 and one of 8
    hidden = torch.randn(3, 7, 64, requires_grad=True)  # float32 in, as the drafter's rows come
    assert runs_through_float32_tiles(weight)
    tiled = bf16_linear(hidden, weight)
    expected = F.linear(hidden.bfloat16(), weight)
    assert tiled.dtype == torch.bfloat16 and tiled.shape == (3, 7, 200)
    torch.testing.assert_close(tiled.float(), expected.float(), rtol=2**-7, atol=1e-3)  # rounding order alone

    upstream = torch.randn(3, 7, 200)
    grads = torch.autograd.grad((tiled.float() * upstream).sum(), [hidden, weight])
    reference = torch.autograd.grad((expected.float() * upstream).sum(), [hidden, weight])
    for mine, theirs in zip(grads, reference, strict=True):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2**-6, atol=2e-2)


def test_where_torch_has_a_bf16_kernel_or_the_weight_is_not_bf16_it_is_plain_linear(monkeypatch):
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: True)
    weight = torch.randn(10, 4).bfloat16()
    assert not runs_through_float32_tiles(weight)
    assert not runs_through_float32_tiles(torch.randn(10, 4))  # float32: MKL's own kernel
    hidden = torch.randn(2, 4)
    assert torch.equal(bf16_linear(hidden, weight), F.linear(hidden.bfloat16(), weight))
