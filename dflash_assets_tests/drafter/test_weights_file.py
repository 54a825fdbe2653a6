"""The drafter's weights file, written one tensor at a time, is the file safetensors itself reads."""

from __future__ import annotations

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_assets.drafter.weights_file import save_weights


def test_weights_written_one_at_a_time_load_with_safetensors_in_any_dtype_aligned(tmp_path):
    tensors = {
        "layers.0.mlp.up_proj.weight": torch.randn(7, 5),
        "norm.weight": torch.randn(5).to(torch.bfloat16),
        "fc.weight": torch.randn(3, 11),
        "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }
    size = save_weights(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert size == (tmp_path / "model.safetensors").stat().st_size
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}

    save_weights(tensors, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    cast = load_file(str(tmp_path / "bf16.safetensors"))
    assert cast["fc.weight"].dtype == torch.bfloat16 and cast["mask"].dtype == torch.uint8
    assert torch.equal(cast["fc.weight"], tensors["fc.weight"].to(torch.bfloat16))
    # Every tensor starts at a multiple of its element size (float32 first, then bf16, then bytes).
    raw = (tmp_path / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    layout = json.loads(raw[8 : 8 + length])
    sizes = {"F32": 4, "BF16": 2, "U8": 1}
    for name, entry in layout.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, name
