"""`dflash-assets bench`: throughput and memory ratios, each measured within one run.

The machine may be shared and noisy, so every figure is a ratio of two measurements taken side by
side, interleaved over several rounds, and the median round is reported. Nothing here asserts: the
README records the figures and the targets they are read against.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from dflash_assets import settings
from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.tokenize import tokenize_range
from dflash_assets.extraction.batching import pad_batch, padding_fraction
from dflash_assets.extraction.capture import HiddenStateCapture, dflash_target_layer_ids, load_target_model
from dflash_assets.storage.moto_server import moto_available, start_moto_server
from dflash_assets.storage.store import open_store
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.demo_model import ensure_demo_model

ANCHOR_BATCH_SIZE = 8  # the public pipelines' way: fixed-size batches in dataset order
TOKEN_BUDGET = 4096


def _demo_samples(model_dir: Path, count: int) -> list[TokenizedSample]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = tokenize_range(tokenizer, str(bundled_dataset_path()), SampleRange(0, count - 1))
    return result.samples


def _layer_ids(model) -> list[int]:
    return dflash_target_layer_ids(model.config.num_hidden_layers, 5)


def _ours(model, samples: Sequence[TokenizedSample], layer_ids: list[int], to_host: bool = True):
    """Capture with early stop over length-bucketed batches, exactly as extraction captures: with
    `to_host`, each batch also goes to the host as bf16 through extraction's own `HostTransfer` (capture
    alone); without, nothing leaves the device (the forward alone). Returns (real tokens, padding)."""
    from dflash_assets.bench.gpu import run_capture

    padding = run_capture(model, samples, layer_ids, to_host, TOKEN_BUDGET)
    return sum(s.num_tokens for s in samples), padding


def _anchors(model, samples: Sequence[TokenizedSample], layer_ids: list[int]) -> tuple[int, float]:
    """Full forward with output_hidden_states=True (LM head included) over dataset-order batches."""
    lengths = [s.num_tokens for s in samples]
    batches = [
        list(range(i, min(i + ANCHOR_BATCH_SIZE, len(samples))))
        for i in range(0, len(samples), ANCHOR_BATCH_SIZE)
    ]
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch in batches:
            input_ids, mask = pad_batch([samples[i].input_ids for i in batch], 0)
            out = model(input_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            stacked = torch.stack([out.hidden_states[i + 1] for i in layer_ids], dim=2)
            for row, i in enumerate(batch):
                stacked[row, : lengths[i]].to(torch.bfloat16).cpu()
    return sum(lengths), padding_fraction(batches, lengths)


def _timed(fn: Callable[[], tuple[int, float]]) -> tuple[float, float]:
    start = time.perf_counter()
    tokens, padding = fn()
    return tokens / (time.perf_counter() - start), padding


def _extract_with_io(
    model, samples, layer_ids, store_url: str, staging: Path, budget: int
) -> tuple[float, int]:
    from dflash_assets.extraction.extract import extract_range

    store = open_store(store_url)
    with Uploader(store, max_in_flight=16, staging_budget_bytes=budget) as uploader:
        start = time.perf_counter()
        result = extract_range(
            model=model,
            target_model_name="bench",
            samples=samples,
            target_layer_ids=layer_ids,
            store=store,
            prefix=f"hidden-states/bench-{time.monotonic_ns()}",
            staging_dir=staging,
            uploader=uploader,
            device=str(next(model.parameters()).device),
            max_tokens_per_batch=TOKEN_BUDGET,
            log=lambda message: None,
            progress_every_s=3600,
        )
        elapsed = time.perf_counter() - start
    return result.tokens / elapsed, result.peak_staging_bytes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_memory_child(way: str, model_dir: str, count: int) -> None:
    """In a fresh process: peak memory above the loaded model while extracting one way (GPU: allocator
    peak; CPU: resident set, sampled every millisecond)."""
    import threading

    model = load_target_model(Path(model_dir), "cuda:0" if torch.cuda.is_available() else "cpu")
    samples = _demo_samples(Path(model_dir), count)
    layer_ids = _layer_ids(model)
    run = _ours if way == "ours" else _anchors
    run(model, samples[:4], layer_ids)  # warm-up, so lazy initialisation is not counted
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(model, samples, layer_ids)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base, samples_rss, done = _rss_bytes(), [0], threading.Event()

        def sample_rss() -> None:
            while not done.is_set():
                samples_rss.append(_rss_bytes())
                time.sleep(0.001)

        watcher = threading.Thread(target=sample_rss, daemon=True)
        watcher.start()
        run(model, samples, layer_ids)
        done.set()
        watcher.join()
        peak = max(samples_rss) - base
    print(json.dumps({"peak_bytes": peak}))


def _peak_memory(way: str, model_dir: Path, count: int) -> int:
    code = (
        "import sys; from dflash_assets.bench.run import _peak_memory_child as f; "
        "f(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, way, str(model_dir), str(count)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak_bytes"])


def _moto_store() -> tuple[str, Callable[[], None]] | None:
    """An S3 server on loopback when moto is installed (the test extra), so 'upload' means HTTP."""
    if not moto_available():
        return None
    import boto3

    server = start_moto_server()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint_url
    boto3.client("s3").create_bucket(Bucket="bench")
    return "s3://bench/run", server.stop


WITH_WRITES_FIGURE = "extraction with writes (local store) / capture alone (target >= 0.9)"


def bench_extraction(count: int, rounds: int) -> dict[str, float]:
    """Every variant runs the same samples through the same `HiddenStateCapture` and batches; the
    variants take turns within each round (reversed every other round, so drift cancels) and each
    figure is the median round's ratio."""
    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, "cuda:0" if torch.cuda.is_available() else "cpu")
    samples = _demo_samples(model_dir, count)
    layer_ids = _layer_ids(model)
    print(
        f"extraction: demo target ({model.config.num_hidden_layers} layers, layers {layer_ids}), "
        f"{len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens, {rounds} interleaved rounds"
    )
    _ours(model, samples[:8], layer_ids), _anchors(model, samples[:8], layer_ids)  # warm-up

    budget = 4 * 2**20
    speedups, local_ratios, local_vs_forward, s3_ratios, peaks, cpu_ratios = [], [], [], [], [], []
    ours_padding = anchor_padding = 0.0
    moto = _moto_store()
    # Capture alone and with writes run back to back in every round, so they see the same load.
    kinds = ["anchors", "forward", "capture", "local"] + (["s3"] if moto else [])
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            rate: dict[str, float] = {}
            cpu: dict[str, float] = {}  # process CPU seconds (every thread): load elsewhere hardly moves it
            for kind in kinds if round_index % 2 == 0 else reversed(kinds):
                cpu_started = time.process_time()
                if kind in ("local", "s3"):
                    url = moto[0] if kind == "s3" else str(Path(tmp) / f"store-{round_index}")
                    staging = Path(tmp) / f"staging-{kind}-{round_index}"
                    rate[kind], peak = _extract_with_io(model, samples, layer_ids, url, staging, budget)
                    peaks.append(peak)
                elif kind == "anchors":
                    rate[kind], anchor_padding = _timed(partial(_anchors, model, samples, layer_ids))
                else:
                    to_host = kind == "capture"
                    rate[kind], ours_padding = _timed(partial(_ours, model, samples, layer_ids, to_host))
                cpu[kind] = time.process_time() - cpu_started
            speedups.append(rate["capture"] / rate["anchors"])
            local_ratios.append(rate["local"] / rate["capture"])
            local_vs_forward.append(rate["local"] / rate["forward"])
            cpu_ratios.append(cpu["capture"] / cpu["local"])
            if moto:
                s3_ratios.append(rate["s3"] / rate["capture"])
            print(
                f"  round {round_index + 1}: tokens/s forward alone {rate['forward']:,.0f}, capture alone "
                f"{rate['capture']:,.0f}, with writes {rate['local']:,.0f}"
                + (f", with S3 uploads {rate['s3']:,.0f}" if moto else "")
                + f", anchors' way {rate['anchors']:,.0f}; CPU s capture {cpu['capture']:.2f}, "
                f"with writes {cpu['local']:.2f}",
                flush=True,
            )
    if moto:
        moto[1]()
    memory_ours = _peak_memory("ours", model_dir, count)
    memory_anchor = _peak_memory("anchors", model_dir, count)
    figures = {
        "capture tokens/s, ours / anchors' way (target >= 1.0)": statistics.median(speedups),
        WITH_WRITES_FIGURE: statistics.median(local_ratios),
        "extraction with writes (local store) / forward alone": statistics.median(local_vs_forward),
        # The same comparison in process CPU time (capture's ÷ with writes'): what the writes cost in
        # work, which other processes' load on a shared machine hardly moves. A cross-check of the above.
        "CPU time, capture alone / extraction with writes (local store)": statistics.median(cpu_ratios),
    }
    if s3_ratios:
        figures["extraction with uploads to S3 on loopback / capture alone"] = statistics.median(s3_ratios)
    figures.update(
        {
            "padding fraction, ours (target <= 0.05)": ours_padding,
            "padding fraction, anchors' way": anchor_padding,
            "peak extra memory, ours / anchors' way (lower is better)": memory_ours / max(memory_anchor, 1),
            "staging high-water / budget (must be <= 1.0)": max(peaks) / budget,
        }
    )
    return figures


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
    from dflash_assets.drafter.model import DrafterConfig
    from dflash_assets.extraction.extract import extract_range
    from dflash_assets.extraction.sample_format import read_sample
    from dflash_assets.training.train import OfflineData, OnlineData, TrainSettings, train_drafter

    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, "cuda:0" if torch.cuda.is_available() else "cpu")
    samples = _demo_samples(model_dir, count)
    layer_ids = _layer_ids(model)
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
                prefix="hidden-states/bench",
                staging_dir=Path(tmp) / "staging",
                uploader=uploader,
                device=train_settings["device"],
                log=lambda message: None,
            )
        objects = [(i.key, i.size) for i in store.list("hidden-states/bench/hs_")]
        in_memory = _InMemoryHiddenStates(
            samples, [read_sample(store.get_bytes(k)).hidden_states for k, _ in objects]
        )

        def rate(mode: str, data, run: str) -> float:
            result = train_drafter(
                config,
                TrainSettings(mode=mode, **train_settings),
                data,
                store=store,
                run=run,
                work_dir=Path(tmp) / run,
                log=lambda message: None,
            )
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
    return {
        "training tokens/s streaming from the store / tensors in memory (target >= 0.9)": statistics.median(
            offline_ratio
        ),
        "training tokens/s, offline (from the store)": statistics.median(offline_rates),
        "training tokens/s, online (target beside the trainer)": statistics.median(online_rates),
    }


