"""The drafter as the engines load it: a model directory in the reference layout, and reading it back.

The directory also loads with `transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)`:
`config.json` carries an `auto_map` to `modeling_dflash.py`, copied in beside the weights.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_assets.drafter.config import DrafterConfig, load_target_embeddings
from dflash_assets.drafter.model import DFlashDrafter, drafter_class
from dflash_assets.drafter.weights_file import save_weights
from dflash_assets.storage.layout import CONFIG_NAME, MODEL_CARD_NAME, WEIGHTS_NAME

MODELING_FILE = Path(__file__).with_name("modeling_dflash.py")  # torch + transformers only
EXPORT_DTYPE = torch.bfloat16  # the weights' dtype in `model.safetensors`, as the published drafters ship


@contextlib.contextmanager
def weights_as_exported(model: DFlashDrafter) -> Iterator[DFlashDrafter]:
    """`model` with its weights rounded to the export's dtype for the block, as `load_drafter` gives them
    back from its export; restored exactly after (a host copy of the drafter's own weights: the shared
    embedding and LM head are not exported and not touched). So a measurement made here during training
    is the one made later on the export: on a CPU, where the export loads in float32, the same number."""
    floating = {name: t for name, t in model.state_dict().items() if t.is_floating_point()}
    saved = {name: t.detach().to("cpu", copy=True) for name, t in floating.items()}
    with torch.no_grad():
        for tensor in floating.values():
            tensor.copy_(tensor.to(EXPORT_DTYPE))
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, tensor in floating.items():
                tensor.copy_(saved[name])


def auto_map(config: DrafterConfig) -> dict[str, str]:
    """`config.json`'s `auto_map`: the class of `modeling_dflash.py` named as the architecture."""
    return {"AutoModel": f"{MODELING_FILE.stem}.{config.architecture}"}


def export_drafter(
    model: DFlashDrafter,
    directory: str | Path,
    *,
    dtype: torch.dtype = EXPORT_DTYPE,
    provenance: dict[str, Any] | None = None,
    model_card: str | None = None,
) -> Path:
    """Write the drafter as the engines load it: `config.json` (Qwen3 config with `architectures:
    ["DFlashDraftModel"]` or `["DFlash2DraftModel"]`, `block_size`, `num_target_layers`, `dflash_config`,
    and an `auto_map` for `AutoModel` with `trust_remote_code`), `model.safetensors` with the reference
    weight names in `dtype` (bfloat16), `modeling_dflash.py`, and a model card `README.md`.

    The weights are the drafter's own, like the published drafters: the shared embedding and LM head
    stay in the target checkpoint. `provenance` is merged into the config's `dflash_assets` block.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = replace(model.config, extra={**model.config.extra, **(provenance or {})})
    save_weights(model.state_dict(), directory / WEIGHTS_NAME, dtype=dtype, metadata={"format": "pt"})
    if model_card is not None:
        (directory / MODEL_CARD_NAME).write_text(model_card)
    shutil.copyfile(MODELING_FILE, directory / MODELING_FILE.name)
    reference = {**config.to_reference_dict(), "auto_map": auto_map(config)}
    (directory / CONFIG_NAME).write_text(json.dumps(reference, indent=2) + "\n")  # last: marks it complete
    return directory


def load_drafter(
    directory: str | Path,
    *,
    target_model: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """An exported drafter, ready to run. `target_model` overrides where the shared embedding and LM
    head come from (e.g. the target moved to another path); by default the export's recorded path."""
    directory = Path(directory)
    config = DrafterConfig.load(directory)
    source = target_model or config.target_model
    if not source:
        raise ValueError(
            f"{directory} names no target model for the shared embedding and LM head; pass target_model= "
            "(the target checkpoint the drafter was trained for)"
        )
    embedding, lm_head = load_target_embeddings(source)
    model = drafter_class(config)(config, embedding, lm_head)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    missing = sorted(set(model.state_dict()) - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_NAME} does not match its config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}"
        )
    model.load_state_dict({name: tensor.to(dtype) for name, tensor in tensors.items()}, strict=True)
    return model.to(device=device, dtype=dtype)
