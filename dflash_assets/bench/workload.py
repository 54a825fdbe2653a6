"""The CPU benchmark's workload: the demo target and the bundled conversations, tokenized."""

from __future__ import annotations

from pathlib import Path

from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.tokenize import tokenize_range
from dflash_assets.target.layer_ids import dflash_target_layer_ids

TOKEN_BUDGET = 4096


def demo_samples(model_dir: Path, count: int) -> list[TokenizedSample]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = tokenize_range(tokenizer, str(bundled_dataset_path()), SampleRange(0, count - 1))
    return result.samples


def demo_layer_ids(model) -> list[int]:
    return dflash_target_layer_ids(model.config.num_hidden_layers, 5)
