"""Training figures: offline training streaming from the store vs the same training on tensors in
memory, and offline vs online tokens/s."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_assets import settings, terminal
from dflash_assets.bench.workload import demo_layer_ids, demo_samples
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.demo_model import ensure_demo_model
from dflash_assets.target.model import load_target_model


class _InMemoryHiddenStates:
    """Hidden states already in memory, looked up by a sample's tokens: training with no data path."""

    def __init__(self, samples: Sequence, hidden: Sequence[torch.Tensor]):
        self.by_tokens = {tuple(s.input_ids): h for s, h in zip(samples, hidden, strict=True)}

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            length = sum(mask)
            hidden = self.by_tokens[tuple(ids[:length])].float()
            rows.append(torch.nn.functional.pad(hidden, (0, 0, 0, 0, 0, len(ids) - length)))
        return torch.stack(rows)


def bench_training(count: int, steps: int, rounds: int) -> dict[str, float]:
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.extraction.extract import extract_range
    from dflash_assets.extraction.sample_format import read_sample
    from dflash_assets.training.data import OfflineData, OnlineData
    from dflash_assets.training.settings import TrainSettings
    from dflash_assets.training.train import train_drafter

    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, "cuda:0" if torch.cuda.is_available() else "cpu")
    samples = demo_samples(model_dir, count)
    layer_ids = demo_layer_ids(model)
    config = DrafterConfig.from_target(model_dir, target_layer_ids=layer_ids)
    config.extra["target_model_name"] = "bench"
    train_settings = dict(
        max_steps=steps,
        checkpoint_every_steps=None,
        checkpoint_every_minutes=None,
        eval_samples=0,  # throughput only: no held-out evaluation inside the timed run
        spec_eval_prompts=0,
        log_every_steps=steps,
        num_anchors=64,
        global_batch_size=8,
        device=str(next(model.parameters()).device),
    )
    print(f"training: {len(samples)} samples, {steps} steps per measurement, {rounds} interleaved rounds")
    offline_ratio, online_rates, offline_rates = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(str(Path(tmp) / "store"))
        with Uploader(store, staging_budget_bytes=64 * 2**20) as uploader:
            extract_range(
                model=model,
                target_model_name="bench",
                samples=samples,
                target_layer_ids=layer_ids,
                store=store,
                prefix=f"{HIDDEN_STATES_PREFIX}/bench",
                staging_dir=Path(tmp) / "staging",
                uploader=uploader,
                device=train_settings["device"],
                log=lambda message: None,
            )
        objects = [(i.key, i.size) for i in store.list(f"{HIDDEN_STATES_PREFIX}/bench/hs_")]
        in_memory = _InMemoryHiddenStates(
            samples, [read_sample(store.get_bytes(k)).hidden_states for k, _ in objects]
        )

        progress = terminal.TaskProgress("bench training", rounds * 3, "trainings")

        def rate(mode: str, data, run: str) -> float:
            progress.set_status(run)
            result = train_drafter(
                config,
                TrainSettings(mode=mode, **train_settings),
                data,
                store=store,
                run=run,
                work_dir=Path(tmp) / run,
                log=lambda message: None,
            )
            progress.advance()
            return result.tokens_per_second

        for round_index in range(rounds):
            from_store = rate(
                "offline",
                OfflineData(
                    store=store,
                    objects=objects,
                    cache_dir=Path(tmp) / f"c{round_index}",
                    cache_budget_bytes=8 * 2**20,
                ),
                f"offline-{round_index}",
            )
            from_memory = rate(
                "online", OnlineData(samples=samples, target_hidden_states=in_memory), f"memory-{round_index}"
            )
            online = rate(
                "online",
                OnlineData(samples=samples, target_hidden_states=HiddenStateCapture(model, layer_ids)),
                f"online-{round_index}",
            )
            offline_ratio.append(from_store / from_memory)
            offline_rates.append(from_store)
            online_rates.append(online)
        progress.finish()
    return {
        "training tokens/s streaming from the store / tensors in memory (target >= 0.9)": statistics.median(
            offline_ratio
        ),
        "training tokens/s, offline (from the store)": statistics.median(offline_rates),
        "training tokens/s, online (target beside the trainer)": statistics.median(online_rates),
    }
