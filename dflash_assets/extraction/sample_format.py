"""The hidden-state object: one safetensors file per sample, written atomically and checked finite.

Tensors: `input_ids` int32 [T], `loss_mask` uint8 [T], `hidden_states` [T, K, H] where `[:, j]` is the
raw output of decoder layer `target_layer_ids[j]`: bfloat16, or (`DFLASH_HIDDEN_STATE_DTYPE=fp8`)
float8_e4m3fn beside `hidden_states_scale` float32 [T, K], one scale per (token, layer), so the states
are `hidden_states.float() * hidden_states_scale[..., None]` (see `fp8.py`); and, unless
`DFLASH_CAPTURE_FINAL_STATE=0`, `final_hidden_states` [T, H], the target's last hidden state after its
final norm (what its LM head reads), in the same dtype (fp8: with `final_hidden_states_scale` [T]).
Metadata (str -> str) carries `format`, `sample_index`, `target_layer_ids` (JSON), `target_model`,
`hidden_size`, `num_tokens`, `hidden_state_dtype` (`bf16`/`fp8`) and `final_hidden_states` (`1`/`0`;
objects made before it lack the key). The byte layout itself is in `object_size.py`.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.fp8 import EncodedStates, encode_states
from dflash_assets.extraction.object_size import (
    FINAL_SCALE_TENSOR,
    FINAL_STATE_KEY,
    FINAL_TENSOR,
    READABLE_FORMATS,
    RESERVED_METADATA_KEYS,
    SAMPLE_FORMAT,
    SCALE_TENSOR,
    check_hidden_state_dtype,
    estimate_sample_nbytes,
    sample_metadata,
    tensor_specs,
)
from dflash_assets.storage.safetensors_layout import safetensors_header

__all__ = [
    "SAMPLE_FORMAT",
    "CorruptSampleError",
    "HiddenStateSample",
    "NonFiniteHiddenStates",
    "check_sample_metadata",
    "estimate_sample_nbytes",
    "parse_sample_object_name",
    "read_sample",
    "read_sample_metadata",
    "sample_object_name",
    "staged_file_problem",
    "write_sample",
]

_OBJECT_NAME = re.compile(r"^hs_(\d{8,})\.safetensors$")
_TEMP_MARKER = ".tmp-"


class NonFiniteHiddenStates(ValueError):
    """A sample's hidden states hold NaN or infinity; nothing was written for it."""

    def __init__(self, sample_index: int, message: str) -> None:
        super().__init__(message)
        self.sample_index = sample_index


class CorruptSampleError(ValueError):
    """A hidden-state file or object that does not parse as this format."""


@dataclass
class HiddenStateSample:
    sample_index: int
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # as stored: bfloat16 [T, K, H], or float8_e4m3fn with the scale below
    target_layer_ids: list[int]
    target_model: str
    hidden_size: int
    metadata: dict[str, str] = field(repr=False)
    hidden_states_scale: torch.Tensor | None = None  # float32 [T, K] for fp8 objects, else None
    final_hidden_states: torch.Tensor | None = None  # [T, H] as stored, when the object holds it
    final_hidden_states_scale: torch.Tensor | None = None  # float32 [T] for fp8 objects that hold it

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def has_final_state(self) -> bool:
        return self.final_hidden_states is not None

    @property
    def hidden_state_dtype(self) -> str:
        return "fp8" if self.hidden_states_scale is not None else "bf16"

    @property
    def states(self) -> EncodedStates:
        return EncodedStates(self.hidden_states, self.hidden_states_scale)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The hidden states as `dtype` [T, K, H] (fp8 values times their scales)."""
        return self.states.dequantize(dtype)

    def final_dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The final hidden state as `dtype` [T, H]; a `ValueError` when the object has none."""
        if self.final_hidden_states is None:
            raise ValueError(f"sample {self.sample_index} holds no final hidden state")
        return EncodedStates(self.final_hidden_states, self.final_hidden_states_scale).dequantize(dtype)


def sample_object_name(index: int) -> str:
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    return f"hs_{index:08d}.safetensors"


def parse_sample_object_name(name: str) -> int | None:
    """The sample index in `hs_00000017.safetensors`, or None for any other name (temp files included)."""
    match = _OBJECT_NAME.match(name)
    return int(match.group(1)) if match else None


def _check_finite(sample_index: int, states: EncodedStates, target_layer_ids: Sequence[int | str]) -> None:
    finite = torch.isfinite(states.values if states.scale is None else states.dequantize(torch.float32))
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first_token, first_layer = int(bad[0, 0]), int(bad[0, 1])
    raise NonFiniteHiddenStates(
        sample_index,
        f"sample {sample_index}: hidden states hold {bad.shape[0]} non-finite values (NaN/inf), first at "
        f"token {first_token} of layer {target_layer_ids[first_layer]}; nothing was written. "
        "Check the target model's dtype (bf16 overflow) and this sample's tokens.",
    )


