"""The hidden-state object's byte layout without its bytes: the safetensors header the writer emits,
the size of an object, and the bytes per stored token, for either stored dtype.

Torch-free, so the capacity plan and the Dagster layer can size a run without importing torch. The
writer (`sample_format.write_sample`) builds its header with `storage.safetensors_layout` and its tensor list
with `tensor_specs`, so `sample_object_nbytes` is the object's size by construction, not a model of it.

Stored dtypes (`DFLASH_HIDDEN_STATE_DTYPE`):
- `bf16`: `hidden_states` BF16 [T, K, H].
- `fp8`: `hidden_states` F8_E4M3 [T, K, H] and `hidden_states_scale` F32 [T, K], one scale per (token,
  layer): the states are `hidden_states.float() * hidden_states_scale[..., None]`.

With the target's final state (`DFLASH_CAPTURE_FINAL_STATE`, the default): `final_hidden_states` [T, H]
beside them, in the same dtype, and for fp8 its `final_hidden_states_scale` F32 [T]: one more layer's
bytes a token (1 + 1/K times the taps').
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dflash_assets.storage.safetensors_layout import TensorSpec, safetensors_header

SAMPLE_FORMAT = "dflash-assets.hidden-states/2"
# Format 1 (bf16 only, no `hidden_state_dtype` key) is still read; every object written now is format 2.
READABLE_FORMATS = frozenset({"dflash-assets.hidden-states/1", SAMPLE_FORMAT})
HIDDEN_STATE_DTYPE_SETTING = "DFLASH_HIDDEN_STATE_DTYPE"
HIDDEN_STATE_DTYPES = ("bf16", "fp8")
SCALE_TENSOR = "hidden_states_scale"
FINAL_TENSOR, FINAL_SCALE_TENSOR = "final_hidden_states", "final_hidden_states_scale"
# Metadata key: "1" when the object holds the target's final state (objects made before it lack the key).
FINAL_STATE_KEY = "final_hidden_states"
# Safetensors dtype names of the states, and bytes per element.
STATE_TENSOR_DTYPES = {"bf16": ("BF16", 2), "fp8": ("F8_E4M3", 1)}
RESERVED_METADATA_KEYS = frozenset(
    {
        "format",
        "sample_index",
        "target_layer_ids",
        "target_model",
        "hidden_size",
        "num_tokens",
        "hidden_state_dtype",
        FINAL_STATE_KEY,
    }
)
# Room for the JSON header beyond the caller's metadata, for `estimate_sample_nbytes`: four tensor entries,
# the reserved keys and alignment padding take well under this; the surplus only over-reserves staging.
HEADER_ALLOWANCE_BYTES = 4096


def check_hidden_state_dtype(name: str) -> str:
    """`bf16` or `fp8` (case and surrounding space ignored); anything else names the setting."""
    value = str(name).strip().lower()
    if value not in HIDDEN_STATE_DTYPES:
        raise ValueError(
            f"hidden-state dtype {name!r} is not one of {list(HIDDEN_STATE_DTYPES)}: set "
            f"{HIDDEN_STATE_DTYPE_SETTING}=bf16 (the default) or {HIDDEN_STATE_DTYPE_SETTING}=fp8"
        )
    return value


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str, final_state: bool = False) -> int:
    """Stored bytes per token, header excluded: the states (the final state's too, with `final_state`;
    and fp8's scales), the int32 id, the mask byte."""
    dtype = check_hidden_state_dtype(dtype)
    _, element = STATE_TENSOR_DTYPES[dtype]
    slots = num_layers + int(final_state)
    scale = 4 * slots if dtype == "fp8" else 0
    return slots * hidden_size * element + scale + 4 + 1


def tensor_specs(
    num_tokens: int, num_layers: int, hidden_size: int, dtype: str, final_state: bool = False
) -> list[TensorSpec]:
    """The object's tensors in file order: widest alignment first, so each starts aligned to its element."""
    dtype = check_hidden_state_dtype(dtype)
    state_dtype, element = STATE_TENSOR_DTYPES[dtype]
    specs: list[TensorSpec] = [("input_ids", "I32", [num_tokens], 4 * num_tokens)]
    if dtype == "fp8":
        specs.append((SCALE_TENSOR, "F32", [num_tokens, num_layers], 4 * num_tokens * num_layers))
        if final_state:
            specs.append((FINAL_SCALE_TENSOR, "F32", [num_tokens], 4 * num_tokens))
    specs.append(
        (
            "hidden_states",
            state_dtype,
            [num_tokens, num_layers, hidden_size],
            element * num_tokens * num_layers * hidden_size,
        )
    )
    if final_state:
        specs.append(
            (FINAL_TENSOR, state_dtype, [num_tokens, hidden_size], element * num_tokens * hidden_size)
        )
    specs.append(("loss_mask", "U8", [num_tokens], num_tokens))
    return specs


def sample_metadata(
    *,
    sample_index: int,
    num_tokens: int,
    target_layer_ids: Sequence[int],
    target_model: str,
    hidden_size: int,
    dtype: str,
    extra_metadata: Mapping[str, str] | None = None,
    final_state: bool = False,
) -> dict[str, str]:
    """The safetensors metadata of an object (str -> str), the contracted keys over the caller's extra."""
    return {
        **dict(extra_metadata or {}),
        "format": SAMPLE_FORMAT,
        "sample_index": str(sample_index),
        "target_layer_ids": json.dumps([int(i) for i in target_layer_ids]),
        "target_model": target_model,
        "hidden_size": str(hidden_size),
        "num_tokens": str(num_tokens),
        "hidden_state_dtype": check_hidden_state_dtype(dtype),
        FINAL_STATE_KEY: "1" if final_state else "0",
    }


def sample_object_nbytes(
    *,
    sample_index: int,
    num_tokens: int,
    target_layer_ids: Sequence[int],
    target_model: str,
    hidden_size: int,
    dtype: str,
    extra_metadata: Mapping[str, str] | None = None,
    final_state: bool = False,
) -> int:
    """The exact size of the object `write_sample` writes for this sample (header + tensors)."""
    num_layers = len(target_layer_ids)
    specs = tensor_specs(num_tokens, num_layers, hidden_size, dtype, final_state)
    metadata = sample_metadata(
        sample_index=sample_index,
        num_tokens=num_tokens,
        target_layer_ids=target_layer_ids,
        target_model=target_model,
        hidden_size=hidden_size,
        dtype=dtype,
        extra_metadata=extra_metadata,
        final_state=final_state,
    )
    return len(safetensors_header(specs, metadata)) + sum(spec[3] for spec in specs)


def estimate_sample_nbytes(
    num_tokens: int,
    num_layers: int,
    hidden_size: int,
    metadata_nbytes: int = 0,
    dtype: str = "bf16",
    final_state: bool = False,
) -> int:
    """Upper bound on an object's size, header included, without its metadata: what staging reserves
    before writing it. `metadata_nbytes` is the length of the caller's variable metadata (the target
    model's name)."""
    tensor_bytes = num_tokens * bytes_per_token(num_layers, hidden_size, dtype, final_state)
    return 8 + HEADER_ALLOWANCE_BYTES + 2 * metadata_nbytes + tensor_bytes


def min_sample_nbytes(
    num_tokens: int, num_layers: int, hidden_size: int, dtype: str = "bf16", final_state: bool = False
) -> int:
    """Lower bound on an object's size: its tensors and the header's length field."""
    return 8 + num_tokens * bytes_per_token(num_layers, hidden_size, dtype, final_state)


def estimate_num_tokens(
    object_nbytes: int, num_layers: int, hidden_size: int, dtype: str = "bf16", final_state: bool = False
) -> int:
    """Tokens of an object of this size: near enough to bucket samples by length (headers are ~500 B)."""
    return max(1, round((object_nbytes - 512) / bytes_per_token(num_layers, hidden_size, dtype, final_state)))
