"""`dflash-assets bench`: throughput and memory ratios, each measured within one run.

The machine may be shared and noisy, so every figure is a ratio of two measurements taken side by
side, interleaved over several rounds, and the median round is reported. Nothing here asserts: the
manual (docs/benchmark.md) records the figures and the targets they are read against.
"""

from __future__ import annotations

import os

import torch

from dflash_assets import settings
from dflash_assets.bench.extraction import FP8_WRITES_FIGURE, WITH_WRITES_FIGURE, bench_extraction
from dflash_assets.bench.fidelity import bench_fidelity
from dflash_assets.bench.generation import bench_generation, bench_target_generation
from dflash_assets.bench.scaling import cpu_scaling
from dflash_assets.bench.training import bench_training


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
    notes: list[str] = []
    if only in (None, "scaling"):
        scaling, notes = cpu_scaling(quick)
        figures.update(scaling)
    if only in (None, "generation"):
        figures.update(
            bench_generation(8, rounds=2, max_new_tokens=32, range_size=16)
            if quick
            else bench_generation(64, rounds=3)
        )
        if settings.TARGET_MODEL.get() != "demo":  # a real model beside the demo's
            from dflash_assets.orchestration.resources import TargetModelResource

            target = TargetModelResource()
            figures.update(
                bench_target_generation(
                    str(target.model_dir()), target.name, count=8, rounds=1, max_new_tokens=64
                )
                if quick
                else bench_target_generation(str(target.model_dir()), target.name)
            )
        # Every available engine on the same prompts (vLLM's server where an environment has it).
        from dflash_assets.bench.engines import bench_engines
        from dflash_assets.orchestration.resources import TargetModelResource

        target = TargetModelResource()
        figures.update(
            bench_engines(str(target.model_dir()), target.name, count=8, max_new_tokens=32)
            if quick
            else bench_engines(str(target.model_dir()), target.name)
        )
    if only in (None, "fidelity"):
        # As the demo trains: every bundled conversation, 240 steps of 4 (quick: a smoke run).
        figures.update(bench_fidelity(64 if quick else 500, steps=12 if quick else 240))
    print("")
    for name, value in figures.items():
        print(f"  {value:10.3f}  {name}")
    if WITH_WRITES_FIGURE in figures:
        print(
            f"\nwith-writes ratio: {figures[WITH_WRITES_FIGURE]:.3f} (extraction with writes to a local "
            f"store / the same capture alone; same samples, median of {rounds} interleaved rounds; "
            "target >= 0.9)"
        )
    if FP8_WRITES_FIGURE in figures:
        print(f"fp8 / bf16 with-writes ratio: {figures[FP8_WRITES_FIGURE]:.3f} (same rounds)")
    if notes:
        print("")
        for line in notes:
            print(line)
    return 0
