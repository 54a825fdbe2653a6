"""Extraction figures: capture ours vs the anchors' way, and what writes and uploads cost on top.

Every variant runs the same samples through the same `HiddenStateCapture` and batches, interleaved
over rounds; each figure is the median round's ratio.
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

from dflash_assets import settings, terminal
from dflash_assets.bench.capture_ways import run_anchors_way, run_capture
from dflash_assets.bench.workload import TOKEN_BUDGET, demo_layer_ids, demo_samples
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
from dflash_assets.storage.moto_server import moto_available, start_moto_server
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.demo_model import ensure_demo_model
from dflash_assets.target.model import load_target_model


def _ours(model, samples: Sequence[TokenizedSample], layer_ids: list[int], to_host: bool = True):
    """Capture with early stop over length-bucketed batches, exactly as extraction captures: with
    `to_host`, each batch also goes to the host as bf16 through extraction's own `HostTransfer` (capture
    alone); without, nothing leaves the device (the forward alone). Returns (real tokens, padding)."""
    padding = run_capture(model, samples, layer_ids, to_host, TOKEN_BUDGET)
    return sum(s.num_tokens for s in samples), padding


def _anchors(model, samples: Sequence[TokenizedSample], layer_ids: list[int]) -> tuple[int, float]:
    """Full forward with output_hidden_states=True (LM head included) over dataset-order batches."""
    return sum(s.num_tokens for s in samples), run_anchors_way(model, samples, layer_ids)


def _timed(fn: Callable[[], tuple[int, float]]) -> tuple[float, float]:
    start = time.perf_counter()
    tokens, padding = fn()
    return tokens / (time.perf_counter() - start), padding


def _extract_with_io(
    model, samples, layer_ids, store_url: str, staging: Path, budget: int, hidden_state_dtype: str = "bf16"
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
            prefix=f"{HIDDEN_STATES_PREFIX}/bench-{time.monotonic_ns()}",
            staging_dir=staging,
            uploader=uploader,
            device=str(next(model.parameters()).device),
            max_tokens_per_batch=TOKEN_BUDGET,
            log=lambda message: None,
            progress_every_s=3600,
            hidden_state_dtype=hidden_state_dtype,
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
    samples = demo_samples(Path(model_dir), count)
    layer_ids = demo_layer_ids(model)
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
        "import sys; from dflash_assets.bench.extraction import _peak_memory_child as f; "
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
FP8_WRITES_FIGURE = "extraction with writes, fp8 / bf16 (local store, same run)"


def bench_extraction(count: int, rounds: int) -> dict[str, float]:
    """Every variant runs the same samples through the same `HiddenStateCapture` and batches; the
    variants take turns within each round (reversed every other round, so drift cancels) and each
    figure is the median round's ratio."""
    model_dir = ensure_demo_model(settings.cache_dir())
    model = load_target_model(model_dir, "cuda:0" if torch.cuda.is_available() else "cpu")
    samples = demo_samples(model_dir, count)
    layer_ids = demo_layer_ids(model)
    print(
        f"extraction: demo target ({model.config.num_hidden_layers} layers, layers {layer_ids}), "
        f"{len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens, {rounds} interleaved rounds"
    )
    _ours(model, samples[:8], layer_ids), _anchors(model, samples[:8], layer_ids)  # warm-up

    budget = 4 * 2**20
    speedups, local_ratios, local_vs_forward, s3_ratios, peaks, cpu_ratios = [], [], [], [], [], []
    fp8_ratios, fp8_cpu_ratios = [], []
    ours_padding = anchor_padding = 0.0
    moto = _moto_store()
    # Capture alone and with writes run back to back in every round, so they see the same load.
    kinds = ["anchors", "forward", "capture", "local", "local_fp8"] + (["s3"] if moto else [])
    progress = terminal.TaskProgress("bench extraction", rounds * len(kinds), "measurements")
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            rate: dict[str, float] = {}
            cpu: dict[str, float] = {}  # process CPU seconds (every thread): load elsewhere hardly moves it
            for kind in kinds if round_index % 2 == 0 else reversed(kinds):
                progress.set_status(f"round {round_index + 1}/{rounds}: {kind}")
                cpu_started = time.process_time()
                if kind in ("local", "local_fp8", "s3"):
                    url = moto[0] if kind == "s3" else str(Path(tmp) / f"store-{kind}-{round_index}")
                    staging = Path(tmp) / f"staging-{kind}-{round_index}"
                    dtype = "fp8" if kind == "local_fp8" else "bf16"
                    io = (url, staging, budget, dtype)
                    rate[kind], peak = _extract_with_io(model, samples, layer_ids, *io)
                    peaks.append(peak)
                elif kind == "anchors":
                    rate[kind], anchor_padding = _timed(partial(_anchors, model, samples, layer_ids))
                else:
                    to_host = kind == "capture"
                    rate[kind], ours_padding = _timed(partial(_ours, model, samples, layer_ids, to_host))
                cpu[kind] = time.process_time() - cpu_started
                progress.advance()
            speedups.append(rate["capture"] / rate["anchors"])
            local_ratios.append(rate["local"] / rate["capture"])
            local_vs_forward.append(rate["local"] / rate["forward"])
            cpu_ratios.append(cpu["capture"] / cpu["local"])
            fp8_ratios.append(rate["local_fp8"] / rate["local"])
            fp8_cpu_ratios.append(cpu["local"] / cpu["local_fp8"])
            if moto:
                s3_ratios.append(rate["s3"] / rate["capture"])
            print(
                f"  round {round_index + 1}: tokens/s forward alone {rate['forward']:,.0f}, capture alone "
                f"{rate['capture']:,.0f}, with writes {rate['local']:,.0f} (fp8 {rate['local_fp8']:,.0f})"
                + (f", with S3 uploads {rate['s3']:,.0f}" if moto else "")
                + f", anchors' way {rate['anchors']:,.0f}; CPU s capture {cpu['capture']:.2f}, "
                f"with writes {cpu['local']:.2f}",
                flush=True,
            )
    progress.finish()
    if moto:
        moto[1]()
    memory_ours = _peak_memory("ours", model_dir, count)
    memory_anchor = _peak_memory("anchors", model_dir, count)
    figures = {
        "capture tokens/s, ours / anchors' way (target >= 1.0)": statistics.median(speedups),
        WITH_WRITES_FIGURE: statistics.median(local_ratios),
        "extraction with writes (local store) / forward alone": statistics.median(local_vs_forward),
        FP8_WRITES_FIGURE: statistics.median(fp8_ratios),
        # On a CPU the quantisation runs on the cores the forward uses; on a GPU it runs on the device.
        "CPU time, extraction with writes bf16 / fp8": statistics.median(fp8_cpu_ratios),
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
