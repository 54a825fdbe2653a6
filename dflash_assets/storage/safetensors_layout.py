"""The safetensors file layout, without torch: the 8-byte length and JSON header a writer emits before
the tensors' bytes. Hidden-state objects (`extraction/sample_format.py`) and the drafter's weights files
(`drafter/weights_file.py`) write their headers with it, so each knows its file's size before a byte of
it is written and writes the tensors' bytes straight after, one at a time."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

TensorSpec = tuple[str, str, list[int], int]  # name, safetensors dtype, shape, bytes


def safetensors_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length and the JSON header, padded so the data section starts 8-byte aligned.

    Keys are sorted (`safetensors.torch.save_file` orders them at random), so the same sample always
    gives the same bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in specs:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded
