"""FP8 hidden states, measured: how far e4m3 with a scale per (token, layer) is from the same capture,
layer by layer, and what it does to a drafter trained on it.

On the demo target and the bundled conversations, as `dflash-assets demo` trains: the samples are
captured once and stored both ways; per layer, the relative error `||stored - captured|| / ||captured||`
of bf16 and of fp8 objects against the float32 capture (on a GPU the capture itself is bf16, and both are
measured against it). Then the same ranges are extracted into two stores, one per dtype, and a drafter
is trained offline on each for the same steps from the same seed: held-out loss, teacher-forced and
measured tau (speculative decoding with the target) side by side with the freshly initialised drafter's.
(The extraction throughput fp8 / bf16 is in `bench.extraction`, measured in the same interleaved rounds
as the other extraction figures.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from dflash_assets import settings
from dflash_assets.bench.workload import TOKEN_BUDGET, demo_layer_ids, demo_samples
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.fp8 import encode_states
from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.batching import pad_batch, plan_batches
from dflash_assets.target.demo_model import ensure_demo_model
from dflash_assets.target.model import load_target_model

DTYPES = ("bf16", "fp8")


def per_layer_errors(model, samples: list[TokenizedSample], layer_ids: list[int]) -> dict[str, list[float]]:
    """Relative error of each stored dtype against the capture, per layer, over every real token."""
    capture = HiddenStateCapture(model, layer_ids)
    error = {dtype: torch.zeros(len(layer_ids), dtype=torch.float64) for dtype in DTYPES}
    norm = torch.zeros(len(layer_ids), dtype=torch.float64)
    for batch in plan_batches([s.num_tokens for s in samples], TOKEN_BUDGET):
        input_ids, attention_mask = pad_batch([samples[i].input_ids for i in batch], 0)
        captured = capture(input_ids, attention_mask)
        real = attention_mask.bool().to(captured.device)
        reference = captured[real].double()  # [tokens, K, H]
        norm += reference.pow(2).sum(dim=(0, 2)).cpu()
        for dtype in DTYPES:
            stored = encode_states(captured, dtype).dequantize(torch.float64)[real]
            error[dtype] += (stored - reference).pow(2).sum(dim=(0, 2)).cpu()
    return {dtype: (error[dtype] / norm).sqrt().tolist() for dtype in DTYPES}


def _extract(model, samples, layer_ids, store, dtype: str, staging: Path) -> list[tuple[str, int]]:
    from dflash_assets.extraction.extract import extract_range

    prefix = f"{HIDDEN_STATES_PREFIX}/fidelity-{dtype}"
    with Uploader(store, staging_budget_bytes=256 * 2**20) as uploader:
        extract_range(
            model=model,
            target_model_name="fidelity",
            samples=samples,
            target_layer_ids=layer_ids,
            store=store,
            prefix=prefix,
            staging_dir=staging,
            uploader=uploader,
            device=str(next(model.parameters()).device),
            max_tokens_per_batch=TOKEN_BUDGET,
            log=lambda message: None,
            hidden_state_dtype=dtype,
        )
    return [(info.key, info.size) for info in store.list(f"{prefix}/hs_")]


def bench_fidelity(count: int, steps: int) -> dict[str, float]:
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.training.data import OfflineData
    from dflash_assets.training.settings import TrainSettings
    from dflash_assets.training.train import train_drafter

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, device)
    samples = demo_samples(model_dir, count)
    layer_ids = demo_layer_ids(model)
    print(f"fidelity: demo target, {len(samples)} samples, drafters trained {steps} steps on each dtype")
    errors = per_layer_errors(model, samples, layer_ids)
    for slot, layer in enumerate(layer_ids):
        bf16, fp8 = errors["bf16"][slot], errors["fp8"][slot]
        print(f"  layer {layer:2d}: relative error, bf16 {bf16:.4f}, fp8 {fp8:.4f}")
    config = DrafterConfig.from_target(model_dir, target_layer_ids=layer_ids)
    config.extra["target_model_name"] = "fidelity"
    # As `dflash-assets demo` trains: 4 sequences a step, the recipe's learning rate and evaluations.
    train = TrainSettings(
        mode="offline",
        max_steps=steps,
        global_batch_size=4,
        checkpoint_every_steps=None,
        checkpoint_every_minutes=None,
        log_every_steps=max(1, steps),
        device=device,
    )
    results, stored = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(str(Path(tmp) / "store"))
        for dtype in DTYPES:
            objects = _extract(model, samples, layer_ids, store, dtype, Path(tmp) / f"staging-{dtype}")
            stored[dtype] = sum(size for _, size in objects)
            data = OfflineData(
                store, objects, Path(tmp) / f"cache-{dtype}", hidden_state_dtypes=[dtype] * len(objects)
            )
            results[dtype] = train_drafter(
                config, train, data, store=store, run=dtype, work_dir=Path(tmp) / dtype
            )
            print(
                f"  {dtype}: held-out loss {results[dtype].eval['loss']:.3f}, tau measured "
                f"{results[dtype].acceptance_length_tau:.3f}",
                flush=True,
            )
    # Both runs start from the same seed: the same fresh drafter, evaluated once per run on the same data.
    baseline = results["bf16"].baseline or {}
    figures = {
        "fresh drafter: held-out loss": (baseline.get("teacher_forced") or {}).get("loss"),
        "fresh drafter: tau measured": (baseline.get("speculative") or {}).get("tau"),
    }
    for dtype, result in results.items():
        figures[f"{dtype} drafter: held-out loss"] = (result.eval or {}).get("loss")
        figures[f"{dtype} drafter: tau measured"] = result.acceptance_length_tau
        figures[f"{dtype} drafter: tau teacher-forced"] = result.teacher_forced_tau
        speculative = result.speculative or {}
        figures[f"{dtype} drafter: decodes as the target (1 = every prompt)"] = float(
            bool(speculative.get("prompts")) and not speculative.get("mismatched")
        )
    for slot, layer in enumerate(layer_ids):
        figures[f"layer {layer}: relative error of bf16 objects"] = errors["bf16"][slot]
        figures[f"layer {layer}: relative error of fp8 objects"] = errors["fp8"][slot]
    figures["stored bytes, fp8 / bf16"] = stored["fp8"] / stored["bf16"]
    return {name: float(value) for name, value in figures.items() if value is not None}