def write_sample(
    path: str | Path,
    *,
    sample_index: int,
    input_ids: Sequence[int] | torch.Tensor,
    loss_mask: Sequence[int] | torch.Tensor,
    hidden_states: torch.Tensor | EncodedStates,
    target_layer_ids: Sequence[int],
    target_model: str,
    extra_metadata: Mapping[str, str] | None = None,
    check_finite: bool = True,
    durable: bool = True,
    hidden_state_dtype: str = "bf16",
    final_state: bool = False,
) -> int:
    """Write one sample atomically (temp name in the same directory, then rename); returns its size.

    `hidden_states` is a float tensor [T, K, H], stored as `hidden_state_dtype` (`bf16` or `fp8`,
    quantised here on the host), or states already encoded (`EncodedStates`: extraction quantises on
    the device), stored as they are. With `final_state` it has K + 1 slots, the last the target's final
    hidden state, stored as `final_hidden_states` beside the K layers: both written from the one buffer a
    token's row at a time, without copying the states.

    A reader never sees a half-written file under the final name, so "the file exists" means "done".
    `check_finite=False` is for callers that already checked the values where they were computed
    (extraction checks a whole batch on the device). `durable=False` skips the fsyncs: the file then
    survives a killed process (the page cache keeps it) but not a power loss, which suits a staging
    copy whose durable home is the store (see `staging.py` for how such files are distrusted after a
    reboot).
    """
    path = Path(path)
    if isinstance(hidden_states, EncodedStates):
        encoded = hidden_states
    else:
        encoded = encode_states(hidden_states.detach(), check_hidden_state_dtype(hidden_state_dtype))
    if encoded.values.ndim != 3:
        raise ValueError(
            f"sample {sample_index}: hidden_states must be [T, K, H], got shape {tuple(encoded.values.shape)}"
        )
    num_tokens, num_slots, hidden_size = encoded.values.shape
    num_layers = num_slots - int(final_state)
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64).reshape(-1), dtype="<i4")
    mask = np.asarray(loss_mask).reshape(-1)
    if ids.shape[0] != num_tokens or mask.shape[0] != num_tokens:
        raise ValueError(
            f"sample {sample_index}: {ids.shape[0]} input ids and {mask.shape[0]} loss-mask entries "
            f"but hidden states for {num_tokens} tokens"
        )
    if num_layers != len(target_layer_ids):
        final = " (the final state last)" if final_state else ""
        raise ValueError(
            f"sample {sample_index}: hidden states hold {num_slots} layers{final} but target_layer_ids "
            f"names {len(target_layer_ids)}: {list(target_layer_ids)}"
        )
    if mask.size and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"sample {sample_index}: loss mask must hold only 0 and 1")
    extra = dict(extra_metadata or {})
    clash = RESERVED_METADATA_KEYS & extra.keys()
    if clash:
        raise ValueError(f"extra_metadata may not override reserved keys {sorted(clash)}")
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in extra.items()):
        raise TypeError("extra_metadata must map str to str (safetensors metadata is text)")

    # No-ops (no copy) for what extraction passes: contiguous views of a host batch buffer.
    states = EncodedStates(
        encoded.values.to("cpu").contiguous(),
        encoded.scale.to(device="cpu", dtype=torch.float32).contiguous()
        if encoded.scale is not None
        else None,
    )
    if states.scale is not None and tuple(states.scale.shape) != (num_tokens, num_slots):
        raise ValueError(
            f"sample {sample_index}: fp8 hidden states need one scale per (token, layer), shape "
            f"{(num_tokens, num_slots)}, got {tuple(states.scale.shape)}"
        )
    if check_finite:
        _check_finite(sample_index, states, [*target_layer_ids, *(["final"] if final_state else [])])

    metadata = sample_metadata(
        sample_index=sample_index,
        num_tokens=num_tokens,
        target_layer_ids=target_layer_ids,
        target_model=target_model,
        hidden_size=hidden_size,
        dtype=states.dtype,
        extra_metadata=extra,
        final_state=final_state,
    )
    data: dict[str, list[memoryview]] = {
        "input_ids": [memoryview(ids).cast("B")],
        "loss_mask": [memoryview(np.ascontiguousarray(mask, dtype=np.uint8)).cast("B")],
    }
    if final_state:  # each token's K layers, then each token's final state: row views of the one buffer
        data["hidden_states"] = [_bytes_of(row) for row in states.values[:, :num_layers]]
        data[FINAL_TENSOR] = [_bytes_of(row) for row in states.values[:, num_layers]]
        if states.scale is not None:
            data[SCALE_TENSOR] = [_bytes_of(states.scale[:, :num_layers].contiguous())]
            data[FINAL_SCALE_TENSOR] = [_bytes_of(states.scale[:, num_layers].contiguous())]
    else:
        data["hidden_states"] = [_bytes_of(states.values)]
        if states.scale is not None:
            data[SCALE_TENSOR] = [_bytes_of(states.scale)]
    specs = tensor_specs(num_tokens, num_layers, hidden_size, states.dtype, final_state)
    buffers = [data[name] for name, _, _, _ in specs]

    temp = path.with_name(f".{path.name}{_TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = _write_all(fd, _safetensors_buffers(specs, buffers, metadata))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)
    return size


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them (pinned memory included)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    if not tensor.is_contiguous():
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} is not contiguous: its bytes would be copied"
        )
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _safetensors_buffers(
    specs: list, buffers: list[list[memoryview]], metadata: dict
) -> list[bytes | memoryview]:
    """The safetensors layout as a list of buffers, so the bytes are deterministic and never copied: each
    tensor is one buffer, or its rows in order where it is not contiguous in memory.

    The header is `storage.safetensors_layout`'s (sorted keys: `safetensors.torch.save_file` orders them
    at random, so the same sample would give different bytes on every run)."""
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; this writer only runs on little-endian hosts"
        )
    for (name, _, _, nbytes), parts in zip(specs, buffers, strict=True):
        if sum(part.nbytes for part in parts) != nbytes:
            raise ValueError(
                f"tensor {name} has {sum(p.nbytes for p in parts)} bytes, its header entry says {nbytes}"
            )
    return [
        safetensors_header(specs, metadata),
        *(part for parts in buffers for part in parts if part.nbytes),
    ]


