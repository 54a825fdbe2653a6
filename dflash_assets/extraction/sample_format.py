"""The hidden-state object: one safetensors file per sample, written atomically and checked finite.

Tensors: `input_ids` int32 [T], `loss_mask` uint8 [T], `hidden_states` bfloat16 [T, K, H] where
`[:, j]` is the raw output of decoder layer `target_layer_ids[j]`. Metadata (str -> str) carries
`format`, `sample_index`, `target_layer_ids` (JSON), `target_model`, `hidden_size` and `num_tokens`.
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

SAMPLE_FORMAT = "dflash-assets.hidden-states/1"
RESERVED_METADATA_KEYS = frozenset(
    {"format", "sample_index", "target_layer_ids", "target_model", "hidden_size", "num_tokens"}
)
# Room for the JSON header beyond the caller's metadata: three tensor entries, the reserved keys and
# alignment padding take well under this; the surplus only over-reserves staging space a little.
_HEADER_ALLOWANCE_BYTES = 4096
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
    hidden_states: torch.Tensor  # bfloat16 [T, K, H]
    target_layer_ids: list[int]
    target_model: str
    hidden_size: int
    metadata: dict[str, str] = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def sample_object_name(index: int) -> str:
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    return f"hs_{index:08d}.safetensors"


def parse_sample_object_name(name: str) -> int | None:
    """The sample index in `hs_00000017.safetensors`, or None for any other name (temp files included)."""
    match = _OBJECT_NAME.match(name)
    return int(match.group(1)) if match else None


def estimate_sample_nbytes(
    num_tokens: int, num_layers: int, hidden_size: int, metadata_nbytes: int = 0
) -> int:
    """Upper bound on a sample file's size, header included: what to reserve before writing it."""
    tensor_bytes = num_tokens * num_layers * hidden_size * 2 + num_tokens * 4 + num_tokens
    return 8 + _HEADER_ALLOWANCE_BYTES + 2 * metadata_nbytes + tensor_bytes


def _check_finite(sample_index: int, hidden_states: torch.Tensor, target_layer_ids: Sequence[int]) -> None:
    finite = torch.isfinite(hidden_states)
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
    hidden_states: torch.Tensor,
    target_layer_ids: Sequence[int],
    target_model: str,
    extra_metadata: Mapping[str, str] | None = None,
    check_finite: bool = True,
    durable: bool = True,
) -> int:
    """Write one sample atomically (temp name in the same directory, then rename); returns its size.

    A reader never sees a half-written file under the final name, so "the file exists" means "done".
    `check_finite=False` is for callers that already checked the values where they were computed
    (extraction checks a whole batch on the device). `durable=False` skips the fsyncs: the file then
    survives a killed process (the page cache keeps it) but not a power loss, which suits a staging
    copy whose durable home is the store (see `staging.py` for how such files are distrusted after a
    reboot).
    """
    path = Path(path)
    if hidden_states.ndim != 3:
        raise ValueError(
            f"sample {sample_index}: hidden_states must be [T, K, H], got shape {tuple(hidden_states.shape)}"
        )
    num_tokens, num_layers, hidden_size = hidden_states.shape
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64).reshape(-1), dtype="<i4")
    mask = np.asarray(loss_mask).reshape(-1)
    if ids.shape[0] != num_tokens or mask.shape[0] != num_tokens:
        raise ValueError(
            f"sample {sample_index}: {ids.shape[0]} input ids and {mask.shape[0]} loss-mask entries "
            f"but hidden states for {num_tokens} tokens"
        )
    if num_layers != len(target_layer_ids):
        raise ValueError(
            f"sample {sample_index}: hidden states hold {num_layers} layers but target_layer_ids "
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

    # No-ops (no copy) for what extraction passes: a contiguous bf16 view of a host batch buffer.
    states = hidden_states.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    if check_finite:
        _check_finite(sample_index, states, target_layer_ids)

    metadata = {
        **extra,
        "format": SAMPLE_FORMAT,
        "sample_index": str(sample_index),
        "target_layer_ids": json.dumps([int(i) for i in target_layer_ids]),
        "target_model": target_model,
        "hidden_size": str(hidden_size),
        "num_tokens": str(num_tokens),
    }
    # Widest alignment first, so every tensor starts aligned to its element size.
    tensors = [
        ("input_ids", "I32", [num_tokens], memoryview(ids).cast("B")),
        ("hidden_states", "BF16", list(states.shape), _bytes_of(states)),
        ("loss_mask", "U8", [num_tokens], memoryview(np.ascontiguousarray(mask, dtype=np.uint8)).cast("B")),
    ]

    temp = path.with_name(f".{path.name}{_TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = _write_all(fd, _safetensors_buffers(tensors, metadata))
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
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _safetensors_buffers(
    tensors: list[tuple[str, str, list[int], memoryview]], metadata: dict
) -> list[bytes | memoryview]:
    """The safetensors layout as a list of buffers, so the bytes are deterministic and never copied.

    `safetensors.torch.save_file` orders metadata keys at random (a Rust HashMap), so the same sample
    would give different bytes on every run; a sorted header makes objects reproducible and comparable.
    """
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; this writer only runs on little-endian hosts"
        )
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    return [struct.pack("<Q", len(encoded)), encoded, *(data for _, _, _, data in tensors if data.nbytes)]


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


def _metadata_from_header(header: dict[str, Any], where: str) -> dict[str, str]:
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != SAMPLE_FORMAT:
        raise CorruptSampleError(
            f"{where}: format {metadata.get('format')!r} is not {SAMPLE_FORMAT!r}; not a hidden-state object"
        )
    missing = [
        key
        for key in ("sample_index", "target_layer_ids", "target_model", "hidden_size")
        if key not in metadata
    ]
    if missing:
        raise CorruptSampleError(f"{where}: metadata lacks {missing}")
    return dict(metadata)


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
    for key in ("input_ids", "loss_mask", "hidden_states"):
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
    }
    if made_by != fingerprint:
        return f"made by {made_by}"
    try:
        with safe_open(str(path), framework="pt") as handle:
            input_ids = handle.get_tensor("input_ids").tolist()
            loss_mask = handle.get_tensor("loss_mask").tolist()
            shape = list(handle.get_slice("hidden_states").get_shape())
    except Exception as error:  # safetensors raises its own error types for damaged files
        return f"unreadable ({error})"
    if input_ids != list(sample.input_ids) or loss_mask != list(sample.loss_mask):
        return "its tokens differ from the tokenized sample (the tokenized range changed)"
    if shape != [sample.num_tokens, num_layers, hidden_size]:
        return f"hidden_states shape {shape}"
    return None
