"""Starting from a drafter that already exists (one z-lab published, one a user downloaded, an earlier
export): its directory in z-lab's layout read, checked against this run's configuration, and its weights
loaded as the initial ones (`DFLASH_DRAFTER_INIT`).

The check compares what decides whether the weights mean anything here: the architecture, the target
layers read, the mask token, the block size and every width. A difference is one line naming both
values and the setting that makes this run's; nothing is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.storage.layout import CONFIG_NAME, WEIGHTS_NAME

INIT_SETTING = "DFLASH_DRAFTER_INIT"
INDEX_NAME = "model.safetensors.index.json"

# Each field a published drafter must share with the run, and what sets the run's.
MATCHED_FIELDS = (
    ("arch", "DFLASH_DRAFTER_ARCH"),
    ("target_layer_ids", "DFLASH_TARGET_LAYER_IDS"),
    ("mask_token_id", "DFLASH_MASK_TOKEN_ID"),
    ("block_size", "DFLASH_BLOCK_SIZE"),
    ("num_layers", "DFLASH_NUM_DRAFT_LAYERS"),
    ("hidden_size", "the target model"),
    ("vocab_size", "the target model"),
    ("num_heads", "DFLASH_DRAFTER_SHAPE"),
    ("num_kv_heads", "DFLASH_DRAFTER_SHAPE"),
    ("head_dim", "DFLASH_DRAFTER_SHAPE"),
    ("intermediate_size", "DFLASH_DRAFTER_SHAPE"),
    ("layer_types", "DFLASH_DRAFTER_SHAPE"),
    ("sliding_window", "DFLASH_DRAFTER_SHAPE"),
)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DrafterInitError(ValueError):
    """The drafter `DFLASH_DRAFTER_INIT` names cannot start this run: missing, unreadable, or made for
    another configuration. One line, naming what differs."""


def read_drafter_config(directory: str | Path) -> DrafterConfig:
    path = Path(directory).expanduser() / CONFIG_NAME
    if not path.is_file():
        raise DrafterInitError(
            f"{INIT_SETTING}={directory}: no {CONFIG_NAME} there (a drafter directory in z-lab's layout: "
            f"{CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    try:
        return DrafterConfig.from_reference_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as error:
        raise DrafterInitError(
            f"{INIT_SETTING}={directory}: {path} is not a DFlash drafter config ({error})"
        ) from None


def check_initial_drafter(config: DrafterConfig, directory: str | Path) -> DrafterConfig:
    """The published drafter's config, when it matches `config` field for field (else `DrafterInitError`)."""
    theirs = read_drafter_config(directory)
    fields = MATCHED_FIELDS + (
        tuple((name, "the DFlash2 shape") for name in DFLASH2_FIELDS) if config.arch == "dflash2" else ()
    )
    for name, setting in fields:
        mine, published = getattr(config, name), getattr(theirs, name)
        if mine != published:
            raise DrafterInitError(
                f"{INIT_SETTING}={directory} has {name} {published!r} where this run's drafter has {mine!r} "
                f"(set by {setting}): start from a drafter made for this configuration, or change the run's"
            )
    return theirs


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's `model.safetensors`, or of the shards its index names."""
    directory = Path(directory).expanduser()
    if (directory / INDEX_NAME).is_file():
        files = sorted(set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        raise DrafterInitError(f"{INIT_SETTING}={directory}: neither {WEIGHTS_NAME} nor {INDEX_NAME} there")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (not a dict)
                tensors[key] = handle.get_tensor(key)
    return tensors


def load_initial_weights(model: torch.nn.Module, directory: str | Path) -> str:
    """Check the drafter at `directory` against `model.config` and copy its weights into `model` (every
    weight, named and shaped as the model's: none missing, none left over). Returns a line for the log."""
    check_initial_drafter(model.config, directory)
    tensors = read_weights(directory)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise DrafterInitError(
            f"{INIT_SETTING}={directory}: its weights do not match its config (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise DrafterInitError(
                f"{INIT_SETTING}={directory}: weight {name} has shape {list(tensor.shape)} where this run's "
                f"drafter has {list(own[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)
    count = sum(t.numel() for t in tensors.values())
    arch = model.config.arch
    return f"initial weights from {directory}: {len(tensors)} tensors, {count:,} parameters ({arch})"