# Linux caps one writev at IOV_MAX buffers and just under 2 GiB; larger samples take several calls.
_MAX_WRITE_BYTES = 1 << 30


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> int:
    """Write every buffer in order with as few system calls as the kernel allows; returns the bytes."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    while views:
        chunk, room = [], _MAX_WRITE_BYTES
        for view in views[:512]:
            if room <= 0:
                break
            chunk.append(view[:room])
            room -= min(view.nbytes, room)
        written = os.writev(fd, chunk)
        while written and views:  # drop what was written, keep the rest (writev may stop short)
            if written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0
    return total


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; some filesystems do not support fsync on directories.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse_header(raw: bytes, where: str) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header and the number of bytes the whole file must have."""
    if len(raw) < 8:
        raise CorruptSampleError(f"{where}: too short to be a safetensors file ({len(raw)} bytes)")
    (header_length,) = struct.unpack("<Q", raw[:8])
    if len(raw) < 8 + header_length:
        raise CorruptSampleError(f"{where}: header claims {header_length} bytes but the data is truncated")
    try:
        header = json.loads(raw[8 : 8 + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptSampleError(f"{where}: unreadable safetensors header ({error})") from error
    if not isinstance(header, dict):
        raise CorruptSampleError(f"{where}: safetensors header is not an object")
    try:
        data_end = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise CorruptSampleError(
            f"{where}: malformed tensor entry in the safetensors header ({error})"
        ) from error
    return header, 8 + header_length + data_end


def check_sample_metadata(metadata: Mapping[str, Any], where: str) -> dict[str, str]:
    """A hidden-state object's `__metadata__`, checked: its format, dtype and required keys."""
    if metadata.get("format") not in READABLE_FORMATS:
        raise CorruptSampleError(
            f"{where}: format {metadata.get('format')!r} is not {SAMPLE_FORMAT!r}; not a hidden-state object"
        )
    if metadata.get("hidden_state_dtype", "bf16") not in ("bf16", "fp8"):
        raise CorruptSampleError(f"{where}: unknown hidden_state_dtype {metadata['hidden_state_dtype']!r}")
    missing = [
        key
        for key in ("sample_index", "target_layer_ids", "target_model", "hidden_size")
        if key not in metadata
    ]
    if missing:
        raise CorruptSampleError(f"{where}: metadata lacks {missing}")
    return dict(metadata)


def _metadata_from_header(header: dict[str, Any], where: str) -> dict[str, str]:
    return check_sample_metadata(header.get("__metadata__") or {}, where)


def read_sample_metadata(path: str | Path) -> dict[str, str]:
    """Only the header: cheap. Raises CorruptSampleError if the header or the file length is wrong."""
    path = Path(path)
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CorruptSampleError(f"{path}: too short to be a safetensors file ({len(prefix)} bytes)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > 100 * 2**20:
            raise CorruptSampleError(f"{path}: implausible header length {header_length}")
        raw = prefix + handle.read(header_length)
    header, expected_size = _parse_header(raw, str(path))
    actual_size = path.stat().st_size
    if actual_size != expected_size:
        raise CorruptSampleError(
            f"{path}: {actual_size} bytes on disk but the header describes {expected_size}"
        )
    return _metadata_from_header(header, str(path))


def read_sample(source: str | Path | bytes) -> HiddenStateSample:
    """A whole sample from a file path or from the object's bytes."""
    if isinstance(source, bytes | bytearray | memoryview):
        raw = bytes(source)
        where = "hidden-state object"
        header, expected_size = _parse_header(raw, where)
        if len(raw) != expected_size:
            raise CorruptSampleError(f"{where}: {len(raw)} bytes but the header describes {expected_size}")
        metadata = _metadata_from_header(header, where)
        tensors = load_safetensors_bytes(raw)
    else:
        where = str(source)
        metadata = read_sample_metadata(source)
        with safe_open(str(source), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
    return sample_from_tensors(tensors, metadata, where)


def sample_from_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], where: str
) -> HiddenStateSample:
    """The sample an object's tensors and (checked) metadata make; a tensor the format requires and the
    object lacks is a `CorruptSampleError` naming it."""
    fp8 = metadata.get("hidden_state_dtype") == "fp8"
    final = metadata.get(FINAL_STATE_KEY) == "1"
    required = ["input_ids", "loss_mask", "hidden_states", *([SCALE_TENSOR] if fp8 else [])]
    if final:
        required += [FINAL_TENSOR, *([FINAL_SCALE_TENSOR] if fp8 else [])]
    for key in required:
        if key not in tensors:
            raise CorruptSampleError(f"{where}: tensor {key!r} is missing")
    return HiddenStateSample(
        sample_index=int(metadata["sample_index"]),
        input_ids=tensors["input_ids"],
        loss_mask=tensors["loss_mask"],
        hidden_states=tensors["hidden_states"],
        target_layer_ids=[int(i) for i in json.loads(metadata["target_layer_ids"])],
        target_model=metadata["target_model"],
        hidden_size=int(metadata["hidden_size"]),
        metadata=metadata,
        hidden_states_scale=tensors.get(SCALE_TENSOR) if fp8 else None,
        final_hidden_states=tensors.get(FINAL_TENSOR) if final else None,
        final_hidden_states_scale=tensors.get(FINAL_SCALE_TENSOR) if final and fp8 else None,
    )


def staged_file_problem(
    path: Path, sample: TokenizedSample, fingerprint: dict[str, Any], num_layers: int, hidden_size: int
) -> str | None:
    """Why a final-named staged file cannot be uploaded as `sample`'s object, or None if it can."""
    index = sample.sample_index
    try:
        metadata = read_sample_metadata(path)
    except (CorruptSampleError, OSError) as error:
        return str(error)
    if metadata.get("sample_index") != str(index):
        return f"its metadata says sample {metadata.get('sample_index')}"
    made_by = {
        "format": metadata.get("format"),
        "target_model": metadata.get("target_model"),
        "target_layer_ids": json.loads(metadata.get("target_layer_ids", "null")),
        "hidden_size": int(metadata.get("hidden_size", -1)),
        "hidden_state_dtype": metadata.get("hidden_state_dtype", "bf16"),
    }
    if metadata.get(FINAL_STATE_KEY) == "1":
        made_by[FINAL_STATE_KEY] = True
    if made_by != fingerprint:
        return f"made by {made_by}"
    try:
        with safe_open(str(path), framework="pt") as handle:
            input_ids = handle.get_tensor("input_ids").tolist()
            loss_mask = handle.get_tensor("loss_mask").tolist()
            shape = list(handle.get_slice("hidden_states").get_shape())
            scale_shape = (
                list(handle.get_slice(SCALE_TENSOR).get_shape())
                if metadata.get("hidden_state_dtype") == "fp8"
                else None
            )
            final_shape = (
                list(handle.get_slice(FINAL_TENSOR).get_shape())
                if metadata.get(FINAL_STATE_KEY) == "1"
                else None
            )
    except Exception as error:  # safetensors raises its own error types for damaged files
        return f"unreadable ({error})"
    if input_ids != list(sample.input_ids) or loss_mask != list(sample.loss_mask):
        return "its tokens differ from the tokenized sample (the tokenized range changed)"
    if shape != [sample.num_tokens, num_layers, hidden_size]:
        return f"hidden_states shape {shape}"
    if scale_shape is not None and scale_shape != [sample.num_tokens, num_layers]:
        return f"{SCALE_TENSOR} shape {scale_shape}"
    if final_shape is not None and final_shape != [sample.num_tokens, hidden_size]:
        return f"{FINAL_TENSOR} shape {final_shape}"
    return None
