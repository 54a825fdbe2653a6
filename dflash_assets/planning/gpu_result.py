"""Where `dflash-assets bench --gpu` saves what it measured, and how the plan reads it back.

The file is `$DFLASH_CACHE_DIR/bench/gpu-bench.json` (one per machine: the last run wins), JSON:

    format          "dflash-assets.gpu-bench/1"
    measured_at     ISO time
    device          e.g. "NVIDIA H200"; total_memory_bytes; peak_flops (dense bf16, or null)
    targets         one entry per benchmarked target shape:
        shape, model_type ("qwen3" dense / "qwen3_5_text" hybrid), layer_ids, tokens, samples,
        tokens_per_s  {variant: median tokens/s}; mfu {variant: fraction or null};
        flops_per_token  {variant: model FLOPs per real token}; peak_memory_bytes {variant: bytes or null}

    drafter_step    the drafter's training step (or null): shape, backend, batch_size, sequence_length,
        num_anchors, tokens_per_s, flops_per_token (`planning.training_split.drafter_flops_per_token`), mfu

Variants: `anchors`, `forward`, `capture`, `extraction` (with writes, bf16) and `extraction_fp8`. The
plan scales a measured extraction rate to the configured target by FLOPs per token (same device, same
kind of architecture), so the shapes measured need not be the target's own; the training split takes
`forward` (online training's target side) and `drafter_step` the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_assets.planning.saved_result import load_result, save_result

GPU_RESULT_FORMAT = "dflash-assets.gpu-bench/1"
GPU_RESULT_NAME = "gpu-bench.json"


def gpu_result_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "bench" / GPU_RESULT_NAME


def save_gpu_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Write `result` (the fields above, less `format` and `measured_at`) atomically to `path`."""
    return save_result(path, GPU_RESULT_FORMAT, result)


def load_gpu_result(path: str | Path) -> dict[str, Any] | None:
    """The saved result, or None when there is none (or it is not this format)."""
    return load_result(path, GPU_RESULT_FORMAT)
