"""Conversations as long as reasoning targets write them, through capture, the store, offline training,
the evaluation and the export, on a target of its own with 32 K positions: nothing cut below the configured
length, objects of the planned size, memory bounded by chunks rather than by the context's square."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model_card import drafter_model_card
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.object_size import sample_object_nbytes
from dflash_assets.extraction.sample_format import read_sample
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OfflineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    MASK_TOKEN_ID,
    VOCAB_SIZE,
    write_hidden_state_partition,
)

LAYER_IDS = [1, 2]
GIB = 2**30


def long_context_target(directory: Path) -> Path:
    """A 4-layer hybrid target of the real family with 32,768 positions."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=32768, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def resident_peak_growth(work: Callable[[], None]) -> int:
    """The most this process's resident memory grew above where it was while `work` ran (sampled every
    20 ms): what the kernel's out-of-memory killer judges, allocator caches and all."""

    def resident() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    start, peak, done = resident(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident() - start)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        work()
    finally:
        done.set()
        watcher.join()
    return peak[0]


def two_turn_conversation(index: int, tokens: int, seed: int) -> TokenizedSample:
    """user, assistant, user, assistant: the second question begins past 8 K tokens, so its prompt (every
    token before the last answer) is a long context."""
    rng = random.Random(seed)
    turns = [(0, 300), (1, 8000), (0, 200), (1, tokens - 8500)]
    ids, mask = [], []
    for labelled, length in turns:
        ids += [rng.randrange(1, VOCAB_SIZE - 1) for _ in range(length)]
        mask += [labelled] * length
    return TokenizedSample(sample_index=index, input_ids=ids, loss_mask=mask)


@pytest.mark.slow  # conversations of 12-13 K tokens through a target and a drafter on the CPU
def test_conversations_of_12k_tokens_are_captured_whole_trained_on_and_measured_by_context_length(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    target_dir = long_context_target(tmp_path / "target")
    samples = [two_turn_conversation(0, 12_800, seed=1), two_turn_conversation(1, 12_300, seed=2)]
    store = open_store(str(tmp_path / "store"))
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    objects = write_hidden_state_partition(
        store, "00000000-00000099", samples, HiddenStateCapture(model, LAYER_IDS), str(target_dir),
        tmp_path / "scratch", target_layer_ids=LAYER_IDS,
    )  # fmt: skip

    # Every token stored, in an object of the size the plan computes.
    for sample, (key, size) in zip(samples, objects, strict=True):
        stored = read_sample(store.get_bytes(key))
        assert stored.num_tokens == sample.num_tokens and stored.input_ids.tolist() == sample.input_ids
        assert size == sample_object_nbytes(
            sample_index=sample.sample_index, num_tokens=sample.num_tokens, target_layer_ids=LAYER_IDS,
            target_model=str(target_dir), hidden_size=64, dtype="bf16",
        )  # fmt: skip

    config = DrafterConfig.from_target(
        target_dir, num_layers=2, target_layer_ids=LAYER_IDS, mask_token_id=MASK_TOKEN_ID
    )
    assert config.max_position_embeddings == 32768
    settings = TrainSettings(
        mode="offline", max_steps=1, global_batch_size=1, max_length=20480, eval_samples=1,
        spec_eval_prompts=1, spec_eval_max_new_tokens=4, checkpoint_every_minutes=None,
    )  # fmt: skip
    data = OfflineData(store, objects, tmp_path / "cache", num_tokens=[s.num_tokens for s in samples])
    results = []

    def train() -> None:
        results.append(
            train_drafter(config, settings, data, store=store, run="long", work_dir=tmp_path / "w")
        )

    # 512 anchors over a 12 K context: the materialised scores of one layer alone are 1.6 GB, and a step
    # kept three such tensors a layer (the run was killed for memory in its first evaluation);
    # run a chunk of blocks at a time, training and both evaluations stay within a gigabyte and a half.
    peak = resident_peak_growth(train)
    assert peak < 1.5 * GIB, peak / GIB
    result = results[0]
    assert result.steps == 1 and result.eval is not None and result.eval["num_tokens"] > 12_000

    # The held-out prompt (every token before its last answer) is past 8 K: its own bucket, one prompt.
    by_length = result.speculative["by_context_length"]
    assert list(by_length) == ["8k_32k"] and by_length["8k_32k"]["prompts"] == 1
    assert result.speculative["mismatched"] == []
    card = drafter_model_card(
        config, run="long", target_model_name="t", trained_sample_ranges=[], partitions=[], steps=1,
        metrics={"tau_by_context_length": by_length},
    )  # fmt: skip
    assert "tau measured on prompts of 8K-32K tokens" in card and "too few to mean anything" in card