def run_bench(quick: bool = False, only: str | None = None, threads: int | None = None) -> int:
    # On a CPU-only machine the tiny demo model gains nothing from a second intra-op thread, and a
    # spare core is what lets writes and uploads overlap the forward (a GPU node has the whole CPU
    # for them). Both sides of every ratio run under the same setting.
    threads = threads or (os.cpu_count() or 2 if torch.cuda.is_available() else 1)
    torch.set_num_threads(threads)
    print(f"torch intra-op threads: {threads} (--threads to change)")
    count = 64 if quick else 256
    # Extraction's ratios are within ~10 % of 1 and its rounds are short: more of them steady the median.
    rounds = 3 if quick else 5
    figures: dict[str, float] = {}
    if only in (None, "extraction"):
        figures.update(bench_extraction(count, rounds))
    if only in (None, "training"):
        figures.update(bench_training(count, steps=4 if quick else 10, rounds=2 if quick else 3))
    print("")
    for name, value in figures.items():
        print(f"  {value:10.3f}  {name}")
    if WITH_WRITES_FIGURE in figures:
        print(
            f"\nwith-writes ratio: {figures[WITH_WRITES_FIGURE]:.3f} (extraction with writes to a local "
            f"store / the same capture alone; same samples, median of {rounds} interleaved rounds; "
            "target >= 0.9)"
        )
    return 0
