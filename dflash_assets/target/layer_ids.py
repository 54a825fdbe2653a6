"""Which target decoder layers a drafter reads: DFlash's evenly spaced rule, or an explicit list.

"Layer i" is the raw output of decoder layer i (0-based) = Hugging Face `output_hidden_states[i + 1]`.

The last decoder layer (N-1) is never a target layer: Hugging Face's `hidden_states[N]` is its output
after the model's final norm, and SGLang and vLLM capture a layer's output as the input of the next one
("before layer i + 1"), which never runs for the last layer. A drafter trained on it would be served
something else, or nothing. The rule below ends at N-3; only k = 1 on a target of at most 2 layers would
reach N-1, and that is refused like an explicit list naming it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

LAYER_IDS_SETTING = "DFLASH_TARGET_LAYER_IDS"


def dflash_target_layer_ids(num_hidden_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash's rule: k layers evenly spaced from layer 1 to N-3, `round(1 + i*(N-4)/(k-1))`, and the
    middle layer `N // 2` for k = 1.

    Python's `round` (half to even) on the same float expression as z-lab/dflash, SGLang and vLLM, so a
    drafter trained here reads the layers the engines capture: N=64, k=5 -> [1, 16, 31, 46, 61];
    N=10, k=5 -> [1, 2, 4, 6, 7] (2.5 and 5.5 round to even).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        ids = [num_hidden_layers // 2]
    else:
        span = num_hidden_layers - 4
        ids = [int(round(1 + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    if num_hidden_layers > 1 and ids[-1] == num_hidden_layers - 1:  # only k = 1 on a 2-layer target
        reason = last_layer_reason(num_hidden_layers, explicit=False)
        raise ValueError(f"the DFlash rule gives {ids} for {num_draft_layers} draft layer: {reason}")
    increasing = all(a < b for a, b in zip(ids, ids[1:], strict=False))
    if not increasing or ids[-1] >= num_hidden_layers - 1 or ids[0] < 0:
        raise ValueError(
            f"a model with {num_hidden_layers} decoder layers is too shallow for {num_draft_layers} evenly "
            f"spaced target layers (the rule gives {ids}); set {LAYER_IDS_SETTING} explicitly or use fewer "
            "draft layers"
        )
    return ids


def last_layer_reason(num_layers: int, *, explicit: bool = True) -> str:
    """Why the last decoder layer cannot be a target layer, and what to set instead."""
    last = num_layers - 1
    instead = f"Set {LAYER_IDS_SETTING} to layers in 0..{last - 1}"
    if explicit and num_layers >= 4:
        instead += f" (the DFlash rule ends at N-3 = {num_layers - 3}), or leave it empty for the rule"
    return (
        f"layer {last} is the last of the target's {num_layers} decoder layers, which a drafter cannot be "
        f"served: Hugging Face's hidden_states[{num_layers}] is its output after the final norm, not its "
        f"raw output, and SGLang and vLLM capture a layer as the input of the next one ('before layer "
        f"{num_layers}'), which never runs. {instead}"
    )


def parse_layer_ids(text: str) -> list[int]:
    """`"1,16,31"`, `"1 16 31"` or `"[1, 16, 31]"` -> `[1, 16, 31]`."""
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        stripped = stripped[1:-1]
    parts = [part for part in re.split(r"[,\s]+", stripped) if part]
    if not parts:
        raise ValueError(f"{LAYER_IDS_SETTING}={text!r} names no layers; expected e.g. '1,16,31,46,61'")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(
            f"{LAYER_IDS_SETTING}={text!r} is not a list of integers; expected e.g. '1,16,31,46,61'"
        ) from None


def resolve_target_layer_ids(
    model_config: Any, explicit: Sequence[int] | None, num_draft_layers: int = 5
) -> list[int]:
    """The layers to capture, checked against the model's depth before anything touches a device.

    `model_config` is a transformers config or the parsed `config.json` dict.
    """
    from dflash_assets.target.model import num_decoder_layers  # torch: not for parsing a setting

    num_layers = num_decoder_layers(model_config)
    if explicit is None:
        return dflash_target_layer_ids(num_layers, num_draft_layers)
    layer_ids = [int(i) for i in explicit]
    if not layer_ids:
        raise ValueError(f"{LAYER_IDS_SETTING} names no layers")
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_layers:
            raise ValueError(
                f"{LAYER_IDS_SETTING} names layer {layer_id}, but the target model has {num_layers} decoder "
                f"layers (valid ids 0..{num_layers - 2}; layer i is the raw output of decoder layer i)"
            )
        if layer_id == num_layers - 1:
            raise ValueError(f"{LAYER_IDS_SETTING}={layer_ids}: {last_layer_reason(num_layers)}")
    for previous, current in zip(layer_ids, layer_ids[1:], strict=False):
        if current <= previous:
            raise ValueError(
                f"{LAYER_IDS_SETTING}={layer_ids} must be strictly increasing without repeats (layer "
                f"{current} follows {previous}): the stored [:, j] order is the layer order, and the "
                "drafter's input width counts each layer once"
            )
    return layer_ids
